"""[[layer]] tables in a scenario file: a preset of real software with its
keys overridden, checked against the preset's policy with one-line errors
naming the file and `layer[i].key` (exit 2 from the CLI), kept through the
written TOML, and refused where the simulator does not run them (a client
layer below a gateway)."""
from __future__ import annotations

import tomllib

import pytest

from llmsim.cli import main
from sim.deployment import from_document, load
from sim.policy.presets import PRESETS
from sim.schema import ScenarioError

SDK_60S = [{"kind": "client", "preset": "openai-python", "timeout_s": 60},
           {"kind": "gateway", "preset": "nginx"}]


def test_a_layer_takes_its_presets_values_with_its_keys_on_top():
    dep = from_document({"layer": SDK_60S}, "s.toml")
    client, gateway = dep.layer_settings()
    assert client["timeout_s"] == 60.0 and PRESETS["openai-python"].settings["timeout_s"].value != 60.0
    assert client["max_retries"] == PRESETS["openai-python"].settings["max_retries"].value
    assert gateway["timeout_s"] == PRESETS["nginx"].settings["timeout_s"].value
    assert gateway["passes_disconnect"] == PRESETS["nginx"].settings["passes_disconnect"].value


def test_a_layers_kind_defaults_to_its_presets():
    dep = from_document({"layer": [{"preset": "litellm"}]}, "s.toml")
    assert dep.stack_layers[0]["kind"] == "gateway"


def test_layers_are_written_and_read_back_to_the_same_deployment():
    dep = from_document({"layer": SDK_60S}, "s.toml")
    back = from_document(tomllib.loads(dep.to_toml()), "s.toml")
    assert back.stack_layers == dep.stack_layers and back.content_hash == dep.content_hash
    assert dep.content_hash != from_document({}, "s.toml").content_hash
    assert from_document({}, "s.toml").stack_layers == ()


@pytest.mark.parametrize("table, message", [
    ({"preset": "openai-pythn"}, r"layer\[0\]\.preset must be one of .*did you mean 'openai-python'"),
    ({"preset": "openai-python", "timeout": 5}, r"unknown key 'layer\[0\]\.timeout'; did you mean 'timeout_s'"),
    ({"preset": "openai-python", "timeout_s": -1}, r"layer\[0\]\.timeout_s must be non-negative, got -1"),
    ({"preset": "openai-python", "backoff_cap_s": 0.1}, r"layer\[0\]\.backoff_cap_s 0\.1 is below backoff_base_s"),
    ({"preset": "openai-python", "passes_disconnect": False},
     r"layer\[0\]\.passes_disconnect is not a setting of a client layer"),
    ({"kind": "gateway", "preset": "openai-python"}, r"layer\[0\]\.preset 'openai-python' is a client preset"),
    ({"kind": "client"}, r"layer\[0\]\.preset must be given"),
    ({"preset": "nginx", "backoff": "wild"}, r"layer\[0\]\.backoff must be one of"),
])
def test_a_bad_layer_ends_in_one_line_naming_the_file_and_key(table, message):
    with pytest.raises(ScenarioError, match=r"^bad\.toml: " + message) as e:
        from_document({"layer": [table]}, "bad.toml")
    assert "\n" not in str(e.value)


def _toml(path, body):
    path.write_text(body)
    return str(path)


@pytest.mark.parametrize("body, key", [
    ('[[layer]]\npreset = "nope"\n', "layer[0].preset"),
    ('[[layer]]\npreset = "openai-python"\ntimeout_z = 1\n', "layer[0].timeout_z"),
    ('[[layer]]\npreset = "openai-python"\ntimeout_s = -5\n', "layer[0].timeout_s"),
    ('[[layer]]\npreset = "nginx"\n[[layer]]\npreset = "haproxy"\nbackoff_cap_s = 0.1\nbackoff_base_s = 1.0\n',
     "layer[1].backoff_cap_s"),
])
def test_the_cli_exits_2_with_the_file_and_key(tmp_path, capsys, body, key):
    f = _toml(tmp_path / "bad.toml", body)
    assert main(["scenario", "check", f]) == 2
    err = capsys.readouterr().err.strip()
    assert f in err and key in err and "\n" not in err


@pytest.mark.parametrize("layers, message", [
    ('[[layer]]\npreset = "nginx"\n[[layer]]\npreset = "langchain-openai"\n',
     r"layer\[1\] \(langchain-openai\): client layers are described by `llmsim stack` but not yet simulated "
     r"\(client layers first, above every other layer\)"),
])
def test_the_simulator_refuses_a_layer_it_does_not_run(tmp_path, capsys, layers, message):
    f = _toml(tmp_path / "s.toml", layers)
    with pytest.raises(ScenarioError, match=message):
        load(f).run()
    assert main(["run", "--scenario", f]) == 2
    assert "not yet simulated" in capsys.readouterr().err
