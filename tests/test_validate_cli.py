"""`llmsim validate` input checks and the validation scenarios (no engine)."""
import dataclasses
import json
from pathlib import Path

import pytest

from llmsim.cli import main
from sim.conditions import get_condition
from sim.profile import load_profile
from sim.scenario import PAPER, SCENARIOS, get_scenario
from validate.validation import (
    EngineSpec,
    ValidationError,
    band_speeds,
    capacity_for,
    predict,
    scaled_profile,
    validate,
)


@pytest.mark.parametrize("args, words", [
    (["--engine", "tpu", "--points", "no-control"], ["--engine must be cpu, gpu or an engine URL"]),
    (["--engine", "cpu", "--points", "no-control,nope"], ["unknown condition 'nope'", "no-retry"]),
    (["--engine", "cpu", "--points", "no-control", "--scenario", "huge"], ["unknown scenario 'huge'", "cpu-small"]),
    (["--engine", "http://127.0.0.1:9", "--points", "no-control"], ["needs --profile"]),
    (["--engine", "http://127.0.0.1:9", "--points", "no-control", "--profile", "qwen2.5-7b"],
     ["cannot reach the engine at http://127.0.0.1:9"]),
    (["--engine", "gpu", "--model", "some/model", "--points", "no-control"], ["no embedded profile", "--profile"]),
    (["--engine", "cpu", "--points", "no-control", "--capacity", "-1"], ["must be positive"]),
    # fleets (--replicas)
    (["--engine", "cpu", "--replicas", "0"], ["--replicas must be at least 1"]),
    (["--engine", "cpu", "--replicas", "100000"], ["--replicas 100000", "core of its own"]),
    (["--engine", "cpu", "--replicas", "2", "--routers", "round-robin,fastest"], ["unknown router 'fastest'",
                                                                                  "call-affinity"]),
    (["--engine", "cpu", "--replicas", "2", "--points", "nope"], ["unknown condition 'nope'"]),
    (["--engine", "http://127.0.0.1:9", "--replicas", "2", "--profile", "vllm-cpu-tiny"],
     ["give 2 comma-separated URLs (got 1)"]),
    (["--engine", "http://127.0.0.1:9,http://127.0.0.1:10", "--points", "coalesce"], ["give --replicas N"]),
    (["--engine", "gpu", "--replicas", "2"], ["a fleet runs on the CPU engine"]),
    (["--engine", "cpu"], ["give --points"]),
    (["--engine", "cpu", "--points", "coalesce", "--fleet-proxy", "replica"], ["are for a fleet", "--replicas N"]),
    (["--engine", "cpu", "--scenario", "examples/fleet.toml"], ["[fleet] gives the replicas different profiles",
                                                               "N identical engines"]),
])
def test_bad_input_exits_2_with_one_line_reason(args, words, capsys):
    assert main(["validate", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("llmsim")
    for w in words:
        assert w in err


def test_scaled_scenarios_scale_every_time_and_keep_the_ratios():
    small = get_scenario("cpu-small")
    k = small.time_scale
    sc = small.scenario
    assert k == 4.0
    for f in ("base_s", "pulse_s", "deadline_s", "window_s", "delivery_horizon_s", "primary_skip_s",
              "max_retry_after_s"):
        assert getattr(sc, f) == pytest.approx(getattr(PAPER, f) / k), f
    # but for the hold: ten deadlines (the reference design's six would end with the drain at the hold's edge)
    assert sc.hold_s == pytest.approx(10 * sc.deadline_s) and sc.hold_s > PAPER.hold_s / k
    assert get_scenario("cpu-tiny").scenario.hold_s == pytest.approx(PAPER.hold_s / 16)
    assert sc.recovery_queue_growth == pytest.approx(PAPER.recovery_queue_growth * k)
    assert sc.pulse == PAPER.pulse and sc.base_load == PAPER.base_load and sc.max_retries == PAPER.max_retries
    # the pulse's backlog, in seconds of work at capacity, exceeds one deadline
    assert (sc.pulse - 1.0) * sc.pulse_s > sc.deadline_s
    # the proxy's own times scale with the workload's
    b = small.condition(get_condition("budget")).proxy
    d = small.condition(get_condition("deferred")).proxy
    assert b.budget_window_s == pytest.approx(60.0 / k) and d.defer_s == pytest.approx(10.0 / k)
    assert SCENARIOS["paper"].condition(get_condition("deferred")) == get_condition("deferred")
    json.dumps(small.to_dict())


@pytest.mark.parametrize("name", ["no-retry", "coalesce"])
def test_cpu_smalls_drains_end_inside_its_hold_at_every_speed_of_the_band(name):
    """cpu-small's hold is long enough that no-retry's and coalesce's recovery
    is the same at every engine speed validate's band allows, so a live point
    of them tests the model (with the reference design's six deadlines of
    hold, the embedded profile's no-retry on seed 1 does not recover at 1.1x)."""
    prof = load_profile("vllm-cpu-tiny")
    small = get_scenario("cpu-small")
    cap = capacity_for(prof, small, log=lambda *a: None)
    for seed in (0, 1):
        vs = dataclasses.replace(small, seed=seed)
        band = band_speeds(lambda k: predict(scaled_profile(prof, k), name, vs, cap), 1.0)
        assert all(band["recovered"]), (seed, band["recovery_time_s"])
        # and with a margin: the slowest engine's recovery comes at least two windows before the hold's end
        assert max(band["recovery_time_s"]) <= small.scenario.hold_s - 2 * small.scenario.window_s


def test_resume_refuses_a_record_of_another_scenario(tmp_path):
    p = tmp_path / "v.json"
    p.write_text(json.dumps({"engine": {"kind": "cpu"}, "scenario": {"name": "other"}, "profile": "x",
                             "points": []}))
    with pytest.raises(ValidationError, match="another engine, scenario or profile"):
        validate(EngineSpec("cpu"), load_profile("vllm-cpu-tiny"), get_scenario("cpu-tiny"), ["no-control"],
                 str(p))


def test_gpu_engine_missing_is_refused_before_any_work(monkeypatch, capsys):
    from validate import engine as E
    monkeypatch.setattr(E, "gpu_problem", lambda: "no CUDA GPU found (nvidia-smi lists none)")
    assert main(["validate", "--engine", "gpu", "--points", "no-control"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "llmsim: validate --engine gpu: no CUDA GPU found (nvidia-smi lists none)"


@pytest.mark.parametrize("args, words", [
    (["--upstream", "notaurl"], ["--upstream 'notaurl' is not an engine URL", "http://127.0.0.1:8000"]),
    (["--upstream", "ftp://127.0.0.1:8000"], ["not an engine URL"]),
    (["--upstream", "http://127.0.0.1:99999"], ["not an engine URL", "Port out of range"]),
    (["--upstream", "http://127.0.0.1:8000,http://127.0.0.1:8000/"], ["given twice"]),
    (["--upstream", "http://127.0.0.1:8000", "--router", "least-kv"], ["--router needs two or more engines"]),
    (["--upstream", "http://127.0.0.1:8000", "--router-retries", "1", "--fleet-proxy", "replica"],
     ["--router-retries, --fleet-proxy need two or more engines"]),
    (["--upstream", "http://127.0.0.1:8000,http://127.0.0.1:8001", "--router", "fastest"], ["invalid choice"]),
])
def test_proxy_bad_input_exits_2_with_one_line_reason(args, words, capsys):
    assert main(["proxy", "--condition", "coalesce", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("llmsim")
    for w in words:
        assert w in err


def test_validate_takes_a_scenario_files_fleet_unless_flags_say_otherwise(tmp_path, monkeypatch, capsys):
    """A scenario file with [fleet] makes `validate` a fleet validation with
    the file's replicas, router, router retries and proxy placement; a flag
    given wins over the file. (The live run itself is replaced here: it is
    tests/test_live_fleet.py's.)"""
    from llmsim import validate_cmds as V
    doc = Path("examples/fleet.toml").read_text().replace(
        'profiles = ["qwen2.5-7b", "qwen2.5-7b", "qwen2.5-7b", "llama-3.1-8b"]\n', "").replace(
        'router = "round-robin"', 'router = "least-kv"').replace("replicas = 4", "replicas = 2").replace(
        "router_retries = 1", "router_retries = 0").replace('proxy = "replica"', 'proxy = "deployment"')
    path = tmp_path / "fleet2.toml"
    path.write_text(doc)
    seen = []

    class Stop(Exception):
        pass

    def fake_validate_fleet(spec, prof, vs, n, routers, points, json_path, capacity, retries, proxy, urls,
                            retry_slow, layers=None):
        seen.append((n, routers, points, retries, proxy))
        raise Stop
    monkeypatch.setattr(V.live_fleet, "validate_fleet", fake_validate_fleet)
    monkeypatch.setattr(V.live_fleet, "fleet_problem", lambda n: None)
    monkeypatch.setattr(V.engine, "cpu_installed", lambda: "vllm-cpu")
    monkeypatch.setattr(V, "_predicting_profile", lambda a, spec, prof, *rest: (prof, None))
    for extra in ([], ["--replicas", "1", "--routers", "round-robin", "--router-retries", "1",
                       "--fleet-proxy", "replica"]):
        with pytest.raises(Stop):
            main(["validate", "--engine", "cpu", "--scenario", str(path), *extra])
    assert seen == [(2, ["least-kv"], ["cancel"], 0, "deployment"),          # [proxy] condition = "cancel"
                    (1, ["round-robin"], ["cancel"], 1, "replica")]
    with pytest.raises(Stop):
        main(["validate", "--engine", "cpu", "--scenario", str(path), "--points", "coalesce"])
    assert seen[-1][2] == ["coalesce"]
    path.write_text(doc.replace('condition = "cancel"', 'condition = "cancel"\nproxy_cap = 10'))
    assert main(["validate", "--engine", "cpu", "--scenario", str(path)]) == 2
    assert "give --points" in capsys.readouterr().err
