"""The reference design's blocks: which conditions, pulses, step budgets and
prompt mixes each block runs on which models, and how a block's rows are
grouped into its cells."""
from __future__ import annotations

from dataclasses import dataclass

from ..conditions import DIAGNOSTIC
from .sweep import Cell, cell_key, grid

MODELS = ("qwen2.5-7b", "qwen3-14b", "llama-3.1-8b")
DEFAULT_SEEDS = 3
PULSE = 2.7
COHORTS = ("pulse", "hold", "primary")


@dataclass(frozen=True)
class Block:
    name: str
    title: str
    conditions: tuple[str, ...]
    pulses: tuple[float, ...] = (PULSE,)
    max_batched_tokens: tuple[int | None, ...] = (None,)
    mixed_prompts: tuple[bool, ...] = (False,)

    def cells(self, models=MODELS, seeds=range(DEFAULT_SEEDS)) -> list[Cell]:
        return grid(list(models), self.conditions, self.pulses, list(seeds), self.max_batched_tokens,
                    self.mixed_prompts)


BLOCKS: tuple[Block, ...] = (
    Block("diagnostic", "Diagnostic (pulse 2.7 Ĉ)", DIAGNOSTIC),
    Block("trigger", "Trigger sweep (pulse 1.5, 2, 2.7 Ĉ)", DIAGNOSTIC, pulses=(1.5, 2.0, 2.7)),
    Block("tracing", "Tracing at 8K / 2K step budget", DIAGNOSTIC, max_batched_tokens=(8192, 2048)),
    Block("composition", "Composition of controls",
          ("coalesce", "budget", "budget-first", "lookup-first", "coalesce+cancel", "budget+cancel")),
    Block("queue", "Queue policy (proxy cap 100)", ("proxy-cap", "deadline-check", "lifo")),
    Block("engine-cap", "Engine cap", ("engine-cap-338", "engine-cap-338+cancel", "engine-cap-100")),
    Block("deferral", "Deferred cancellation", ("deferred", "coalesce+cancel")),
    Block("budget-cancel", "Retry budget with cancellation", ("budget+cancel", "budget", "cancel")),
    Block("mixed", "Mixed prompts (half at 3,000 tokens)", DIAGNOSTIC, mixed_prompts=(True,)),
)
BLOCK_NAMES = tuple(b.name for b in BLOCKS)
FIGURES = ("diagnostic_series.png", "execution_rates.png", "prompt_work_shares.png",
           "delivery_shares.png", "creation_vs_delivery.png")
# per-block figures: hold delivery against the block's varied input; drawn when the block is reported
BLOCK_FIGURES = {"trigger": "trigger_hold.png", "tracing": "tracing_hold.png", "mixed": "mixed_hold.png"}


def get_blocks(names=None) -> list[Block]:
    if names is None:
        return list(BLOCKS)
    by = {b.name: b for b in BLOCKS}
    bad = [n for n in names if n not in by]
    if bad:
        raise ValueError(f"unknown block(s) {', '.join(bad)}; valid: {', '.join(BLOCK_NAMES)}")
    return [by[n] for n in names]


def paper_cells(blocks=None, models=MODELS, seeds=DEFAULT_SEEDS) -> list[Cell]:
    """The union of the blocks' cells, each cell once."""
    seen, out = set(), []
    for b in get_blocks(blocks):
        for c in b.cells(models, range(seeds)):
            if c.key not in seen:
                seen.add(c.key)
                out.append(c)
    return out


def share(x, n):
    return x / n if n else float("nan")


def block_rows(block: Block, rows: list[dict], models, seeds) -> dict[tuple, list[dict]]:
    """The block's rows grouped by cell without the seed, in the block's order."""
    by_key = {cell_key(r): r for r in rows}
    groups: dict[tuple, list[dict]] = {}
    for c in block.cells(models, range(seeds)):
        r = by_key.get(c.key)
        g = groups.setdefault((c.model, c.condition, c.pulse, c.max_batched_tokens, c.mixed_prompts), [])
        if r is not None:
            g.append(r)
    return groups
