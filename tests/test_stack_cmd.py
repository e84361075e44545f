"""`llmsim stack`: a scenario's layers with their effective settings and
sources, and what the stack can do to one call, on the shipped examples of
real stacks and on the reference design's own layers."""
from __future__ import annotations

import json
import os

import pytest

from llmsim.cli import main
from llmsim.stack_cmds import SCENARIO_SOURCE, describe
from sim.deployment import load
from sim.policy.presets import PRESETS, citations
from sim.scenario import PAPER

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _example(name):
    return os.path.join(EXAMPLES, name)


def _value(name, key):
    return PRESETS[name].settings[key].value


def test_the_reference_design_shows_its_own_client_proxy_and_router():
    d = describe(load("paper"))
    assert d["reference_design"] and [x["name"] for x in d["layers"]] == ["client", "proxy", "router"]
    client = d["layers"][0]["settings"]
    assert client["timeout_s"]["value"] == PAPER.deadline_s and client["max_retries"]["value"] == PAPER.max_retries
    assert d["engine_attempts"] == PAPER.max_retries + 1
    assert d["runs_on"] == ["proxy"]                    # no-control: the proxy cancels nothing


def test_a_proxy_that_cancels_lets_nothing_run_on(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[proxy]\ncondition = "cancel"\n')
    assert describe(load(str(f)))["runs_on"] == []
    f.write_text('[proxy]\ncondition = "no-retry"\n')
    assert describe(load(str(f)))["engine_attempts"] == 1


def test_the_sdk_defaults_retry_twice_at_the_engine_after_600s_attempts():
    d = describe(load(_example("openai-sdk-defaults.toml")))
    (sdk,) = d["layers"]
    assert sdk["settings"]["timeout_s"]["value"] == _value("openai-python", "timeout_s") == 600.0
    assert d["engine_attempts"] == _value("openai-python", "max_retries") + 1 and d["runs_on"] == []
    assert sdk["attempt_s"] == 600.0


def test_the_sdk_at_60s_behind_nginx():
    d = describe(load(_example("openai-sdk-60s-nginx.toml")))
    sdk, nginx = d["layers"]
    r = _value("openai-python", "max_retries")
    assert sdk["settings"]["timeout_s"] == {"value": 60.0, "source": SCENARIO_SOURCE}
    assert nginx["settings"]["timeout_s"]["source"] == citations("nginx")["timeout_s"]
    assert d["engine_attempts"] == r + 1            # nginx resends no POST already sent
    assert d["longest_s"] == pytest.approx((r + 1) * 60.0 + r * _value("openai-python", "retry_after_cap_s"))
    assert d["runs_on"] == []


def test_litellm_multiplies_the_sdks_attempts_and_lets_abandoned_calls_run_on(tmp_path):
    d = describe(load(_example("litellm-proxy.toml")))
    assert d["engine_attempts"] == (_value("openai-python", "max_retries") + 1) * (2 + 1)
    assert d["runs_on"] == ["litellm"]
    f = tmp_path / "cancel.toml"
    f.write_text('[[layer]]\npreset = "openai-python"\n[[layer]]\npreset = "litellm"\npasses_disconnect = true\n')
    assert describe(load(str(f)))["runs_on"] == []


def test_the_command_prints_the_stack_and_writes_the_same_as_json(tmp_path, capsys):
    f = _example("litellm-proxy.toml")
    out = tmp_path / "stack.json"
    assert main(["stack", "--scenario", f, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    d = describe(load(f))
    assert json.loads(out.read_text()) == json.loads(json.dumps(d))
    assert f"most attempts one call can cause at the engine: {d['engine_attempts']:g}" in text
    assert "layers that let an abandoned request run on: litellm" in text
    assert citations("litellm")["passes_disconnect"] in text


@pytest.mark.parametrize("placement, says", [("replica", "behind it, a sidecar before each engine"),
                                              ("deployment", "before it ([fleet] proxy = \"deployment\")")])
def test_an_upstream_group_says_where_the_proxy_stands(tmp_path, capsys, placement, says):
    text = open(_example("live-cpu-tiny-nginx-group.toml")).read()
    f = tmp_path / "group.toml"
    f.write_text(text.replace('proxy = "replica"', f'proxy = "{placement}"'))
    assert main(["stack", "--scenario", str(f)]) == 0
    assert f"the gateway's upstream group balances 2 replicas; the condition's proxy stands {says}" in \
        capsys.readouterr().out
    assert describe(load(str(f)))["upstream_group"] == {"servers": 2, "proxy": placement}
    assert describe(load("paper"))["upstream_group"] is None


def test_a_bad_stack_exits_2_in_one_line(tmp_path, capsys):
    f = tmp_path / "bad.toml"
    f.write_text('[[layer]]\npreset = "nginx"\ntimeout_s = -1\n')
    assert main(["stack", "--scenario", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert str(f) in err and "layer[0].timeout_s" in err and "\n" not in err
