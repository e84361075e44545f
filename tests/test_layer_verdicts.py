"""`diagnose`, `margin` and `advise` on a stack with a client [[layer]]: each
condition's proxy and engine controls under the layer's client, the layer's
keys as margin axes and as settings the advisor searches, and bad axis
names refused in one line."""
from __future__ import annotations

import json
import os

import pytest

from llmsim.cli import main
from sim.conditions import get_condition
from sim.deployment import Deployment, from_document, from_named
from sim.experiments import advise as A, margin as M
from sim.policy.presets import PRESETS

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")
SEEDS = range(4)


def tiny(**client) -> "Deployment":
    """cpu-tiny's workload (7.5 s deadline, 3.75 s windows) on the tiny CPU
    engine with Ĉ taken as 4 calls/s, called through the OpenAI SDK preset
    with `client` overriding its keys."""
    doc = from_named("cpu-tiny").document()
    doc["model"] = dict(doc["model"], capacity=4.0)
    doc["layer"] = [{"kind": "client", "preset": "openai-python", **client}]
    return from_document(doc, "tiny-sdk.toml")


def _file(tmp_path, dep) -> str:
    f = tmp_path / f"{dep.name}.toml"
    f.write_text(dep.to_toml())
    return str(f)


def _parts(dep):
    import dataclasses
    return dataclasses.replace(dep.profile, capacity=dep.capacity), dep.scenario


# ------------------------------------------------------------------ diagnose
def _diagnose(tmp_path, scenario: str, name: str) -> dict:
    out = tmp_path / f"{name}.json"
    args = ["diagnose", "--seed", "0", "--json", str(out)] + (["--scenario", scenario] if scenario else [])
    assert main(args) == 0
    return json.loads(out.read_text())


def test_the_sdks_defaults_send_no_timeout_retries_where_the_reference_client_storms(tmp_path, capsys):
    sdk = _diagnose(tmp_path, os.path.join(EXAMPLES, "openai-sdk-defaults.toml"), "sdk")
    out = capsys.readouterr().out
    assert "client layer openai-python" in out
    assert "Against" not in out                 # a layer stack is not the published figures' deployment
    ref = _diagnose(tmp_path, None, "ref")
    assert sdk["layers"][0]["preset"] == "openai-python" and ref["layers"] is None
    assert sdk["layers"][0]["timeout_s"] == PRESETS["openai-python"].settings["timeout_s"].value
    assert set(sdk["summary"]) == set(ref["summary"])           # the same conditions, the same output shape
    for r in sdk["runs"]:                                       # no attempt outlives 600 s: one attempt per call
        assert r["attempts"]["timeout"] == 0 and r["retries"]["sent"] == 0
        assert r["attempts"]["sent"] == r["attempts"]["first"]
    ref_nc = next(r for r in ref["runs"] if r["condition"] == "no-control")
    assert ref_nc["attempts"]["timeout"] > 0 and ref_nc["retries"]["sent"] > 0
    assert ref_nc["attempts"]["sent"] > ref_nc["attempts"]["first"]
    # with nothing retried, turning retries off changes nothing
    sdk_runs = {r["condition"]: r for r in sdk["runs"]}
    assert sdk_runs["no-retry"]["cohorts"] == sdk_runs["no-control"]["cohorts"]


def test_a_client_layer_changes_what_diagnose_answers(tmp_path):
    short = _diagnose(tmp_path, _file(tmp_path, tiny(timeout_s=2.0)), "short")
    runs = {r["condition"]: r for r in short["runs"]}
    assert runs["no-control"]["attempts"]["timeout"] > 0
    assert runs["no-control"]["retries"]["sent"] > 0                 # the SDK retries its own timeouts
    assert runs["no-retry"]["retries"]["sent"] == 0                  # the condition turns the layer's retries off
    most = PRESETS["openai-python"].settings["max_retries"].value + 1
    assert runs["no-control"]["attempts"]["sent"] <= most * runs["no-control"]["attempts"]["first"]


# ------------------------------------------------------------------ margin
def test_margin_finds_an_edge_along_the_client_layers_timeout():
    dep = tiny()
    prof, sc = _parts(dep)
    cond = dep.condition_for(get_condition("no-control"))
    res = M.margin(prof, sc, cond, SEEDS, ["layer.client.timeout_s"], rel_tol=0.05, workers=1,
                   layers=dep.run_layers())
    ax = res["axes"][0]
    assert ax["baseline"] == dep.run_layers()[0]["timeout_s"] and ax["recovers_at_baseline"]
    assert ax["crossing"] is not None
    a, b = ax["bracket"]
    assert b < a < ax["baseline"]                              # a shorter timeout stops recovery
    p = {x["x"]: x["p"] for x in ax["probes"]}
    assert p[a] >= 0.5 > p[b]
    assert "timeout_s" in res["sentence"]


def test_margin_along_the_layers_retries_steps_on_whole_numbers():
    dep = tiny(timeout_s=7.5)
    prof, sc = _parts(dep)
    cond = dep.condition_for(get_condition("no-control"))
    res = M.margin(prof, sc, cond, SEEDS, ["layer.client.max_retries"], workers=1, layers=dep.run_layers())
    ax = res["axes"][0]
    assert all(float(x["x"]).is_integer() for x in ax["probes"])
    if ax["crossing"] is not None:
        a, b = ax["bracket"]
        assert abs(a - b) == 1


def test_find_crossing_on_whole_numbers_from_zero():
    r = M.find_crossing(lambda x: 1.0 if x < 5 else 0.0, 0, worse=32, better=0, integer=True)
    assert sorted(r["bracket"]) == [4, 5] and 4 < r["crossing"] < 5
    assert all(float(x).is_integer() for x, _ in r["probes"])


# ------------------------------------------------------------------ advise
def test_advise_only_client_searches_the_layers_keys():
    dep = tiny(timeout_s=7.5)
    prof, sc = _parts(dep)
    r = A.advise(prof, sc, SEEDS, only="client", adapt=dep.condition_for, margin_axes=(), progress=False,
                 layers=dep.run_layers(), base=dep.condition)
    ref = A.advise(prof, sc, SEEDS, only="client", adapt=dep.condition_for, margin_axes=(), progress=False,
                   base=dep.condition)
    assert r["candidates"] > ref["candidates"]
    named = [x["condition"] for x in r["ranking"] if ";client=" in x["condition"]]
    assert any("timeout_s=" in n for n in named)
    changed = set().union(*(t["layers"].get("client", {}) for t in r["top"]))
    assert changed and changed <= {"timeout_s", "max_retries", "backoff", "backoff_base_s", "backoff_cap_s"}
    ranked = {x["condition"]: x for x in r["ranking"]}
    if "no-control" in ranked:                  # the layer's own client, as the scenario runs it
        assert ranked["no-control"]["p"] <= r["ranking"][0]["p"]


def test_client_settings_start_with_the_layers_own_and_keep_its_other_keys():
    dep = tiny()
    client = dep.run_layers()[0]
    settings = A.client_settings(client, dep.scenario)
    assert settings[0] == client and len(settings) == len({json.dumps(s, sort_keys=True) for s in settings})
    for s in settings:
        assert {k: v for k, v in s.items() if k not in ("timeout_s", "max_retries", "backoff", "backoff_base_s",
                                                           "backoff_cap_s")} == \
               {k: v for k, v in client.items() if k not in ("timeout_s", "max_retries", "backoff", "backoff_base_s",
                                                                "backoff_cap_s")}


# ------------------------------------------------------------------ bad axes
@pytest.mark.parametrize("command, axes, message", [
    ("margin", "layer.client.nope", "unknown axis layer.client.nope"),
    ("margin", "layer.gateway.timeout_s", "needs a gateway [[layer]]"),
    ("margin", "layer.proxy.cap", "a layer's axis is layer.KIND.KEY"),
    ("margin", "speed,warp", "unknown axis 'warp'"),
    ("diagnose", "layer.client.nope", "unknown axis layer.client.nope"),
    ("advise", "layer.client.nope", "unknown axis layer.client.nope"),
])
def test_a_bad_axis_name_ends_in_one_line(tmp_path, capsys, command, axes, message):
    f = _file(tmp_path, tiny())
    flag = {"margin": "--axes", "diagnose": "--margin", "advise": "--margin-axes"}[command]
    extra = ["--condition", "no-control"] if command == "margin" else []
    assert main([command, "--scenario", f, "--seeds", "0-1", flag, axes, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_layer_axis_without_a_client_layer_ends_in_one_line(capsys):
    assert main(["margin", "--condition", "no-control", "--seeds", "0-1", "--axes", "layer.client.timeout_s"]) == 2
    err = capsys.readouterr().err.strip()
    assert "needs a client [[layer]]" in err and "\n" not in err


def test_advise_only_gateway_without_a_gateway_layer_ends_in_one_line(tmp_path, capsys):
    assert main(["advise", "--only", "gateway", "--seeds", "0-1", "--scenario", _file(tmp_path, tiny())]) == 2
    err = capsys.readouterr().err.strip()
    assert "the scenario has none" in err and "\n" not in err


def test_gives_up_compares_no_margins_searched_from_different_values():
    s = {"p": 1.0, "timely": 0.8, "delivered": 0.9, "burst": 0.5, "recovery_time": {"median": 100.0}}

    def ax(base, c):
        return {"axes": [{"axis": "layer.client.timeout_s", "baseline": base, "crossing": c,
                          "recovers_at_baseline": True}]}

    assert A.gives_up(s, s, ax(120.0, 21.0), ax(240.0, 21.0)) == []
    assert A.gives_up(s, s, ax(120.0, 100.0), ax(120.0, 21.0)) != []


# ------------------------------------------------------------------ gateway layers
def tiny_behind(gateway: dict, **client) -> "Deployment":
    """`tiny` with a gateway [[layer]] between the SDK and the proxy."""
    doc = tiny(**client).document()
    doc["layer"].append({"kind": "gateway", **gateway})
    return from_document(doc, "tiny-gw.toml")


def test_margin_finds_an_edge_along_a_gateways_upstream_timeout():
    dep = tiny_behind({"preset": "nginx"})
    prof, sc = _parts(dep)
    cond = dep.condition_for(get_condition("no-control"))
    res = M.margin(prof, sc, cond, SEEDS, ["layer.gateway.timeout_s"], rel_tol=0.05, workers=1,
                   layers=dep.run_layers())
    ax = res["axes"][0]
    assert ax["baseline"] == PRESETS["nginx"].settings["timeout_s"].value and ax["recovers_at_baseline"]
    assert ax["crossing"] is not None
    a, b = ax["bracket"]
    assert b < a < ax["baseline"]               # a shorter upstream timeout: 504s the SDK retries
    assert "gateway's timeout_s" in res["sentence"]


def test_diagnose_and_advise_only_gateway_on_a_gateway_stack(tmp_path):
    dep = tiny_behind({"preset": "litellm", "timeout_s": 3.0}, timeout_s=7.5)
    out = _diagnose(tmp_path, _file(tmp_path, dep), "gw")
    assert [s["kind"] for s in out["layers"]] == ["client", "gateway"]
    nc = next(r for r in out["runs"] if r["condition"] == "no-control")
    gw = nc["extra"]["layers"][0]
    assert gw["preset"] == "litellm" and gw["upstream_timeout"] > 0 and gw["retries"] > 0
    prof, sc = _parts(dep)
    r = A.advise(prof, sc, SEEDS, only="gateway", adapt=dep.condition_for, margin_axes=(), progress=False,
                 layers=dep.run_layers(), base=dep.condition, screen_base_s=None, screen_hold_s=None)
    assert all(x["condition"].split(";")[0] == dep.condition.name for x in r["ranking"])
    changed = set().union(*(t["layers"].get("gateway", {}) for t in r["top"]))
    assert changed and changed <= {"timeout_s", "max_retries", "passes_disconnect"}
    assert not any(t["layers"].get("client") for t in r["top"])        # the client layer as given
