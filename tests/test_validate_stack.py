"""`llmsim validate --scenario STACK.toml` with [[layer]] tables, against
tests/fake_vllm.py given by URL (a stand-in, not vLLM): the OpenAI SDK is
the live client, nginx (where `llmsim gateway install nginx` put it) sits
between it and the live proxy, and each point is compared with the
simulator's prediction of the same stack (live only, saying why, where the
simulator does not run it).
A stack the live harness cannot run ends in one line, exit 2, before any
work. Loopback only; about 30 s."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmsim.cli import main
from validate import engine as E

pytest.importorskip("openai")
FAKE = Path(__file__).resolve().parent / "fake_vllm.py"

SCENARIO = """
name = "{name}"
seed = 0
[model]
profile = "vllm-cpu-tiny"
[workload]
phases = [
  {{ name = "base", duration_s = 2.0, load = 0.6 }},
  {{ name = "pulse", duration_s = 2.0, load = 1.5 }},
  {{ name = "hold", duration_s = 4.0, load = 0.6 }},
]
prompt = {{ dist = "fixed", value = 64 }}
response = {{ dist = "fixed", value = 20 }}
shared_prefix = 16
[client]
deadline_s = 3.0
[measures]
burst = "pulse"
{layers}
"""
SDK = """
[[layer]]
kind = "client"
preset = "openai-python"
timeout_s = 3
"""
NGINX = """
[[layer]]
kind = "gateway"
preset = "nginx"
timeout_s = 2
"""


@pytest.fixture
def fake_engine():
    port = E.free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end:
        try:
            E.http_get(url + "/health", timeout=1.0)
            break
        except E.EngineError:
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def _write(tmp_path, name, layers):
    p = tmp_path / f"{name}.toml"
    p.write_text(SCENARIO.format(name=name, layers=layers))
    return p


def _validate(path, url, out):
    return main(["validate", "--engine", url, "--profile", "vllm-cpu-tiny", "--capacity", "4",
                 "--scenario", str(path), "--points", "no-control", "--json", str(out)])


def test_the_sdk_stack_is_run_live_and_compared(tmp_path, fake_engine, capsys):
    out = tmp_path / "sdk.json"
    assert _validate(_write(tmp_path, "sdk", SDK), fake_engine, out) == 0
    doc = json.loads(out.read_text())
    assert [t["preset"] for t in doc["stack"]] == ["openai-python"] and doc["stack"][0]["timeout_s"] == 3
    (p,) = doc["points"]
    live, sim = p["live"], p["sim"]
    assert live["extra"]["client"]["software"] == "openai-python"
    assert live["extra"]["client"]["options"] == {"max_retries": 2, "timeout": 3.0}
    assert sim is not None and "agreement" in p
    assert sim["cohorts"]["pulse"]["offered"] == live["cohorts"]["pulse"]["offered"] > 0
    assert live["attempts"]["first"] >= live["cohorts"]["pulse"]["offered"]
    assert live["executions"]["completed"] > 0
    assert "no-control: recovered" in capsys.readouterr().out


@pytest.mark.usefixtures("gateways_installed")
def test_the_sdk_behind_nginx_runs_live_through_the_gateway(tmp_path, fake_engine, capsys):
    out = tmp_path / "nginx.json"
    assert _validate(_write(tmp_path, "sdk-nginx", SDK + NGINX), fake_engine, out) == 0
    doc = json.loads(out.read_text())
    (p,) = doc["points"]
    gw = p["live"]["extra"]["gateway"]
    assert gw["software"] == "nginx" and gw["version"] == "1.22.1"
    conf = Path(gw["config"]).read_text()
    assert "proxy_read_timeout 2000ms;" in conf
    assert p["live"]["executions"]["completed"] > 0
    # the simulator's prediction of the same stack, nginx included
    assert p["sim"] is not None and "agreement" in p
    assert p["sim"]["cohorts"]["hold"]["offered"] == p["live"]["cohorts"]["hold"]["offered"] > 0
    assert "no-control: recovered" in capsys.readouterr().out


def test_a_stack_the_simulator_does_not_run_is_live_only_and_says_why():
    from sim.deployment import ScenarioError
    from sim.scenario import get_scenario
    from validate.validation import NoPrediction, predict, table

    def not_simulated(cond):
        raise ScenarioError("x: layer[1] (nginx): not yet simulated")
    with pytest.raises(NoPrediction, match="not yet simulated"):
        predict(None, "no-control", get_scenario("cpu-tiny"), 4.0, not_simulated)
    live = {"recovered": False, "recovery_time_s": None,
            "cohorts": {c: {"offered": 10, "delivered": 5, "within_deadline": 4} for c in ("pulse", "hold")},
            "rates_xC": {"created": 1.0, "accepted": 1.0}, "counters_hold": {}, "engine": {"steps": 7}}
    out = table([{"condition": "no-control", "sim": None, "no_prediction": "not yet simulated", "live": live}])
    assert "(no prediction: not yet simulated)" in out and "hold delivered %" in out and "50.0" in out


@pytest.mark.parametrize("layers, words", [
    (SDK.replace("timeout_s = 3", "backoff_base_s = 2.0"), "layer[0].backoff_base_s: the OpenAI Python SDK has no"),
    (SDK + NGINX.replace("timeout_s = 2", "retry_on = [\"408\"]"), "layer[1].retry_on: nginx's proxy_next_upstream"),
    (SDK + NGINX.replace("nginx", "envoy"), "layer[1].preset: a live run's gateway is nginx or haproxy"),
    ("[[layer]]\nkind = \"client\"\npreset = \"langchain-with-retry\"\n", "layer[0].preset: a live run's client"),
])
def test_a_stack_the_live_harness_cannot_run_exits_2_in_one_line(tmp_path, capsys, layers, words):
    out = tmp_path / "x.json"
    assert _validate(_write(tmp_path, "bad", layers), "http://127.0.0.1:9", out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err
    assert not out.exists()
