"""Steady-load cancellation waste (docs/model.md): what client disconnects, stop
sequences and max_tokens cutoffs cost a continuous-batching engine, under
both KV allocation policies (on-demand, reserve) and both abort latencies
(v1: next step boundary; v0: one iteration later).

Calls go straight to the engine at a steady Poisson rate (the client closes
and the proxy cancels at once, so a disconnect is an engine abort at the
abandon time). Every call draws, from one seeded stream shared by all
settings (common random numbers):

* **Prompt and natural response length** — lognormal, ShareGPT-like. The
  means are those the vLLM paper reports for ShareGPT (Kwon et al., SOSP 2023,
  docs/model.md#sources: 161.3 input and 338.0 output tokens per request); the
  spread sigma = 1.0 for both is our assumption, giving medians of 97.8 and
  205.0 tokens and a long tail (about 3% of responses exceed 1,500 tokens).
  Prompts are clipped to [4, 4096] tokens.
* **How the response ends** — every call asks for `max_tokens` (default
  2,048, a common client setting). A response whose natural length is below
  it ends there (end of sequence); with probability `stop_rate` a stop
  sequence ends it earlier, after a uniform share of its natural length;
  either way the engine gets `stop_at`. A natural length of `max_tokens` or
  more is cut by `max_tokens`.
* **Disconnect** — with probability `cancel_rate` the client abandons the
  call after a uniform share of its nominal duration (0.5 s plus its length
  at a nominal time per output token of a 64-request decode step); a call
  that finishes first is not cancelled, so the measured `abort_rate` is at
  most the cancel rate.

Measures over calls planned in [warmup, duration) (tokens and busy time over
the same window of engine time): useful tokens/s (outputs of completed
calls), the engine's busy fraction, the share of busy time spent on tokens no
client received, queueing delay (arrival to first scheduled step),
`abort_rate`, `completion_ratio`, `useful_token_ratio` (as in every run's record), the
reservation gap (reserved − used blocks, time-weighted mean and peak, reserve
only), and the throughput loss against 0% cancellation.

Work no client received, counted in tokens (each computed token weighted
alike — a token-weighted share of busy time, not a step-time attribution):
for an aborted call, the output tokens scheduled after its abort arrived
(in-flight steps, and the extra iteration under v0) and its prompt tokens —
all of them if no output had reached the client, else those computed after
the abort arrived.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import numpy as np

from ..clock import Clock
from ..engine.core import EngineConfig, EngineCore
from ..engine.request import Request
from ..profile import Profile
from ..runlog import ExecutionRecord

SHAREGPT = {"prompt_mean": 161.3, "prompt_sigma": 1.0, "response_mean": 338.0, "response_sigma": 1.0,
            "source": "means: vLLM paper (Kwon et al., SOSP 2023) ShareGPT statistics; sigma: assumed"}
KV_POLICIES = ("on-demand", "reserve")
ABORT_LATENCIES = ("v1", "v0")
SETTINGS = tuple((kv, lat) for kv in KV_POLICIES for lat in ABORT_LATENCIES)
INF = float("inf")


def _lognormal(rng, mean: float, sigma: float, n: int) -> np.ndarray:
    return rng.lognormal(math.log(mean) - sigma * sigma / 2.0, sigma, n)


def nominal_tpot(profile: Profile, n: int = 64) -> float:
    """Time per output token of an n-request decode step at the mean context."""
    ctx = SHAREGPT["prompt_mean"] + SHAREGPT["response_mean"] / 2.0
    return profile.step_time.duration(n, n, 0.0, n * ctx)


def default_rate(profile: Profile) -> float:
    """An offered load near the engine's decode capacity: all seats (or as many
    mean-length requests as the KV cache holds) decoding, 90% of their output
    rate divided by the mean response length."""
    e = profile.engine
    per_req = SHAREGPT["prompt_mean"] + SHAREGPT["response_mean"]
    n = max(1, min(e["max_num_seqs"], int(e["num_gpu_blocks"] * e["block_size"] / per_req)))
    tok_s = n / profile.step_time.duration(n, n, 0.0, n * (SHAREGPT["prompt_mean"] + SHAREGPT["response_mean"] / 2))
    return 0.9 * tok_s / SHAREGPT["response_mean"]


def make_calls(rate: float, duration_s: float, max_tokens: int, stop_rate: float, tpot_s: float,
               seed: int = 0, max_prompt: int = 4096) -> dict:
    """The calls of one run; the disconnect draw `u_cancel` is compared with
    each cancel rate, so every rate and setting sees the same calls."""
    rng = np.random.default_rng([seed, 10])
    n = rng.poisson(rate * duration_s)
    arrival = np.sort(rng.uniform(0.0, duration_s, n))
    prompt = np.clip(np.rint(_lognormal(rng, SHAREGPT["prompt_mean"], SHAREGPT["prompt_sigma"], n)),
                     4, max_prompt).astype(np.int64)
    natural = np.maximum(1, np.rint(_lognormal(rng, SHAREGPT["response_mean"], SHAREGPT["response_sigma"], n)))
    natural = natural.astype(np.int64)
    stopped = rng.random(n) < stop_rate
    stop_point = np.maximum(1, np.ceil(rng.random(n) * natural)).astype(np.int64)
    length = np.where(stopped, stop_point, natural)
    ended = length < max_tokens                       # else max_tokens cuts it
    u_cancel = rng.random(n)
    abandon_after = rng.random(n) * (0.5 + np.minimum(length, max_tokens) * tpot_s)
    return {"arrival": arrival, "prompt": prompt, "length": length, "ended": ended,
            "stopped": stopped, "u_cancel": u_cancel, "abandon_after": abandon_after,
            "max_tokens": int(max_tokens)}


def simulate_waste(profile: Profile, calls: dict, cancel_rate: float, kv_policy: str = "on-demand",
                   abort_latency: str = "v1", horizon_s: float = 3600.0, snapshot_times=()):
    """One run; returns (engine, requests, records, busy seconds by each
    snapshot time)."""
    env = Clock()
    n = len(calls["arrival"])
    cancelled = calls["u_cancel"] < cancel_rate
    events = [(float(calls["arrival"][i]), 0, i) for i in range(n)]
    events += [(float(calls["arrival"][i] + calls["abandon_after"][i]), 1, i) for i in range(n) if cancelled[i]]
    events.sort()
    times = [e[0] for e in events]
    pos = [0]

    def next_input() -> float:
        return times[pos[0]] if pos[0] < len(times) else INF

    cfg = EngineConfig(replace(profile.scheduler_config(), kv_policy=kv_policy), profile.depth,
                       abort_latency=abort_latency)
    eng = EngineCore(env, cfg, profile.step_time, next_input_time=next_input)
    mt = calls["max_tokens"]
    recs = [ExecutionRecord(id=i, call=i, attempt=0, prompt_len=int(calls["prompt"][i]), max_tokens=mt,
                            created_at=float(calls["arrival"][i])) for i in range(n)]
    reqs = [Request(i, i, int(calls["prompt"][i]), mt, 0, record=recs[i],
                    stop_at=int(calls["length"][i]) if calls["ended"][i] else None) for i in range(n)]

    def feed():
        for t, kind, i in events:
            if t > env.now:
                yield env.timeout(t - env.now)
            pos[0] += 1
            if kind == 0:
                recs[i].dispatched_at = t
                recs[i].accepted = eng.add_request(reqs[i], env.now)
            elif recs[i].fate == "":
                recs[i].cancel_requested_at = t
                eng.abort_request(reqs[i], env.now)

    busy_by = {}

    def snap():
        for t in sorted(snapshot_times):
            yield env.timeout(t - env.now)
            busy_by[t] = eng.work_by(t)[1]

    env.process(feed())
    env.process(snap())
    end = (times[-1] if times else 0.0) + horizon_s
    env.run(until=end)
    return eng, reqs, recs, busy_by


def _gap_stats(gap_log, t0: float, t1: float) -> tuple[float, int]:
    """Time-weighted mean and peak of a step-wise (t, value) series over [t0, t1)."""
    if not gap_log:
        return 0.0, 0
    area, peak = 0.0, 0
    for k, (t, g) in enumerate(gap_log):
        nxt = gap_log[k + 1][0] if k + 1 < len(gap_log) else t1
        a, b = max(t, t0), min(nxt, t1)
        if b > a:
            area += g * (b - a)
            peak = max(peak, g)
    return area / (t1 - t0), int(peak)


def measure(eng: EngineCore, reqs, recs, busy_by: dict, warmup_s: float, duration_s: float) -> dict:
    win = duration_s - warmup_s
    sel = [i for i, r in enumerate(recs) if warmup_s <= r.created_at < duration_s and r.accepted]
    done = [i for i in sel if recs[i].fate == "completed"]
    aborted = [i for i in sel if recs[i].fate == "aborted"]
    max_sum = sum(recs[i].max_tokens for i in sel)
    useful = sum(recs[i].tokens_generated for i in done)
    # engine output of completed calls finishing inside the window
    useful_in_window = sum(r.tokens_generated for r in recs
                           if r.fate == "completed" and warmup_s <= r.finished_at < duration_s)
    work = discarded = aborted_work = 0
    for i in sel:
        r, q = recs[i], reqs[i]
        if r.fate == "aborted":
            out = q.num_output_tokens
            late_out = max(0, out - q.outputs_seen)
            late_prompt = r.prompt_computed if q.outputs_seen == 0 else r.prompt_in_flight
            discarded += late_out + late_prompt
            aborted_work += out + r.prompt_computed
        else:
            out = r.tokens_generated
        work += out + r.prompt_computed
    busy = (busy_by[duration_s] - busy_by[warmup_s]) / win
    waits = np.array([recs[i].first_scheduled_at - recs[i].created_at for i in sel
                      if recs[i].first_scheduled_at == recs[i].first_scheduled_at])
    gap_mean, gap_peak = _gap_stats(eng.gap_log, warmup_s, duration_s)
    share = discarded / work if work else 0.0
    return {
        "calls": len(sel),
        "useful_tokens_per_s": useful_in_window / win,
        "busy_fraction": busy,
        "discarded_work_share": share,                   # of computed tokens: none reached a client
        "discarded_busy_share": share,                   # token-weighted share of busy time
        "aborted_work_share": aborted_work / work if work else 0.0,
        "queueing_delay_mean_s": float(waits.mean()) if len(waits) else 0.0,
        "queueing_delay_p90_s": float(np.percentile(waits, 90)) if len(waits) else 0.0,
        "abort_rate": len(aborted) / len(sel) if sel else 0.0,
        "completion_ratio": sum(recs[i].tokens_generated for i in sel) / max_sum if max_sum else 0.0,
        "useful_token_ratio": useful / max_sum if max_sum else 0.0,
        "aborted_before_scheduled": sum(1 for i in aborted if not reqs[i].chunks),
        "preemptions": sum(recs[i].preemptions for i in sel),
        "reservation_gap_mean_blocks": gap_mean,
        "reservation_gap_peak_blocks": gap_peak,
        "unfinished": sum(1 for i in sel if recs[i].fate == ""),
    }


def waste_study(profile: Profile, cancel_rates, stop_rate: float = 0.2, rate: float | None = None,
                duration_s: float = 600.0, warmup_s: float | None = None, max_tokens: int = 2048,
                seed: int = 0, settings=SETTINGS, progress=None) -> dict:
    if not cancel_rates or any(not (0.0 <= c <= 1.0) for c in cancel_rates):
        raise ValueError("cancel rates must lie in [0, 1]")
    if not 0.0 <= stop_rate <= 1.0:
        raise ValueError("stop rate must lie in [0, 1]")
    if duration_s <= 0 or max_tokens < 1:
        raise ValueError("duration and max_tokens must be positive")
    if rate is None:
        rate = default_rate(profile)
    if rate <= 0:
        raise ValueError("rate must be positive")
    if warmup_s is None:
        warmup_s = min(60.0, duration_s / 5.0)
    mx = profile.engine["max_model_len"]
    calls = make_calls(rate, duration_s, max_tokens, stop_rate, nominal_tpot(profile), seed,
                       max_prompt=max(4, min(4096, mx - max_tokens)))
    t0 = time.perf_counter()
    rows = []
    for kv, lat in settings:
        base = None
        for c in cancel_rates:
            eng, reqs, recs, busy_by = simulate_waste(profile, calls, c, kv, lat,
                                                      snapshot_times=(warmup_s, duration_s))
            m = measure(eng, reqs, recs, busy_by, warmup_s, duration_s)
            row = {"cancel_rate": c, "kv_policy": kv, "abort_latency": lat, **m}
            if c == 0:
                base = m["useful_tokens_per_s"]
            row["throughput_loss"] = (1.0 - m["useful_tokens_per_s"] / base) if base else None
            rows.append(row)
            if progress:
                progress(row)
    return {"model": profile.name, "rate": rate, "duration_s": duration_s, "warmup_s": warmup_s,
            "seed": seed, "stop_rate": stop_rate, "max_tokens": max_tokens,
            "cancel_rates": list(cancel_rates), "lengths": SHAREGPT,
            "nominal_tpot_s": nominal_tpot(profile), "results": rows, "wall_s": time.perf_counter() - t0}


def table(res: dict) -> str:
    head = (f"{'cancel':>6} {'kv':>9} {'abort':>5} {'useful tok/s':>12} {'loss':>6} {'busy':>5} "
            f"{'discard':>7} {'queue s':>7} {'abort_rate':>10} {'compl':>6} {'useful':>6} {'gap blk':>7}")
    lines = [f"{res['model']}: {res['rate']:.3g} calls/s for {res['duration_s']:g} s (warm-up {res['warmup_s']:g} s), "
             f"max_tokens {res['max_tokens']}, stop rate {res['stop_rate']:g}, seed {res['seed']}", head,
             "-" * len(head)]
    for r in res["results"]:
        loss = "-" if r["throughput_loss"] is None else f"{100 * r['throughput_loss']:5.1f}%"
        lines.append(f"{r['cancel_rate']:>6.2f} {r['kv_policy']:>9} {r['abort_latency']:>5} "
                     f"{r['useful_tokens_per_s']:>12.1f} {loss:>6} {r['busy_fraction']:>5.2f} "
                     f"{100 * r['discarded_busy_share']:>6.2f}% {r['queueing_delay_mean_s']:>7.3f} "
                     f"{r['abort_rate']:>10.3f} {r['completion_ratio']:>6.3f} {r['useful_token_ratio']:>6.3f} "
                     f"{r['reservation_gap_mean_blocks']:>7.0f}")
    return "\n".join(lines)
