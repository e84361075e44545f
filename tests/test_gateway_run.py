"""Gateway [[layer]]s run in the simulator: between the client and the
proxy, in the order of the tables, through `sim.model.Run` and
`Deployment.run`. The scenario is the tiny one of test_preset_client (a
burst that times calls out), with every time scaled down alike."""
from __future__ import annotations

import os

import numpy as np
import pytest

from llmsim.cli import main
from sim.deployment import from_document, load
from sim.model import Run
from sim.runlog import ATTEMPT_OUTCOMES
from test_preset_client import TINY


def _dep(layers, condition="no-control"):
    return from_document({**TINY, "proxy": {"condition": condition}, "layer": layers}, "tiny.toml")


def _run(dep, seed=0):
    cond = dep.condition_for()
    run = Run(dep.profile, dep.trace(seed), cond, dep.scenario, seed, stack=dep.stack_for(cond))
    return run, run.run()


SDK = {"preset": "openai-python", "timeout_s": 4.0}        # the SDK at 60 s, scaled
NGINX = {"preset": "nginx", "timeout_s": 3.0}              # nginx's 60 s read timeout, scaled below the SDK's


def test_the_sdk_retries_the_504_of_nginxs_read_timeout():
    dep = _dep([SDK, NGINX])
    rec = dep.run(0)
    (nginx,) = rec["extra"]["layers"]
    att = rec["attempts"]
    assert nginx["preset"] == "nginx" and nginx["upstream_timeout"] > 0
    assert att["refused_gateway"] == nginx["upstream_timeout"]      # each 504 is an attempt's answer
    assert att["timeout"] == 0                                       # nginx answers before the SDK gives up
    assert att["retries"] > 0 and nginx["retries"] == 0              # the SDK retries; nginx resends no POST
    assert nginx["upstream_attempts"] == att["sent"]


def test_a_gateway_that_does_not_pass_the_disconnect_on_lets_executions_run_on_after_the_client_left():
    # the SDK gives up first; the proxy cancels what it hears of (condition "cancel")
    layers = [{"preset": "openai-python", "timeout_s": 2.0, "max_retries": 0}]
    passes = _dep(layers + [{"preset": "nginx"}], "cancel").run(0)
    runs_on = _dep(layers + [{"preset": "haproxy", "timeout_s": 30.0}], "cancel").run(0)
    assert passes["attempts"]["timeout"] > 0 and runs_on["attempts"]["timeout"] > 0
    assert passes["executions"]["aborted"] > 0 and passes["executions"]["orphaned"] == 0
    assert runs_on["executions"]["aborted"] == 0
    assert runs_on["executions"]["orphaned"] == runs_on["extra"]["layers"][0]["run_on"] > 0
    assert passes["extra"]["layers"][0]["disconnects_passed"] > 0


def test_chained_gateways_each_see_the_attempts_of_the_layer_above():
    dep = _dep([SDK, NGINX, {"preset": "litellm", "timeout_s": 2.0, "max_retries": 1, "backoff": "none"}])
    run, log = _run(dep)
    top, below = run.layers
    assert top.counts["upstream_attempts"] == len(log.attempts.call)
    assert below.counts["upstream_attempts"] == top.counts["upstream_attempts"] + below.counts["retries"]
    assert below.counts["retries"] > 0 and below.counts["upstream_timeout"] > 0
    # every upstream attempt that reached the proxy made an execution
    assert len(log.executions) == below.counts["upstream_attempts"]


def test_a_gateways_connection_limit_bounds_the_requests_below_it():
    gw = {"preset": "haproxy", "timeout_s": 30.0, "max_connections": 2, "queue_timeout_s": 1.0,
          "passes_disconnect": True, "passes_disconnect_queued": True}
    run, log = _run(_dep([SDK, gw]))
    (h,) = run.layers
    assert h.counts["queue_timeout"] > 0
    assert max(log.series.waiting + log.series.running) <= 2
    ref_run, ref_log = _run(_dep([SDK]))
    assert max(ref_log.series.waiting + ref_log.series.running) > 2


@pytest.mark.parametrize("seed", [0, 1])
def test_a_run_with_gateways_is_the_same_run_each_time(seed):
    dep = _dep([SDK, NGINX, {"preset": "envoy"}])
    a, b = _run(dep, seed)[1], _run(dep, seed)[1]
    assert list(a.attempts.outcome) == list(b.attempts.outcome)
    assert len(a.executions) == len(b.executions)
    fa, fb = a.executions.column("finished_at"), b.executions.column("finished_at")
    assert np.array_equal(np.isnan(fa), np.isnan(fb))
    assert np.allclose(fa[~np.isnan(fa)], fb[~np.isnan(fb)], rtol=1e-12, atol=0)


def test_llmsim_run_runs_a_stack_with_a_gateway(tmp_path, capsys):
    f = tmp_path / "tiny.toml"
    f.write_text(_dep([SDK, NGINX]).to_toml())
    assert main(["run", "--scenario", str(f)]) == 0
    assert "pulse" in capsys.readouterr().out
    assert main(["stack", "--scenario", str(f)]) == 0
    assert "nginx" in capsys.readouterr().out


def test_an_inference_gateway_sheds_only_the_best_effort_class_when_the_engine_is_saturated():
    dep = load(os.path.join(os.path.dirname(__file__), "..", "examples", "classes-chat-batch.toml"))
    doc = dep.document()
    for c in doc["workload"]["classes"]:
        c["must_recover"] = c["name"] == "chat"
    doc["layer"] = [{"preset": "inference-gateway"}]
    dep = from_document(doc, "classes.toml", base_dir=dep.base_dir)
    run, log = _run(dep)
    (gw,) = run.layers
    assert gw.counts["shed"] > 0
    trace = dep.trace(0)
    batch = [i for i, c in enumerate(dep.scenario.classes) if c.name == "batch"][0]
    shed_calls = {log.attempts.call[i] for i in range(len(log.attempts.call))
                  if log.attempts.outcome[i] == ATTEMPT_OUTCOMES.index("refused_gateway")}
    assert len(shed_calls) > 0 and all(trace.klass[c] == batch for c in shed_calls)
