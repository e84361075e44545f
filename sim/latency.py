"""Latency at a steady load (`llmsim latency`): calls sent straight
to the engine at a Poisson or constant rate — no retries, no proxy controls,
no deadline — and their time to first token and to last token (means and
percentiles). `latency_stages`: a load test's stages one after another, as a
load generator runs them (each from its first call to its last, a stage that
starts `drained` only once every call of the stage before has finished), in
one run, so that what a stage leaves in the prefix cache serves the next.
`latency_windows`: calls as an engine's metrics tell they came, in one run,
seen in windows as the engine's histograms see them."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from .conditions import Condition
from .model import Run
from .policy.proxy import ProxyConfig
from .profile import Profile
from .scenario import PAPER, Scenario
from .workload import Trace, make_trace

STRAIGHT = Condition("straight", retries=False, proxy=ProxyConfig(cancellation="off"))


def run_straight(profile: Profile, scenario: Scenario, seed: int, phases: list[tuple],
                 max_batched_tokens: int | None = None, mixed_prompts: bool = False,
                 prefixes: list[tuple] | None = None):
    """The RunLog of calls arriving by `phases` ((start, end, rate, arrivals)
    each) sent straight to the engine (`STRAIGHT`, no deadline), run to an
    hour past the last phase's end; `prefixes` ((calls, prefix tokens) a
    phase, `with_phase_prefixes`), where given, the prefix each phase's calls
    share."""
    sc = scenario.with_(deadline_s=1e9, delivery_horizon_s=1e9)
    trace = make_trace(1.0, sc, seed, mixed_prompts=mixed_prompts, phases=phases)
    if prefixes is not None:
        trace = with_phase_prefixes(trace, [n for n, _ in prefixes], [p for _, p in prefixes])
    return Run(profile, trace, STRAIGHT, sc, seed, max_batched_tokens).run(until=phases[-1][1] + 3600.0)


def latency(profile: Profile, rate: float, duration_s: float = 600.0, warmup_s: float = 60.0,
            scenario: Scenario = PAPER, seed: int = 0, max_batched_tokens: int | None = None,
            mixed_prompts: bool = False, arrivals: str = "poisson") -> dict:
    """Calls arriving at `rate` for `duration_s` (`arrivals` one of
    `sim.scenario.ARRIVALS`); the statistics are of the calls created after
    `warmup_s`."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration must be positive")
    log = run_straight(profile, scenario, seed, [(0.0, duration_s, rate, arrivals)], max_batched_tokens,
                       mixed_prompts)
    ex = [e for e in log.executions if e.created_at >= warmup_s and e.fate == "completed"]
    if len(ex) == 0:
        raise RuntimeError("no call completed after the warm-up; lengthen --duration")

    return {"model": profile.name, "rate": rate, "duration_s": duration_s, "warmup_s": warmup_s, "seed": seed,
            "calls": len(ex), **_stats(ex), "arrivals": arrivals,
            "undelivered": sum(1 for e in log.executions if e.fate != "completed"),
            "wall_s": log.wall_s}


def _stats(ex: list) -> dict:
    """TTFT and E2E percentiles and means of completed executions."""
    ttft = np.array([e.first_token_at - e.created_at for e in ex])
    e2e = np.array([e.finished_at - e.created_at for e in ex])

    def pct(a, q):
        return float(np.percentile(a, q))

    return {"ttft_p50": pct(ttft, 50), "ttft_p90": pct(ttft, 90), "e2e_p50": pct(e2e, 50), "e2e_p90": pct(e2e, 90),
            "ttft_mean": float(ttft.mean()), "e2e_mean": float(e2e.mean())}


def latency_stages(profile: Profile, stages: list[tuple], scenario: Scenario = PAPER, seed: int = 0,
                   max_batched_tokens: int | None = None, arrivals: str = "poisson",
                   gap_s: float | None = None) -> list[dict]:
    """A load test's stages, one after another in one run from an empty
    engine: `stages` is a list of (rate calls/s, duration s) or (rate,
    duration, arrivals, drained), arrivals one of `sim.scenario.ARRIVALS`
    (default `arrivals`) and drained (default True) whether the stage starts
    only once every call of the stage before has finished (as
    inference-perf's stages do) rather than right after its last arrival.
    The scenario's lengths and prompt pool (whose turn restarts at every
    stage) give the calls; what a stage leaves in the engine (its prefix
    cache) serves the next. Per stage, the statistics of all its calls (no
    warm-up) and where it started (`start_s`).

    A drained start is known only once the stage before has run: a stage is
    placed after the one before with a gap, the run made, and where a stage
    had not drained by the next one's start, the gap widened to its drain
    time and the run made again. An idle engine keeps no clock (its step
    times, prefix cache and queues do not depend on when the next call
    comes), so any gap past the drain gives the run of a start right at it.
    `gap_s`: the first gap tried (default 60 s + the stage's duration)."""
    if not stages:
        raise ValueError("no stage to run")
    st = [(float(x[0]), float(x[1]), x[2] if len(x) > 2 else arrivals, bool(x[3]) if len(x) > 3 else True)
          for x in stages]
    for rate, dur, _, _ in st:
        if rate <= 0 or dur <= 0:
            raise ValueError("a stage's rate and duration must be positive")
    gaps = [0.0] + [(60.0 + dur if gap_s is None else float(gap_s)) if drained else 0.0
                    for (_, dur, _, _), (_, _, _, drained) in zip(st, st[1:])]
    while True:
        starts, t = [], 0.0
        for (rate, dur, _, _), gap in zip(st, gaps):
            t += gap
            starts.append(t)
            t += dur
        log = run_straight(profile, scenario, seed, [(a, a + dur, rate, kind) for a, (rate, dur, kind, _)
                                                     in zip(starts, st)], max_batched_tokens)
        bounds = starts[1:] + [np.inf]
        by_stage = [[e for e in log.executions if a <= e.created_at < b] for a, b in zip(starts, bounds)]
        late = next((k for k in range(len(st) - 1) if st[k + 1][3] and any(
            e.fate != "completed" or e.finished_at >= starts[k + 1] for e in by_stage[k])), None)
        if late is None:
            break
        end = starts[late] + st[late][1]
        last = max((e.finished_at for e in by_stage[late] if e.fate == "completed"), default=end)
        gaps[late + 1] = max(2.0 * gaps[late + 1], last - end + 60.0)
    out = []
    for (rate, dur, kind, drained), a, ex_all in zip(st, starts, by_stage):
        ex = [e for e in ex_all if e.fate == "completed"]
        if not ex:
            raise RuntimeError(f"no call of the stage at {rate:g} calls/s completed")
        out.append({"model": profile.name, "rate": rate, "duration_s": dur, "arrivals": kind, "drained": drained,
                    "start_s": a, "seed": seed, "calls": len(ex), **_stats(ex),
                    "undelivered": len(ex_all) - len(ex), "wall_s": log.wall_s})
    return out


def with_phase_prefixes(trace: Trace, counts: list[int], prefixes: list[int]) -> Trace:
    """`trace` (its calls in phase order, `counts` a phase) with each
    phase's calls sharing its `prefixes` tokens (one prefix, group 0; a
    call's cut to its prompt less a token)."""
    pre = np.repeat(np.asarray(prefixes, dtype=np.int64), counts)
    pre = np.minimum(pre, trace.prompt_len - 1)
    return replace(trace, shared_prefix=int(pre.min()), prefix_len=pre,
                   prefix_group=np.zeros(len(trace), dtype=np.int64))


def latency_windows(profile: Profile, phases: list[tuple], windows: list[tuple], scenario: Scenario = PAPER,
                    seed: int = 0, max_batched_tokens: int | None = None) -> list[dict]:
    """Calls straight to the engine in one run, `phases` giving when they
    came: (start s, end s, calls) or (start s, end s, calls, prefix
    tokens), each phase's calls at uniform random times in it (`uniform_exact`:
    its count exact), with a prefix given each of its calls shares that many
    leading tokens with every other call's (one prefix, cut to the call's
    prompt; 0: none), else the scenario's; per window (start s, end s), the
    means the engine's own histograms observe in it, as vLLM's `/metrics`
    report them: the TTFT of the calls whose first token came in it and
    the E2E of the calls that finished in it (`ttft_calls`, `calls`: how
    many; a mean None where none did)."""
    kept = [p for p in phases if p[2] >= 1 and p[1] > p[0]]
    # a rate whose count is `calls` exactly (uniform_exact takes int(rate x length))
    ph = [(float(p[0]), float(p[1]), (p[2] + 0.5) / (p[1] - p[0]), "uniform_exact") for p in kept]
    if not ph:
        return [{"ttft_mean": None, "e2e_mean": None, "ttft_p90": None, "e2e_p90": None, "ttft_calls": 0,
                 "calls": 0} for _ in windows]
    prefixes = [(int(p[2]), int(p[3])) for p in kept] if all(len(p) > 3 for p in kept) else None
    log = run_straight(profile, scenario, seed, ph, max_batched_tokens, prefixes=prefixes)
    done = [e for e in log.executions if e.fate == "completed"]
    first = np.array([e.first_token_at for e in done])
    end = np.array([e.finished_at for e in done])
    born = np.array([e.created_at for e in done])
    out = []
    for a, b in windows:
        ft = (first >= a) & (first < b)
        fin = (end >= a) & (end < b)
        ttft, e2e = (first - born)[ft], (end - born)[fin]
        out.append({"ttft_mean": float(ttft.mean()) if len(ttft) else None,
                    "e2e_mean": float(e2e.mean()) if len(e2e) else None,
                    "ttft_p90": float(np.percentile(ttft, 90)) if len(ttft) else None,
                    "e2e_p90": float(np.percentile(e2e, 90)) if len(e2e) else None,
                    "ttft_calls": int(len(ttft)), "calls": int(len(e2e))})
    return out
