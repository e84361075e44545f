"""One run of the model: a condition on a trace of a scenario, measured into
the result record."""
from __future__ import annotations

from . import measures
from .conditions import Condition, get_condition
from .model import simulate
from .profile import Profile
from .scenario import PAPER
from .workload import make_trace


def run_one(profile: Profile, condition: str | Condition, pulse: float, seed: int, max_batched_tokens=None,
            mixed_prompts=False, trace=None, fast_forward=True) -> dict:
    """Simulate `condition` on the reference scenario at `pulse` with the
    trace of `seed` (or the `trace` given, which must be of the same
    scenario) and return the result record."""
    cond = condition if isinstance(condition, Condition) else get_condition(condition)
    sc = PAPER.with_(pulse=pulse)
    if trace is None:
        trace = make_trace(profile.capacity, sc, seed, mixed_prompts=mixed_prompts)
    log = simulate(profile, trace, cond, sc, seed, max_batched_tokens=max_batched_tokens, fast_forward=fast_forward)
    inputs = {"model": profile.name, "condition": cond.name, "pulse": pulse, "seed": seed,
              "max_batched_tokens": max_batched_tokens or profile.engine["max_num_batched_tokens"],
              "mixed_prompts": mixed_prompts, "condition_settings": cond.settings(),
              "profile_provenance": profile.provenance.get("kind")}
    return measures.record(log, sc, profile.capacity, inputs)
