"""Latency at a steady load (`llmsim latency`): calls sent straight
to the engine at a Poisson or constant rate — no retries, no proxy controls,
no deadline — and their time to first token and to last token (means and
percentiles)."""
from __future__ import annotations

import numpy as np

from .conditions import Condition
from .model import Run
from .policy.proxy import ProxyConfig
from .profile import Profile
from .scenario import PAPER, Scenario
from .workload import make_trace

STRAIGHT = Condition("straight", retries=False, proxy=ProxyConfig(cancellation="off"))


def latency(profile: Profile, rate: float, duration_s: float = 600.0, warmup_s: float = 60.0,
            scenario: Scenario = PAPER, seed: int = 0, max_batched_tokens: int | None = None,
            mixed_prompts: bool = False, arrivals: str = "poisson") -> dict:
    """Calls arriving at `rate` for `duration_s` (`arrivals` poisson or
    constant); the statistics are of the calls created after `warmup_s`."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    sc = scenario.with_(deadline_s=1e9, delivery_horizon_s=1e9)
    trace = make_trace(1.0, sc, seed, mixed_prompts=mixed_prompts, phases=[(0.0, duration_s, rate, arrivals)])
    run = Run(profile, trace, STRAIGHT, sc, seed, max_batched_tokens)
    log = run.run(until=duration_s + 3600.0)
    ex = [e for e in log.executions if e.created_at >= warmup_s and e.fate == "completed"]
    ttft = np.array([e.first_token_at - e.created_at for e in ex])
    e2e = np.array([e.finished_at - e.created_at for e in ex])
    if len(ex) == 0:
        raise RuntimeError("no call completed after the warm-up; lengthen --duration")

    def pct(a, q):
        return float(np.percentile(a, q))

    return {"model": profile.name, "rate": rate, "duration_s": duration_s, "warmup_s": warmup_s, "seed": seed,
            "calls": len(ex), "ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90),
            "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
            "ttft_mean": float(ttft.mean()), "e2e_mean": float(e2e.mean()), "arrivals": arrivals,
            "undelivered": sum(1 for e in log.executions if e.fate != "completed"),
            "wall_s": log.wall_s}
