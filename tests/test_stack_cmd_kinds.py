"""`llmsim stack` on a layer of any registered kind: its settings, and what
it adds to the most attempts, the longest span and the layers that let a
request run on where its kind gives figures (`LayerKind.figures`); where it
gives none, one line saying the stack cannot compose it, and the figures
that depend on it unknown. The kinds are registered in the test files (the
`hold` kind of test_layer_registry, which gives no figures; a `delay` kind
here, which does)."""
from __future__ import annotations

import pytest

import llmsim.stack_cmds as stack_cmds
from llmsim.cli import main
from llmsim.stack_cmds import KIND_SOURCE, SCENARIO_SOURCE, describe
from sim.deployment import from_document
from sim.policy.layers import Figures, LayerKind, register
from sim.schema import NUMBER, Key
from test_layer_registry import SCHEMA_WITH_HOLD, Hold
from test_preset_client import TINY

SDK = {"preset": "openai-python", "timeout_s": 4.0}
NGINX = {"preset": "nginx", "timeout_s": 3.0}


def _delay_settings(preset, overrides):
    if preset is not None:
        raise ValueError("preset: a delay layer takes none")
    return {"kind": "delay", "delay_s": float(overrides.get("delay_s", 0.5)), "runs_on": False}


def _delay_figures(settings, inner_s):
    """One attempt below per attempt from above, `delay_s` later."""
    d = settings["delay_s"]
    return Figures(1, 1, d + inner_s, d + inner_s, ("upstream",) if settings["runs_on"] else ())


register(LayerKind("delay", _delay_settings, lambda settings, context: Hold(settings["delay_s"]),
                   figures=_delay_figures))
SCHEMA = SCHEMA_WITH_HOLD.with_rows(Key("layer", "delay_s", NUMBER, "a delay layer: seconds it holds an attempt",
                                        lo=0))


def _describe(layers):
    return describe(from_document({**TINY, "layer": layers}, "kinds.toml", schema=SCHEMA))


def test_a_kind_that_gives_its_figures_composes_with_the_presets():
    plain = _describe([SDK, NGINX])
    d = _describe([SDK, {"kind": "delay", "delay_s": 0.25}, NGINX])
    sdk, delay, nginx = d["layers"]
    assert delay["composed"] and delay["kind"] == "delay" and delay["preset"] is None
    assert delay["settings"]["delay_s"] == {"value": 0.25, "source": SCENARIO_SOURCE}
    assert delay["attempts"] == delay["reaching_below"] == 1
    assert delay["attempt_s"] == pytest.approx(0.25 + nginx["span_s"])
    assert d["engine_attempts"] == plain["engine_attempts"]          # it adds no attempt
    # each of the SDK's attempts lasts as long as nginx's below it, `delay_s` later (under its own 4 s timeout)
    assert sdk["attempt_s"] == pytest.approx(min(4.0, 0.25 + 3.0)) and plain["layers"][0]["attempt_s"] == 3.0
    assert d["longest_s"] - plain["longest_s"] == pytest.approx(sdk["attempts"] * 0.25)
    assert d["not_composed"] == [] and d["unknown"] == []


def test_a_kinds_default_is_sourced_to_the_kind():
    d = _describe([{"kind": "delay"}])
    (delay,) = d["layers"]
    assert delay["settings"]["delay_s"] == {"value": 0.5, "source": KIND_SOURCE}
    assert delay["attempt_s"] is None and d["longest_s"] is None and d["unknown"] == []    # the engine: no bound


def test_a_kind_without_figures_is_described_and_said_not_to_compose(monkeypatch, capsys):
    dep = from_document({**TINY, "layer": [SDK, {"kind": "hold", "hold_s": 0.5}, NGINX]}, "kinds.toml",
                        schema=SCHEMA)
    d = describe(dep)
    sdk, hold, nginx = d["layers"]
    assert not hold["composed"] and hold["settings"]["hold_s"]["value"] == 0.5
    assert d["not_composed"] == [hold["name"]]
    assert set(d["unknown"]) == {"engine_attempts"}     # the SDK's timeout and retries still bound the call
    assert sdk["attempt_s"] == 4.0 and "attempt_s" not in sdk["unknown"]
    assert nginx["composed"] and nginx["unknown"] == ["attempts_sent"]     # its own figures known; what reaches it not
    monkeypatch.setattr(stack_cmds, "load", lambda *a, **k: dep)
    assert main(["stack", "--scenario", "kinds.toml"]) == 0
    out = capsys.readouterr().out
    assert out.count("cannot be composed") == 1
    assert "hold_s" in out and "most attempts one call can cause at the engine: unknown" in out
