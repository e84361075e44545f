"""Engine steps as recorded: the step recorder's rows (`validate/step_recorder.py`,
one JSON line per engine step) and vLLM's ``--enable-logging-iteration-details``
lines, joined into the step rows that the step-time model is fitted to and
checked against (composition, prefill query-key pairs, wall-clock start and
end), and the steps files that keep them (`write_steps`, `read_steps`).

A steps file is JSONL: a first line ``{"meta": {...}}`` (engine, hardware,
date, and ``source``: where the steps came from — ``grid`` for a capture,
``live run`` for steps recorded under load), then one step row per line.

Step row keys: i, t_start, t_end, duration_s, phase, num_reqs, num_tokens,
prefill_reqs, prefill_tokens, prefill_ctx, prefill_pairs, prefill_chunks,
decode_reqs, decode_tokens, decode_ctx, log_elapsed_ms, pending, interval_s.
``interval_s`` is the time from this step's start to the next one's where the
next step followed immediately (work was waiting after this step: ``pending``
above 0, or, for rows recorded without it, a gap under `GAP_MAX_S`); else null.
"""
from __future__ import annotations

import datetime
import json
import os
import re

from sim.engine.step_time import prefill_pairs

from .machine import describe as describe_machine

ITERATION_RE = re.compile(
    r"Iteration\((\d+)\): (\d+) context requests, (\d+) context tokens, (\d+) generation requests, "
    r"(\d+) generation tokens, iteration elapsed time: ([0-9.]+) ms")
KV_TOKENS_RE = re.compile(r"KV cache size: ([0-9,]+) tokens")
# rows recorded without `pending`: a gap this short means the loop went straight on
GAP_MAX_S = 0.02


def parse_iteration_line(line: str) -> dict | None:
    """One ``--enable-logging-iteration-details`` line, or None."""
    m = ITERATION_RE.search(line)
    if not m:
        return None
    i, cr, ct, gr, gt = (int(m.group(k)) for k in range(1, 6))
    return {"i": i, "ctx_reqs": cr, "ctx_tokens": ct, "gen_reqs": gr, "gen_tokens": gt,
            "elapsed_ms": float(m.group(6))}


def parse_iteration_log(text: str) -> list[dict]:
    return [d for d in map(parse_iteration_line, text.splitlines()) if d is not None]


def parse_kv_tokens(text: str) -> int | None:
    """The engine's KV cache size in tokens, from its start-up log."""
    m = KV_TOKENS_RE.search(text)
    return int(m.group(1).replace(",", "")) if m else None


def steps_from_raw(raw_lines: list[dict], iterations: list[dict], phases=None) -> list[dict]:
    """Join the step recorder's rows with vLLM's iteration-log lines by step
    index (`iterations` may be empty); `phases`, when given, labels each step
    by its start time (`phases.label(t)`)."""
    by_i = {d["i"]: d for d in iterations}
    rows = []
    for k, r in enumerate(raw_lines):
        chunks = r["prefill"]
        pt = sum(q for q, _ in chunks)
        it = by_i.get(r["i"])
        if it is not None and it["ctx_tokens"] + it["gen_tokens"] != pt + r["decode_tokens"]:
            it = None                       # not the same step: do not pair them
        rows.append({
            "i": r["i"], "t_start": r["t_start"], "t_end": r["t_end"], "duration_s": r["t_end"] - r["t_start"],
            "phase": phases.label(r["t_start"]) if phases else r.get("phase", "other"),
            "num_reqs": len(chunks) + r["decode_n"], "num_tokens": pt + r["decode_tokens"],
            "prefill_reqs": len(chunks), "prefill_tokens": pt, "prefill_ctx": sum(c for _, c in chunks),
            "prefill_pairs": sum(prefill_pairs(q, c) for q, c in chunks), "prefill_chunks": chunks,
            "decode_reqs": r["decode_n"], "decode_tokens": r["decode_tokens"], "decode_ctx": r["decode_ctx"],
            "log_elapsed_ms": it["elapsed_ms"] if it else None,
            "pending": r.get("pending"),
            "interval_s": _interval(r, raw_lines[k + 1] if k + 1 < len(raw_lines) else None),
        })
    return rows


def _interval(r: dict, nxt: dict | None) -> float | None:
    if nxt is None or nxt["i"] != r["i"] + 1:
        return None
    pending = r.get("pending")
    follows = pending > 0 if pending is not None else nxt["t_start"] - r["t_end"] <= GAP_MAX_S
    return nxt["t_start"] - r["t_start"] if follows else None


def read_raw(step_log, skip: int = 0) -> list[dict]:
    """The recorder's rows in `step_log` from line `skip` on ([] if no file)."""
    if not step_log or not os.path.exists(step_log):
        return []
    with open(step_log) as f:
        return [json.loads(line) for k, line in enumerate(f) if k >= skip and line.strip()]


def engine_meta(eng) -> dict:
    """A started engine's description for a steps file's meta: url, kind,
    vLLM version, model, flags, and the KV cache size from its log."""
    text = eng.log_path.read_text(errors="replace") if getattr(eng, "log_path", None) else ""
    return {"url": eng.url, "kind": eng.kind, "version": eng.version(), "model": eng.model,
            "flags": eng.flags, "kv_cache_tokens": parse_kv_tokens(text)}


def record(eng, path, skip: int = 0, source: dict | None = None, meta: dict | None = None) -> int:
    """Write the steps the engine's recorder holds from line `skip` on, joined
    with its iteration log, as a steps file at `path` (`source` describes the
    run, e.g. ``{"kind": "live run", "run": "capacity protocol"}``); returns
    the number of steps written (0: nothing written)."""
    raw = read_raw(getattr(eng, "step_log", None), skip)
    if not raw:
        return 0
    text = eng.log_path.read_text(errors="replace") if getattr(eng, "log_path", None) else ""
    rows = steps_from_raw(raw, parse_iteration_log(text))
    head = {"engine": meta if meta is not None else engine_meta(eng), "hardware": describe_machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": source or {"kind": "live run"}, "steps": len(rows)}
    write_steps(path, head, rows)
    return len(rows)


def write_steps(path, meta: dict, rows: list[dict]) -> None:
    with open(path, "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")


def read_steps(path) -> tuple[dict, list[dict]]:
    meta, rows = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e.msg})") from None
            if "meta" in d and n == 1:
                meta = d["meta"]
            else:
                rows.append(d)
    return meta, rows
