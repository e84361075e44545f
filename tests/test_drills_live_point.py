"""Drills: a live point survives the engine. `validate.validation.validate`
runs three points on engines llmsim starts (tests/fake_vllm.py, a stand-in
speaking vLLM's HTTP, started by validate.engine.start_server like vLLM); the
second engine is SIGKILLed mid-point. That point is recorded as failed with
the reason and the engine's last log lines, the first is kept, the third runs
on a fresh engine; a rerun retries only the failed point. A stream that hangs
(mock server) still ends every attempt at its deadline."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from sim.conditions import get_condition
from sim.profile import load_profile
from sim.scenario import NamedScenario, _scaled
from sim.workload import make_trace
from validate import engine as E, fleet as F, step_log, validation as V
from validate.live_run import LiveRun

FAKE = Path(__file__).resolve().parent / "fake_vllm.py"
DRILL = NamedScenario("drill", _scaled(200.0), time_scale=200.0,
                      about="the reference scenario's times / 200, for drills")
CAPACITY = 4.0


class FakeSpec(V.EngineSpec):
    def __init__(self, tmp_path, modes):
        super().__init__("cpu")
        self.tmp, self.modes, self.started = tmp_path, list(modes), []

    def start(self, extra_args):
        port = E.free_port()
        d = self.tmp / f"engine{len(self.started)}"
        d.mkdir()
        steps = d / "steps.jsonl"
        eng = E.start_server([sys.executable, str(FAKE), str(port), self.modes.pop(0), str(steps)],
                             f"http://127.0.0.1:{port}", d / "server.log", dict(os.environ), d, 60, kind="cpu",
                             step_log=steps)
        self.started.append(eng)
        return eng, True


def test_an_engine_killed_mid_point_fails_that_point_only_and_the_next_runs_on_a_fresh_engine(tmp_path):
    prof = load_profile("vllm-cpu-tiny")
    out = tmp_path / "v.json"
    spec = FakeSpec(tmp_path, ["serve", "die-after:3", "serve"])
    points = ["no-retry", "no-control", "no-retry+cancel"]
    doc = V.validate(spec, prof, DRILL, points, str(out), capacity=CAPACITY, log=lambda m: None)
    ok1, bad, ok3 = doc["points"]
    assert [p["condition"] for p in doc["points"]] == points
    assert "live" in ok1 and "live" in ok3 and "failed" not in ok1 and "failed" not in ok3
    assert bad["failed"]["reason"].startswith("the engine process was killed by signal 9 at t=")
    assert any("EngineCore encountered a fatal error" in line for line in bad["failed"]["engine_log"])
    assert bad["failed"]["engine_errors"] == ["EngineDeadError: EngineCore encountered a fatal error (fake)"]
    assert bad["failed"]["reason"].endswith("(EngineDeadError: EngineCore encountered a fatal error (fake))")
    assert "live" not in bad and bad["sim"]["cohorts"]["hold"]["offered"] > 0
    assert len({e.pid for e in spec.started}) == 3 and not any(e.alive() for e in spec.started)
    assert ok3["live"]["cohorts"]["hold"]["delivered"] > 0
    assert json.loads(out.read_text())["points"][1]["failed"] == bad["failed"]
    assert "FAILED: the engine process was killed" in V.table(doc["points"])
    # a rerun keeps the points done and retries the failed one only
    again = FakeSpec(tmp_path / "again", ["serve"])
    (tmp_path / "again").mkdir()
    doc2 = V.validate(again, prof, DRILL, points, str(out), capacity=CAPACITY, log=lambda m: None)
    assert len(again.started) == 1 and all("live" in p for p in doc2["points"])
    assert doc2["points"][0]["live"] == ok1["live"]


def test_an_engine_slow_to_answer_after_its_run_still_gives_the_point_and_its_steps(tmp_path):
    """Once the run ends an overloaded engine is still draining and answers
    slowly; what the record needs from it was asked before the run."""
    out = tmp_path / "v.json"
    spec = FakeSpec(tmp_path, ["slow-after:3"])
    doc = V.validate(spec, load_profile("vllm-cpu-tiny"), DRILL, ["no-retry"], str(out), capacity=CAPACITY,
                     log=lambda m: None)
    (p,) = doc["points"]
    assert "failed" not in p, p.get("failed")
    assert p["live"]["cohorts"]["hold"]["delivered"] > 0
    meta, rows = step_log.read_steps(p["live"]["steps_file"])
    assert meta["engine"]["version"] == "fake" and rows


def test_the_errors_of_an_engine_log_are_its_exceptions_not_warnings_that_quote_one(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(
        "(APIServer pid=17458) WARNING 12-01 10:29:50 [system_utils.py:255] Found ulimit of 20000 and failed to "
        "automatically increase. This can cause fd limit errors like `OSError: [Errno 24] Too many open files`.\n"
        "(EngineCore_DP0 pid=17600) ERROR 12-01 10:31:02 [core.py:710] ValueError: bad shape\n"
        "Traceback (most recent call last):\n"
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    eng = E.Engine(url="http://127.0.0.1:9", log_path=log)
    assert eng.log_errors() == ["ValueError: bad shape",
                                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue."]


def test_an_engine_whose_core_died_is_gone_while_its_server_still_runs(tmp_path):
    """vLLM's API server can outlive its core by many seconds (waiting for its
    connections to close, /metrics unanswered): the log's EngineDeadError
    says the engine is gone, found across the reads of a growing log."""
    log = tmp_path / "server.log"
    log.write_text("(APIServer pid=1) INFO 12-01 10:29:50 [api_server.py:1] Started server process\n")
    eng = E.Engine(url="http://127.0.0.1:9", log_path=log)
    eng.proc = type("Running", (), {"poll": lambda self: None})()      # a server process that has not exited
    assert V.engine_gone(eng) is None
    with open(log, "a") as f:
        f.write('INFO:     127.0.0.1:41170 - "POST /v1/completions HTTP/1.1" 500 Internal Server Error\n'
                "vllm.v1.engine.exceptions.EngineDe")                   # the mark split across two reads
    assert V.engine_gone(eng) is None
    with open(log, "a") as f:
        f.write("adError: EngineCore encountered an issue.\nINFO:     Waiting for connections to close.\n")
    why = V.engine_gone(eng)
    assert why is not None and why.startswith("the engine process") and "EngineDeadError" in why
    assert V.engine_gone(eng) == why                                     # and it stays gone


def test_an_earlier_engines_death_in_the_same_log_is_not_this_engines(tmp_path):
    """A log appended to by an engine before: its EngineDeadError is not the
    new engine's, which is read from where its own lines begin."""
    log = tmp_path / "server.log"
    log.write_text("vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    port = E.free_port()
    eng = E.start_server([sys.executable, str(FAKE), str(port), "serve"], f"http://127.0.0.1:{port}", log,
                         dict(os.environ), tmp_path, 60, kind="cpu")
    try:
        assert V.engine_gone(eng) is None and eng.healthy()
    finally:
        eng.stop()
    assert V.engine_gone(eng).startswith("the engine process")     # stopped: its process exited


def test_an_engine_that_never_becomes_ready_fails_its_point_with_a_clear_error(tmp_path, monkeypatch):
    spec = FakeSpec(tmp_path, [])

    def never(extra_args):
        raise E.EngineError("engine not ready after 300 s (log server.log): nothing")
    monkeypatch.setattr(spec, "start", never)
    doc = V.validate(spec, load_profile("vllm-cpu-tiny"), DRILL, ["no-retry"], None, capacity=CAPACITY,
                     log=lambda m: None)
    assert doc["points"][0]["failed"]["reason"].startswith("engine not ready after 300 s")


def test_a_hanging_stream_still_ends_each_attempt_at_its_deadline_mock_server(tmp_path):
    """The mock server sends each completion's first chunk and then hangs."""
    eng = FakeSpec(tmp_path, ["hang"]).start([])[0]
    try:
        sc = DRILL.scenario
        trace = make_trace(CAPACITY, sc, 0)
        run = LiveRun(eng.url, "fake", trace, get_condition("no-retry"), sc, 0, prompt_throughput=1000.0)
        until = float(trace.arrival[-1]) + sc.delivery_horizon_s
        log = run.run(until)
    finally:
        eng.stop()
    assert log.attempts and all(a.outcome == "timeout" for a in log.attempts)
    for a in log.attempts:
        assert a.ended_at - a.sent_at <= sc.deadline_s + 2.0        # the deadline, with slack for a loaded machine
    assert all(c.outcome.startswith("failed") for c in log.calls)


def test_a_fleet_point_gives_the_prediction_with_the_engines_own_step_times_too(tmp_path, monkeypatch):
    """Two stand-in engines llmsim starts (their step rows recorded): the
    fleet's point carries the steps' ratio to the profile, per replica and
    summed, and the prediction with the profile stretched by it (sim x k)."""
    spec = FakeSpec(tmp_path, ["serve", "serve"])
    monkeypatch.setattr(F, "start_cpu_fleet", lambda n, args: [spec.start(args)[0] for _ in range(n)])
    prof = load_profile("vllm-cpu-tiny")
    doc = F.validate_fleet(V.EngineSpec("cpu"), prof, DRILL, 2, ["round-robin"], ["no-retry"], str(tmp_path / "f.json"),
                           capacity=CAPACITY, log=lambda m: None)
    (p,) = doc["points"]
    assert "failed" not in p, p.get("failed")
    st = p["live"]["step_time_vs_profile"]
    reps = st["replicas"]
    assert len(reps) == 2 and all(r is not None and r["steps"] > 0 for r in reps)
    assert st["steps"] == sum(r["steps"] for r in reps)
    assert abs(st["ratio"] - sum(r["actual_s"] for r in reps) / sum(r["predicted_s"] for r in reps)) < 1e-12
    adj = p["sim_step_adjusted"]
    assert adj["fleet"]["replicas"] == 2 and adj["model"].endswith(f"x{st['ratio']:.3f}")
    assert set(p["agreement_step_adjusted"]) == set(p["agreement"])
    assert "sim x k" in F.fleet_table(doc["points"])
    for r, rep in enumerate(p["live"]["replicas"]):      # each replica's steps kept, as calibration data
        assert rep["steps_file"] == str(tmp_path / f"f.round-robin.no-retry.r{r}.steps.jsonl")
        meta, rows = step_log.read_steps(rep["steps_file"])
        assert meta["source"]["replica"] == r and len(rows) == reps[r]["steps"]
    assert not any(e.alive() for e in spec.started)


def test_a_point_is_predicted_for_its_engine_as_probed_just_before_it(tmp_path):
    """Before the point a few calls measure the fresh engine's speed against
    the profile; the point is predicted with the profile's steps scaled by
    it (the profile's own prediction kept), its k is against that, and the
    probe's calls are not in the point's engine counters."""
    prof = load_profile("vllm-cpu-tiny")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    doc = V.validate(FakeSpec(tmp_path / "a", ["serve"]), prof, DRILL, ["no-retry"], None, capacity=CAPACITY,
                     log=lambda m: None)
    p = doc["points"][0]
    probe = p["live"]["speed_probe"]
    assert probe["calls"] == V.PROBE_CALLS and probe["steps"] >= V.PROBE_CALLS and probe["k"] > 0
    assert probe["applied_k"] == V.applied_k(probe["k"]) and probe["expected"] == 1.0     # the first point
    if probe["applied_k"] != 1.0:           # the drill's engine strayed beyond the probe's noise
        assert p["sim"]["model"] == f"{prof.name} x{probe['applied_k']:.3f}"
        assert p["sim_profile"]["model"] == prof.name
    else:
        assert p["sim"]["model"] == prof.name and "sim_profile" not in p
    assert p["engine_speed"]["k"] > 0 and "probed before the point" in V.table(doc["points"])
    plain = V.validate(FakeSpec(tmp_path / "b", ["serve"]), prof, DRILL, ["no-retry"], None, capacity=CAPACITY,
                       log=lambda m: None, probe=False)["points"][0]
    assert plain["live"]["speed_probe"] is None and "sim_profile" not in plain
    assert p["live"]["counters"]["prompt_tokens_total"] == plain["live"]["counters"]["prompt_tokens_total"] > 0


def test_each_point_expects_its_engine_at_the_speed_the_last_one_ran_where_it_left_the_band(tmp_path):
    prof = load_profile("vllm-cpu-tiny")
    doc = V.validate(FakeSpec(tmp_path, ["serve", "serve"]), prof, DRILL, ["no-retry", "no-control"], None,
                     capacity=CAPACITY, log=lambda m: None)
    first, second = doc["points"]
    assert first["live"]["speed_probe"]["expected"] == 1.0
    expected = V.expected_speed([first])
    assert second["live"]["speed_probe"]["expected"] == expected
    assert second["live"]["speed_probe"]["applied_k"] == V.applied_k(second["live"]["speed_probe"]["k"], expected)


@pytest.mark.parametrize("ran, expected", [(1.5, 1.5), (0.7, 0.7), (1.06, 1.0), (0.93, 1.0), (None, 2.0)])
def test_the_speed_expected_follows_the_last_point_only_where_it_ran_outside_the_band(ran, expected):
    """Inside the band a point's speed says as much about how the profile
    fits its batches as about the machine: the profile's own is expected
    (a point without recorded steps is passed over)."""
    last = {"live": {"step_time_vs_profile": None if ran is None else {"ratio": ran}}}
    assert V.expected_speed([{"live": {"step_time_vs_profile": {"ratio": 2.0}}}, last]) == expected
    assert V.expected_speed([]) == 1.0


def test_a_probe_within_its_noise_leaves_the_profile_as_it_is():
    n = V.PROBE_NOISE
    assert [V.applied_k(k) for k in (1.0, 0.8, 1.3, 1 / n, n)] == [1.0] * 5
    assert V.applied_k(2.0) == 2.0 and V.applied_k(0.7) == 0.7
    assert V.probe_k(None) is None and V.probe_k({"k": 1.2}) == 1.2      # a record from before applied_k
    assert V.probe_k({"k": 1.2, "applied_k": 1.0}) == 1.0
    # against the speed the last point's engine ran at: the probe only where it strays beyond its noise of it
    assert V.applied_k(0.785, expected=0.74) == 0.74 and V.applied_k(0.639, expected=0.727) == 0.727
    assert V.applied_k(1.6, expected=0.74) == 1.6
    assert V.realized_speed({"live": {"step_time_vs_profile": {"ratio": 1.1},
                                      "speed_probe": {"k": 0.8, "applied_k": 0.7}}}) == 1.1 * 0.7
    assert V.realized_speed({"live": {"step_time_vs_profile": None}}) is None


def test_the_speed_probe_is_read_against_the_same_probe_when_the_profile_was_fitted(tmp_path):
    """A profile fitted under the harness keeps the probe's ratio on the
    engine it was fitted on; a point's probe is divided by it (what the
    profile's shape makes of the probe's batches cancels), and only where
    the probe's lengths are the same."""
    import dataclasses
    prof = load_profile("vllm-cpu-tiny")
    spec = FakeSpec(tmp_path, ["serve"])
    eng, _ = spec.start([])
    try:
        plain = V.speed_probe(eng, prof, DRILL, log=lambda m: None)
        assert plain["reference"] is None and plain["k"] == plain["ratio"] > 0
        ref = {"ratio": 2.0, "lengths": V.probe_lengths(DRILL)}
        fitted = dataclasses.replace(prof, raw=dict(prof.raw, speed_probe=ref))
        probed = V.speed_probe(eng, fitted, DRILL, log=lambda m: None)
        assert probed["reference"] == 2.0 and abs(probed["k"] - probed["ratio"] / 2.0) < 1e-12
        other = dataclasses.replace(prof, raw=dict(prof.raw, speed_probe=dict(ref, lengths=[1, 1])))
        assert V.speed_probe(eng, other, DRILL, log=lambda m: None)["reference"] is None
    finally:
        eng.stop()
