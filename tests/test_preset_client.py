"""A client layer from a preset runs in the simulator: `preset_client` puts
the preset's RetryPolicy (through `Retrier`) behind `RetryingClient`, whose
decisions the client layer's actions carry out, and a scenario's client
[[layer]] is the run's client."""
from __future__ import annotations

import os

import pytest

from llmsim.cli import main
from sim.classes import class_layer_settings
from sim.conditions import get_condition
from sim.deployment import from_document, load
from sim.model import Run
from sim.policy.client import CallState, Retry
from sim.policy.preset_client import preset_client
from sim.policy.presets import PRESETS, preset
from sim.runlog import CALL_OUTCOMES


class _Draws:
    """uniform(a, b) at a fixed point r of the range."""
    def __init__(self, r):
        self.r = r

    def __call__(self, a, b):
        return a + (b - a) * self.r


def _value(key):
    return PRESETS["openai-python"].settings[key].value


def _client(r=0.0, **overrides):
    return preset_client(preset("client", "openai-python", **overrides), _Draws(r))


def test_an_attempt_is_given_up_after_the_presets_timeout_or_the_override():
    c, call = _client(), CallState(0, 0.0)
    assert c.send(call, 10.0) == 0 and call.deadline == 10.0 + _value("timeout_s")
    c, call = _client(timeout_s=60), CallState(0, 0.0)
    c.send(call, 10.0)
    assert call.deadline == 70.0


def test_a_call_deadline_bounds_the_attempt():
    c, call = _client(timeout_s=60, deadline_s=90), CallState(0, 0.0)
    c.send(call, 0.0)
    assert call.deadline == 60.0
    d = c.timed_out(call, 60.0)
    c.send(call, d.at)
    assert call.deadline == 90.0


@pytest.mark.parametrize("r", [0.0, 0.999])
def test_timeouts_are_retried_with_the_sdks_backoff_until_its_retries_run_out(r):
    c, call = _client(r), CallState(0, 0.0)
    base, cap, amount = _value("backoff_base_s"), _value("backoff_cap_s"), _value("jitter_amount")
    t = 0.0
    for n in range(_value("max_retries")):
        c.send(call, t)
        d = c.timed_out(call, t + 1.0)
        assert type(d) is Retry
        assert d.at - (t + 1.0) == pytest.approx(min(base * 2 ** n, cap) * (1 - amount * r))
        t = d.at
    c.send(call, t)
    d = c.timed_out(call, t + 1.0)
    assert d is None and call.done and call.outcome == "failed_attempts" and call.outcome in CALL_OUTCOMES
    assert call.attempts == _value("max_retries") + 1


def test_a_retry_after_is_the_wait_up_to_the_cap_and_gives_the_call_up_above_it():
    c, call = _client(), CallState(0, 0.0)
    c.send(call, 0.0)
    d = c.refused(call, 1.0, 429, 5.0)
    assert type(d) is Retry and d.at == 6.0
    c.send(call, d.at)
    d = c.refused(call, 7.0, 429, _value("retry_after_cap_s") + 1)
    assert d is None and call.outcome == "failed_retry_after"


def test_a_status_outside_the_retry_on_set_gives_up_and_a_response_delivers():
    c, call = _client(retry_on=["timeout"]), CallState(0, 0.0)
    c.send(call, 0.0)
    assert c.refused(call, 1.0, 503) is None and call.outcome == "failed_attempts"
    c, call = _client(), CallState(1, 0.0)
    c.send(call, 0.0)
    assert c.completed(call, 3.0) is None and call.outcome == "delivered" and call.done


TINY = {"model": {"profile": "vllm-cpu-tiny"},
        "workload": {"phases": [{"name": "base", "duration_s": 7.5, "load": 0.6},
                                {"name": "pulse", "duration_s": 6.6875, "load": 2.7},
                                {"name": "hold", "duration_s": 45.0, "load": 0.6}],
                     "prompt": {"dist": "normal", "mean": 3600.0, "sd": 360.0},
                     "response": {"dist": "lognormal", "median": 90.0, "mean": 120.0}, "shared_prefix": 600},
        "client": {"deadline_s": 7.5, "max_retry_after_s": 7.5}, "measures": {"burst": "pulse"}}


def _attempts(dep, seed=0):
    log = Run(dep.profile, dep.trace(seed), dep.condition_for(), dep.scenario, seed,
              stack=dep.stack_for(dep.condition_for())).run()
    return max(log.calls.attempts)


@pytest.mark.parametrize("retries", [0, 1])
def test_a_run_with_a_client_layer_sends_at_most_its_attempts(retries):
    dep = from_document({**TINY, "layer": [{"preset": "openai-python", "timeout_s": 2.0, "max_retries": retries}]},
                        "tiny.toml")
    attempts = _attempts(dep)
    assert attempts == retries + 1           # the burst times calls out: some use every attempt
    ref = from_document(TINY, "tiny.toml")
    assert dep.stack_for(dep.condition_for()) is not None and ref.stack_for(ref.condition_for()) is None
    assert _attempts(ref) == ref.scenario.max_retries + 1


def test_deployment_run_runs_a_client_layer_on_one_engine_and_on_a_fleet(tmp_path, capsys):
    dep = from_document({**TINY, "layer": [{"preset": "openai-python", "timeout_s": 2.0, "max_retries": 0}]},
                        "tiny.toml")
    rec = dep.run(0)
    ref = from_document(TINY, "tiny.toml").run(0)
    assert rec["deployment"]["content_hash"] != ref["deployment"]["content_hash"]
    gw = from_document({**TINY, "fleet": {"replicas": 2, "profiles": ["vllm-cpu-tiny"] * 2},
                        "layer": [{"preset": "openai-python"}, {"preset": "nginx"}]}, "tiny.toml")
    on_fleet = gw.run(0)
    assert on_fleet["fleet"]["replicas"] == 2 and on_fleet["extra"]["layers"][0]["preset"] == "nginx"


def test_llmsim_run_runs_a_client_layer(tmp_path, capsys):
    dep = from_document({**TINY, "layer": [{"preset": "openai-python", "timeout_s": 2.0}]}, "tiny.toml")
    f = tmp_path / "tiny.toml"
    f.write_text(dep.to_toml())
    assert main(["run", "--scenario", str(f)]) == 0
    assert "pulse" in capsys.readouterr().out


def test_a_client_layer_with_traffic_classes_takes_each_class_keys():
    dep = load(os.path.join(os.path.dirname(__file__), "..", "examples", "classes-chat-batch.toml"))
    chat = next(c for c in dep.scenario.classes if c.name == "chat")
    layer = preset("client", "openai-python")
    s = class_layer_settings(layer, chat, get_condition("cancel"))
    assert (s["timeout_s"], s["max_retries"], s["retry_after_cap_s"]) == (30.0, 1, 30.0)
    assert s["backoff"] == layer["backoff"] and s["preset"] == "openai-python"
    # the condition's retries off still rules the class
    assert "max_retries" not in class_layer_settings({}, chat, get_condition("no-retry"))
    doc = dict(dep.document(), layer=[{"preset": "openai-python"}])
    with_layer = from_document(doc, "classes.toml", base_dir=dep.base_dir)
    chat_rec = with_layer.run(0)["classes"]["chat"]["attempts"]
    # chat's attempts are given up at its 30 s deadline (the preset's own timeout is 600 s), one retry a call
    assert chat_rec["timeout"] > 0 and 0 < chat_rec["retries"] <= chat_rec["first"]
