"""Which profile a validation predicts with, and the engine-speed band
(`validate.harness`, `validation.engine_speed`, `run_point`'s --retry-slow).
No engine: the live run and the capacity calibration are replaced by
stand-ins named as such."""
from __future__ import annotations

import argparse
import copy
import json
import os
import shutil

import pytest

from llmsim import validate_cmds as VC
from llmsim.cli import main
from sim.profile import from_dict, load_profile
from sim.scenario import get_scenario
from validate import engine as E, harness as H, machine, validation as V


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(E, "STATE_DIR", tmp_path / "state")
    return tmp_path / "state"


# ------------------------------------------------------------ speed band
@pytest.mark.parametrize("k, ok, words", [(1.0, True, None), (0.9, True, None), (1.1, True, None),
                                           (1.3, False, "1.30x slower"), (0.8, False, "1.25x faster")])
def test_engine_speed_band(k, ok, words):
    sp = V.engine_speed({"ratio": k})
    assert sp["k"] == k and sp["tests_model"] is ok and sp["band"] == [0.9, 1.1]
    if ok:
        assert sp["says"] is None
    else:
        assert words in sp["says"] and "does not test the model" in sp["says"]
    assert V.engine_speed(None) is None


def test_a_point_whose_engine_server_fell_silent_does_not_test_the_model():
    """Its server answered no /metrics scrape for longer than SILENT_SERVER_S:
    starved, it passed its calls' requests and aborts on late."""
    quiet = V.engine_speed({"ratio": 1.02}, silence_s=V.SILENT_SERVER_S + 15.0)
    assert quiet["k"] == 1.02 and not quiet["tests_model"] and "answered no /metrics scrape for 25 s" in quiet["says"]
    assert V.engine_speed({"ratio": 1.02}, silence_s=1.1)["tests_model"]
    assert V.engine_speed({"ratio": 1.3}, silence_s=1.1)["says"].startswith("the engine ran 1.30x slower")
    rec = {"step_time_vs_profile": {"ratio": 1.0}, "extra": {"metrics_silence_s": 25.0}}
    assert not V.live_speed(rec)["tests_model"]
    assert "its server silent, not a test of the model" in V.speed_note({"live": rec})
    assert V.live_speed({"step_time_vs_profile": {"ratio": 1.0}})["tests_model"]      # a record from before


def test_the_samplers_silence_is_its_longest_stretch_without_an_answer():
    from validate.live_log import Sample, Sampler
    s = Sampler([], None, lambda: 0.0)
    s.samples = [Sample(t, 0.0, 0.0, 0, {}) for t in (0.0, 1.0, 2.0, 9.5, 10.5)]
    assert s.silence_s(11.0) == pytest.approx(7.5)
    assert s.silence_s(30.0) == pytest.approx(19.5)     # none since the last
    s.samples = []
    assert s.silence_s(4.0) == pytest.approx(4.0)


def _record(recovered: bool, pulse: float, hold: float, k: float | None) -> dict:
    return {"recovered": recovered,
            "cohorts": {"pulse": {"offered": 100, "delivered": pulse}, "hold": {"offered": 100, "delivered": hold}},
            "step_time_vs_profile": None if k is None else {"ratio": k}}


def _run(ks: list[float | None], retry_slow: int, scaled=lambda k: _record(True, 91.0, 84.0, None),
         live_recovered: bool = True) -> tuple[dict, list]:
    """run_point with a stand-in live run whose engine ran at k = ks[i] on
    its i-th run; `scaled(k)`: the stand-in prediction at k (at 1: the point's own)."""
    runs = []

    def live():
        rec = _record(live_recovered, 90.0, 80.0, ks[len(runs)])
        runs.append(rec)
        return rec, {"version": "test", "model": "m"}
    doc = {"engine": {}, "points": []}
    ran = V.run_point(doc, {"condition": "no-control"}, "no-control", "1/1", lambda: scaled(1.0),
                      "a stand-in engine", live, scaled, None, log=lambda m: None, retry_slow=retry_slow)
    assert ran
    return doc["points"][0], runs


def test_a_point_in_the_band_runs_once_and_keeps_its_k():
    p, runs = _run([1.04, 1.0], retry_slow=2)
    assert len(runs) == 1 and "slow_runs" not in p
    assert p["engine_speed"]["k"] == 1.04 and p["engine_speed"]["tests_model"]
    assert p["agreement"]["all"] and "sim_step_adjusted" in p


def test_a_slow_point_is_run_again_up_to_retry_slow_times_and_the_slow_runs_are_kept():
    p, runs = _run([1.3, 1.25, 1.02], retry_slow=2)
    assert len(runs) == 3 and [r["k"] for r in p["slow_runs"]] == [1.3, 1.25]
    assert p["live"] is runs[-1] and p["engine_speed"]["tests_model"]
    p, runs = _run([1.3, 1.25, 1.02], retry_slow=1)
    assert len(runs) == 2 and p["engine_speed"]["k"] == 1.25 and not p["engine_speed"]["tests_model"]
    assert "not a test of the model" in V.speed_note(p)
    p, runs = _run([1.3], retry_slow=0)
    assert len(runs) == 1 and not p["engine_speed"]["tests_model"] and "slow_runs" not in p


def test_a_point_without_recorded_steps_has_no_speed_and_is_not_rerun():
    p, runs = _run([None, None], retry_slow=3)
    assert len(runs) == 1 and p["engine_speed"] is None
    assert "band_speeds" not in p and p["agreement"]["recovery_tests_model"]


def _recovers_below(edge: float):
    """A stand-in prediction that recovers while its steps take under `edge` x the profile's."""
    return lambda k: _record(k < edge, 91.0, 84.0, None) | {"recovery_time_s": 150.0 if k < edge else None}


def test_a_point_whose_prediction_flips_inside_the_band_does_not_test_recovery(capsys):
    """Recovering at k 0.9 and not at 1.1, the model leaves the point's
    recovery to a speed the band cannot tell apart: a live miss at k 1.02
    is marked, not counted as a disagreement; delivery is still compared."""
    p, _ = _run([1.02], retry_slow=0, scaled=_recovers_below(1.05), live_recovered=False)
    e = p["band_speeds"]
    assert e["k"] == pytest.approx([0.9, 0.95, 1.0, 1.05, 1.1]) and e["flips"]
    assert e["recovered"] == [True, True, True, False, False]
    assert e["recovery_time_s"] == [150.0] * 3 + [None] * 2 and "inside the speed band" in e["says"]
    assert e["hold_delivered_pct"] == [84.0] * 5 and e["pulse_delivered_pct"] == [91.0] * 5
    ag = p["agreement"]
    assert not ag["recovered"] and not ag["recovery_tests_model"] and ag["pulse"] and ag["hold"]
    assert p["engine_speed"]["tests_model"]               # the engine's speed itself was in the band
    assert VC._verdicts([p], lambda q: q["condition"], None) == 0
    out = capsys.readouterr().out
    assert ("no-control: RECOVERY NOT A TEST OF THE MODEL: the prediction recovers at k 0.90, 0.95, 1.00 and "
            "does not at 1.05, 1.10") in out
    assert "recovered DIFFERS" in out and "k 1.02" in out


def test_a_prediction_that_recovers_inside_the_band_but_not_at_its_edges_does_not_test_recovery():
    """Recovery is not monotone in k near its edge: a verdict that changes
    only between the band's edges is caught too."""
    p, _ = _run([1.0], retry_slow=0, scaled=lambda k: _record(0.97 < k < 1.03, 91.0, 84.0, None))
    assert p["band_speeds"]["recovered"] == [False, False, True, False, False] and p["band_speeds"]["flips"]
    assert not p["agreement"]["recovery_tests_model"]


def test_a_prediction_that_holds_across_the_band_tests_recovery(capsys):
    for edge in (0.5, 2.0):                       # never recovers / always recovers inside the band
        p, _ = _run([1.02], retry_slow=0, scaled=_recovers_below(edge), live_recovered=edge < 1.0)   # differs
        assert not p["band_speeds"]["flips"] and p["band_speeds"]["says"] is None
        assert p["agreement"]["recovery_tests_model"] and not p["agreement"]["recovered"]
    VC._verdicts([p], lambda q: q["condition"], None)
    out = capsys.readouterr().out
    assert "no-control: recovered DIFFERS" in out and "NOT A TEST" not in out


def test_the_band_speeds_are_taken_about_the_speed_a_point_was_predicted_for():
    """A point predicted for a probed k0 of 1.2 is predicted across 1.08-1.32."""
    asked = []

    def scaled(k):
        asked.append(k)
        return _record(True, 91.0, 84.0, None)
    rec = _record(True, 90.0, 80.0, 1.02) | {"speed_probe": {"k": 1.2, "applied_k": 1.2}}
    doc = {"engine": {}, "points": []}
    V.run_point(doc, {"condition": "cancel"}, "cancel", "1/1", lambda: _record(True, 92.0, 85.0, None), "a stand-in",
                lambda: (rec, {"version": "t", "model": "m"}), scaled, None, log=lambda m: None)
    assert doc["points"][0]["band_speeds"]["k"] == pytest.approx([1.08, 1.14, 1.2, 1.26, 1.32])
    assert pytest.approx(1.08) in asked and pytest.approx(1.32) in asked
    assert asked.count(pytest.approx(1.2)) == 1       # the prediction at k0 itself, made once and reused
    assert pytest.approx(1.2 * 1.02) in asked         # and sim x k, at the speed the steps ran


# ------------------------------------------------------- which profile
def _args(mode: str = "auto", **kw) -> argparse.Namespace:
    return argparse.Namespace(calibrate_from=mode, no_recalibrate=False, json=None, **kw)


@pytest.fixture
def calibrations(monkeypatch):
    """`_calibrate_first` replaced by a stand-in that fits nothing: the
    profile comes back marked as measured under the harness here."""
    calls = []

    def fake(spec, prof, vs, json_path, diffs, layout):
        calls.append((spec.cpus, layout))
        raw = copy.deepcopy(prof.raw)
        raw["name"] = f"{prof.name} (fitted under load here)"
        raw["calibration"] = {"from": "capacity", "layout": layout}
        raw["provenance"]["measured_under"] = H.measured_under(layout, spec.kind, 123)
        return from_dict(raw, "fitted"), raw["calibration"]
    monkeypatch.setattr(VC, "_calibrate_first", fake)
    monkeypatch.setattr(VC, "recalibrate_needed", lambda *a: [])
    return calls


def test_auto_fits_a_quiet_profile_under_the_harness_once_and_reuses_it(state_dir, calibrations, capsys):
    prof, vs = load_profile("vllm-cpu-tiny"), get_scenario("cpu-tiny")
    spec = V.EngineSpec("cpu")
    p, cal = VC._predicting_profile(_args(), spec, prof, vs, "cpu", "shared")
    assert calibrations == [(None, "shared")] and cal["from"] == "capacity"
    assert "not under this validation's harness" in capsys.readouterr().err
    assert H.cache_path(prof.raw, "shared").exists()
    # the next validation of the same profile on this machine and layout reuses it
    p2, cal2 = VC._predicting_profile(_args(), spec, prof, vs, "cpu", "shared")
    assert len(calibrations) == 1 and p2.name == p.name and cal2 == cal
    assert "fitted under the validation harness here before" in capsys.readouterr().err
    assert "measured under the validation harness (shared layout, 123 steps)" in H.how_measured(p2.raw)
    # another layout is another engine; --calibrate-from capacity fits again
    VC._predicting_profile(_args(), spec, prof, vs, "cpu", "split")
    VC._predicting_profile(_args("capacity"), spec, prof, vs, "cpu", "shared")
    assert [c[1] for c in calibrations] == ["shared", "split", "shared"]
    # a profile that was itself measured under the harness here is used as it is
    p3, cal3 = VC._predicting_profile(_args(), spec, p2, vs, "cpu", "shared")
    assert p3 is p2 and cal3 is None and len(calibrations) == 3


def test_a_profile_of_another_machine_is_fitted_here_once_and_the_fit_reused(state_dir, calibrations, monkeypatch,
                                                                             capsys):
    """The embedded profile, measured on another CPU: `auto` fits it under
    the harness here the first time, and a later validation reuses that fit."""
    monkeypatch.setattr(VC, "recalibrate_needed", lambda *a: ["CPU 'Intel', here 'AMD'"])
    prof, vs = load_profile("vllm-cpu-tiny"), get_scenario("cpu-tiny")
    p, _ = VC._predicting_profile(_args(), V.EngineSpec("cpu"), prof, vs, "cpu", "apart")
    assert len(calibrations) == 1 and "was measured on another machine" in capsys.readouterr().err
    p2, _ = VC._predicting_profile(_args(), V.EngineSpec("cpu"), prof, vs, "cpu", "apart")
    assert len(calibrations) == 1 and p2.name == p.name
    assert "fitted under the validation harness here before" in capsys.readouterr().err
    VC._predicting_profile(_args("capacity"), V.EngineSpec("cpu"), prof, vs, "cpu", "apart")
    assert len(calibrations) == 2                 # --calibrate-from capacity fits it anew


def test_profile_mode_gpu_and_url_engines_predict_with_the_profile_as_given(state_dir, calibrations):
    prof, vs = load_profile("vllm-cpu-tiny"), get_scenario("cpu-tiny")
    for mode, kind in (("profile", "cpu"), ("auto", "gpu"), ("auto", "url"), ("profile", "url")):
        p, cal = VC._predicting_profile(_args(mode), V.EngineSpec(kind), prof, vs, kind, "shared")
        assert p is prof and cal is None, (mode, kind)
    assert calibrations == []
    with pytest.raises(VC.args.UsageError, match="engine given by URL has none"):
        VC._predicting_profile(_args("capacity"), V.EngineSpec("url"), prof, vs, "url", "shared")


def test_a_cached_profile_of_another_machine_is_not_reused(state_dir, calibrations, monkeypatch):
    prof, vs = load_profile("vllm-cpu-tiny"), get_scenario("cpu-tiny")
    VC._predicting_profile(_args(), V.EngineSpec("cpu"), prof, vs, "cpu", "shared")
    path = H.cache_path(prof.raw, "shared")
    doc = json.loads(path.read_text())
    doc["provenance"]["measured_under"]["hardware"]["processor"] = "another CPU"
    path.write_text(json.dumps(doc))
    assert H.cached(prof.raw, "shared") is None
    path.write_text("{not json")
    assert H.cached(prof.raw, "shared") is None


def test_layouts_pin_the_engine_and_the_harness_apart():
    cores = machine.cores()
    assert H.layout_cpus("shared") == (None, None)
    eng, harness = H.layout_cpus("split")
    if len(cores) >= 2:
        assert eng == cores[:1] and harness == cores[1:]
    else:
        assert (eng, harness) == (None, None)
    assert H.layout_cpus(H.FLEET_LAYOUT) == (cores[:1], None)
    # apart: the forward passes alone on the first core, the rest of the engine with the harness
    eng, harness = H.layout_cpus("apart")
    compute = H.layout_compute_cpus("apart")
    if len(cores) >= 2:
        assert compute == cores[:1] and eng == harness == cores[1:]
    else:
        assert (eng, harness, compute) == (None, None, None)
    assert H.layout_compute_cpus("split") is None and H.layout_compute_cpus("shared") is None
    with pytest.raises(ValueError, match="unknown layout 'nope'"):
        H.layout_cpus("nope")


def test_harness_on_pins_every_thread_and_gives_the_cores_back():
    before = os.sched_getaffinity(0)
    one = [machine.cores()[-1]]
    with H.harness_on(one):
        assert os.sched_getaffinity(0) == set(one)
        assert machine.cpus() == len(machine.cores())        # the machine is described as it was given
    assert os.sched_getaffinity(0) == before
    with H.harness_on(None):
        assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("args, words", [
    (["--layout", "halves"], ["invalid choice: 'halves'"]),
    (["--retry-slow", "-1"], ["--retry-slow"]),
    (["--calibrate-from", "log"], ["invalid choice: 'log'"]),
])
def test_bad_flags_exit_2_with_one_line(args, words, capsys):
    assert main(["validate", "--engine", "cpu", "--points", "no-control", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any(all(w in line for w in words) for line in err)


def test_a_capacity_run_with_too_few_steps_is_not_fitted(monkeypatch, tmp_path):
    """An engine that saturated in the first stage leaves a handful of steps;
    a profile fitted to them would describe nothing (the run is a stand-in)."""
    from calibrate import live_capacity as L

    class StandInEngine:
        url, kind = "http://127.0.0.1:9", "cpu"

        def version(self):
            return "stand-in"

        def served_model(self):
            return "m"
    monkeypatch.setattr(L, "record_run", lambda *a, **k: {"steps": 15, "capacity": 0.5})
    monkeypatch.setattr(L, "fit_profile", lambda *a, **k: pytest.fail("fitted a profile to 15 steps"))
    params = L.plan(4.0, via_proxy=True)
    with pytest.raises(RuntimeError, match="recorded 15 steps, fewer than the 200"):
        L.calibrate_under_load(StandInEngine(), load_profile("vllm-cpu-tiny").raw, params, tmp_path / "s.jsonl")


def test_apart_binds_the_forward_passes_apart_from_the_engine_process_group(monkeypatch, tmp_path):
    """start_cpu's command and environment for a layout, the server start
    replaced by a stand-in that records them (no engine is started)."""
    seen = {}

    def stand_in_start_server(args, url, log_path, env, run_dir, timeout, **kw):
        seen.update(args=args, env=env)
        return None

    monkeypatch.setattr(E, "start_server", stand_in_start_server)
    monkeypatch.setattr(E, "cpu_installed", lambda venv: "0.0")
    monkeypatch.setattr(E, "_run_dir", lambda port: tmp_path)
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/" + name)
    V.EngineSpec("cpu", cpus=[1], compute_cpus=[0]).start([])
    assert seen["args"][:3] == ["/usr/bin/taskset", "-c", "1"]
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    V.EngineSpec("cpu", cpus=[0]).start([])
    assert seen["args"][:3] == ["/usr/bin/taskset", "-c", "0"]
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
