"""The capacity protocol (docs/model.md, "Calibration") against a live engine, time-scaled for the
tiny CPU engine, beside the same protocol on the simulator.

Both drivers share `sim.capacity.CapacityProtocol` (stage schedule, growth
from 1 s queue samples, stop rule, Ĉ) and the same trace (`make_trace` with
the protocol's stages as phases, the same seed). The live driver replays it
with `validate.loadgen.LoadGen` (open loop, no retries, one task per call, a
per-call deadline) and samples `vllm:num_requests_waiting` every second.

Once it has stopped, the calls go on for `TAIL_S` (the steps of an engine
past saturation, its batches at its seats, are in the steps file; the
protocol's Ĉ is of the stages before).

Time scaling: the workload is calibrate.fit's scaled scenario (prompts and
responses a tenth of the paper workload's), stages of `stage_s` (20 s) instead of 300 s, and
the first stage at `start_fraction` (1/4) of the profile's simulated Ĉ, so
that with factor 1.5 the engine saturates within about five stages
(1/4 x 1.5^4 = 1.27): a run of ~2 minutes.

The steps the engine's recorder wrote during the live run are kept as a steps
file (`record_run`); `calibrate_under_load` fits a profile from them and runs
the simulated protocol on it, so its Ĉ is a prediction of the live one.
"""
from __future__ import annotations

import asyncio
import time

from aiohttp import web

from sim.capacity import CapacityProtocol, capacity_protocol
from sim.conditions import get_condition
from sim.profile import from_dict
from sim.scenario import get_scenario
from sim.workload import make_trace
from validate import machine, step_log
from validate.engine import free_port
from validate.loadgen import LoadGen, TracePrompts
from validate.proxy import LiveProxy

from .fit import fit_profile

SCENARIO_KEYS = ("prompt_mean", "prompt_sd", "shared_prefix", "response_median", "response_mean")
# seconds of calls past the protocol's stop: the steps of an engine at its seats (a point's overload) in
# the fit; without them the fit extrapolates to batches twice those of the run (docs/validation.md)
TAIL_S = 20.0


def live_scenario():
    """The workload of the live capacity protocol: the `scaled` scenario."""
    return get_scenario("scaled").scenario


def plan(profile_capacity: float, start_fraction: float = 0.25, stage_s: float = 20.0, factor: float = 1.5,
         threshold: float = 0.1, max_stages: int = 7, seed: int = 0, deadline_s: float = 60.0,
         via_proxy: bool = False, tail_s: float = TAIL_S) -> dict:
    """The time-scaled protocol's parameters for an engine whose profile
    predicts `profile_capacity` calls/s on the protocol's workload (`via_proxy`:
    the live calls go through the live proxy; `tail_s`: how long the calls go
    on once the protocol has stopped)."""
    if not profile_capacity > 0:
        raise ValueError(f"the profile's capacity must be positive, got {profile_capacity}")
    return {"start_rate": start_fraction * profile_capacity, "factor": factor, "stage_s": stage_s,
            "threshold": threshold, "max_stages": max_stages, "seed": seed, "deadline_s": deadline_s,
            "start_fraction": start_fraction, "via_proxy": via_proxy, "tail_s": tail_s}


def live_capacity_protocol(url: str, model: str, scenario, start_rate: float, factor: float = 1.5,
                           stage_s: float = 20.0, threshold: float = 0.1, max_stages: int = 7, seed: int = 0,
                           deadline_s: float = 60.0, progress=None, via_proxy: bool = False, tail_s: float = 0.0,
                           **_) -> dict:
    """Run the protocol against the engine at `url` serving `model`. With
    `via_proxy`, the calls go through the live proxy (`validate.proxy`,
    condition no-retry: no controls) run in this process, as a validation
    point's calls do, so the engine shares the machine with the same harness.
    Once the protocol has stopped, the trace's calls go on for `tail_s`
    (the next stage's rate, past saturation: the engine's batches fill to its
    seats, as an overloaded point's do, and its steps are recorded)."""
    proto = CapacityProtocol(start_rate, factor, stage_s, threshold, max_stages, seed, progress)
    trace = make_trace(1.0, scenario, seed, phases=proto.phases())
    url = url.rstrip("/")
    gen = LoadGen(url, model, trace.arrival, TracePrompts(trace.prompt_len, trace.shared_prefix, seed),
                  trace.max_tokens, deadline_s=deadline_s, metrics_url=url)

    async def stages(g: LoadGen) -> bool:
        for k, a, b, _r in proto.schedule():
            await asyncio.sleep(max(0.0, b - g.now()) + 0.2)      # the sample taken at b-1 has landed
            t, q = g.queue_between(a, b)
            recs = [r for r in g.records if r.sent is not None and a <= r.planned < b]
            lag = max((r.sent - r.planned for r in recs), default=0.0)
            if proto.observe(k, g.sent_between(a, b), t, q, samples=len(t), max_send_lag_s=lag):
                break
        await asyncio.sleep(tail_s)
        return True

    async def run() -> None:
        runner = None
        if via_proxy:
            runner = web.AppRunner(LiveProxy(url, get_condition("no-retry")).app(), handler_cancellation=True)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            gen.url = f"http://127.0.0.1:{port}"
        try:
            await gen.run(stage_hook=stages)
        finally:
            if runner is not None:
                await runner.cleanup()

    t0 = time.monotonic()
    asyncio.run(run())
    res = proto.result()
    res["wall_s"] = time.monotonic() - t0
    res["calls"] = gen.outcomes()
    res["protocol"]["deadline_s"] = deadline_s
    res["protocol"]["via_proxy"] = via_proxy
    res["protocol"]["tail_s"] = tail_s
    return res


def simulated_capacity_protocol(profile, scenario, start_rate: float, factor: float = 1.5, stage_s: float = 20.0,
                                threshold: float = 0.1, max_stages: int = 7, seed: int = 0, progress=None,
                                **_) -> dict:
    t0 = time.monotonic()
    res = capacity_protocol(profile, scenario, seed=seed, start_rate=start_rate, factor=factor, stage_s=stage_s,
                            threshold=threshold, max_stages=max_stages, progress=progress)
    res["wall_s"] = time.monotonic() - t0
    return res


def store(prof: dict, live: dict, simulated: dict, scenario, params: dict, engine_desc: dict) -> dict:
    """`capacity` = the live Ĉ; both runs under `capacity_protocol`."""
    prof = dict(prof)
    before = prof.get("capacity")
    prof["capacity"] = live["capacity"]
    prof["capacity_protocol"] = {
        "note": "capacity protocol, time-scaled: stages of stage_s, first at start_fraction of the profile's "
                "simulated capacity; the same trace (seed) live and on the simulator",
        "scenario": {k: getattr(scenario, k) for k in SCENARIO_KEYS},
        "params": params, "engine": engine_desc, "profile_capacity_before": before,
        "live": live, "simulated": simulated,
        "ratio_live_to_simulated": live["capacity"] / simulated["capacity"],
    }
    prof.setdefault("provenance", {})["capacity"] = ("live capacity protocol (time-scaled) against "
                                                     f"{engine_desc.get('url')}")
    return prof


def record_run(eng, scenario, params: dict, steps_path, progress=None) -> dict:
    """The live protocol on a started engine `eng`, keeping the steps its
    recorder wrote during the run in `steps_path` (source ``live run``);
    the result has `steps_file` and `steps` (0 where the engine records none)."""
    skip = len(step_log.read_raw(getattr(eng, "step_log", None)))
    eng.version()       # kept for the steps file: asked now, the engine may answer slowly once overloaded
    live = live_capacity_protocol(eng.url, eng.served_model(), scenario, progress=progress, **params)
    time.sleep(0.5)
    n = step_log.record(eng, steps_path, skip, source={"kind": "live run", "run": "capacity protocol",
                                                     "params": params, "capacity": live["capacity"]})
    live["steps_file"], live["steps"] = (str(steps_path) if n else None), n
    return live


MIN_FIT_STEPS = 200     # fewer steps than this (one stage at most) do not span the compositions a fit needs


def calibrate_under_load(eng, prof: dict, params: dict, steps_path, name: str | None = None, progress=None,
                         log=None, scenario=None) -> tuple[dict, dict, dict]:
    """Run the live protocol on `eng` under `scenario`'s workload (default
    `live_scenario()`), fit a profile from the steps it recorded, and run the
    same protocol on the simulator with that profile: (the fitted profile with
    both runs stored, the live result, the simulated one). `params` as from
    `plan`. Raises RuntimeError if no steps were recorded."""
    sc = scenario or live_scenario()
    desc = {"url": eng.url, "kind": eng.kind, "version": eng.version(), "model": eng.served_model()}
    live = record_run(eng, sc, params, steps_path, progress=progress("live") if progress else None)
    if not live["steps"]:
        raise RuntimeError("the engine recorded no steps (the step recorder runs only in engines llmsim starts)")
    if live["steps"] < MIN_FIT_STEPS:
        raise RuntimeError(f"the capacity run recorded {live['steps']} steps, fewer than the {MIN_FIT_STEPS} a fit "
                           f"needs: the engine saturated in its first stage ({params['start_rate']:.2f} calls/s), far "
                           "slower than the profile says; run it again on a quieter machine, or start from a profile "
                           "measured on this engine")
    fitted = fit_profile([steps_path], name or f"{prof.get('name', 'profile')} (fitted under load)", log=log,
                         scenario="scaled")
    sim_res = simulated_capacity_protocol(from_dict(fitted), sc, progress=progress("simulated") if progress
                                          else None, **params)
    predicted, full = fitted["capacity"], fitted["capacity_protocol"]   # the simulator's, 300 s stages
    fitted = store(fitted, live, sim_res, sc, params, desc)
    fitted["capacity"] = predicted
    fitted["capacity_protocol"]["full_stages"] = full
    fitted["provenance"]["capacity"] = ("simulator capacity protocol (scaled scenario) on this profile; "
                                        "the live run it was fitted from is under capacity_protocol.live")
    return fitted, live, sim_res


def machine_mismatch(prof: dict, gpu: bool = False) -> list[str]:
    """How this machine differs from the one a measured profile was measured
    on ([] for a profile that is not measured, or the same machine)."""
    prov = prof.get("provenance") or {}
    if prov.get("kind") != "measured":
        return []
    return machine.differences(prov.get("hardware"), machine.describe(), gpu=gpu)
