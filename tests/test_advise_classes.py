"""The advisor per traffic class (sim/experiments/advise_classes.py) and a
fleet's records per class (sim/fleet.py run_fleet)."""
from __future__ import annotations

import json
import os
import re

import pytest

from llmsim.cli import main
from sim.conditions import compose
from sim.deployment import from_document, load
from sim.experiments.advise_classes import advise_classes, class_candidates, rank_key, report
from sim.experiments.sweep import read_rows
from tests.test_shedding import _doc


def test_candidates_shed_cap_and_budget_only_the_classes_that_need_not_recover():
    d = from_document(_doc({"condition": "no-control"}))
    cs = class_candidates(d)
    names = [c.name for c in cs]
    assert len(set(names)) == len(names)
    assert {"no-control", "cancel", "no-retry", "no-retry+cancel"} <= set(names)
    shedding = [c for c in cs if c.proxy.sheds]
    assert shedding and all(set(c.proxy.shed_classes) <= {"batch"} for c in shedding)
    assert all({k for k, _ in c.proxy.class_cap + c.proxy.class_budget} <= {"batch"} for c in shedding)
    assert {c.proxy.shed_when for c in shedding if c.proxy.shed_classes} == {"engine_waiting", "kv_usage"}
    assert {c.proxy.cancellation for c in shedding} == {"off", "now"}


def test_advise_by_class_ranks_and_reports_each_class_delivery():
    d = from_document(_doc({"condition": "no-control"}))
    shed = d.condition_for(compose("no-control", shed_classes=["batch"], shed_when="engine_waiting", shed_above=20))
    res = advise_classes(d, [0, 1], screen=1, finalists=2, candidates=[d.condition_for(), shed], progress=False)
    ranked = [r["condition"] for r in res["ranking"]]
    assert ranked == sorted(ranked, key=lambda n: rank_key(next(r for r in res["ranking"] if r["condition"] == n)))
    by = {r["condition"]: r for r in res["ranking"]}
    assert set(by) == {d.condition_for().name, shed.name}
    # each class's figures are its records' over the seeds
    recs = [d.run(seed=s, condition=shed) for s in (0, 1)]
    for name in ("chat", "batch"):
        c = by[shed.name]["classes"][name]
        h = [r["classes"][name]["cohorts"]["hold"] for r in recs]
        assert c["hold_timely"] == pytest.approx(sum(x["within_deadline"] / x["offered"] for x in h) / 2)
        assert c["shed_calls"] == pytest.approx(sum(r["classes"][name]["shed"]["calls"] for r in recs) / 2)
        assert c["must_recover"] == (name == "chat")
    assert by[shed.name]["classes"]["batch"]["shed_calls"] > 0 == by[shed.name]["classes"]["chat"]["shed_calls"]
    text = report(res)
    assert "chat (must recover)" in text and "batch:" in text


def test_advise_by_class_needs_classes(tmp_path, capsys):
    f = tmp_path / "one.toml"
    f.write_text('[workload]\nphases = [{name = "base", duration_s = 60.0, load = 0.6}, '
                 '{name = "pulse", duration_s = 60.0, load = 2.7}]\n[measures]\nburst = "pulse"\n')
    assert main(["advise", "--scenario", str(f), "--by-class", "--seeds", "1"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--by-class needs a scenario with workload.classes" in err[0]


def test_a_fleet_record_has_its_classes():
    doc = _doc({"condition": "no-control", "shed_classes": ["batch"], "shed_above": 10})
    doc["fleet"] = {"replicas": 2}
    rec = from_document(doc).run(seed=0)
    assert set(rec["classes"]) == {"chat", "batch"}
    for cohort in ("pulse", "hold"):
        assert sum(c["cohorts"][cohort]["offered"] for c in rec["classes"].values()) == \
            rec["cohorts"][cohort]["offered"]
    assert rec["recovered"] == rec["classes"]["chat"]["recovered"]     # chat must recover, batch need not
    assert rec["shed"]["calls"] == rec["classes"]["batch"]["shed"]["calls"] > 0
    assert rec["classes"]["chat"]["shed"]["calls"] == 0


EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "classes-cpu-tiny.toml")


def _layered(tmp_path):
    """The tiny two-class example under a client layer (the OpenAI SDK's
    preset), as a scenario file."""
    doc = dict(load(EXAMPLE).document(), layer=[{"preset": "openai-python", "timeout_s": 7.5}])
    dep = from_document(doc, "classes-layer.toml")
    f = tmp_path / "classes-layer.toml"
    f.write_text(dep.to_toml())
    return dep, f


def test_advise_by_class_runs_under_a_client_layer_with_margins_and_resumes(tmp_path, capsys):
    """--by-class takes a scenario with a client [[layer]]: every run is the
    layered deployment's, the first of the ranking get their margins, and
    a rerun on the same --out store runs nothing again."""
    dep, f = _layered(tmp_path)
    out, js = tmp_path / "a.parquet", tmp_path / "a.json"
    cmd = ["advise", "--scenario", str(f), "--by-class", "--seeds", "3", "--screen", "1", "--finalists", "2",
           "--workers", "1", "--out", str(out), "--json", str(js)]
    assert main(cmd + ["--margin-axes", "speed"]) == 0
    text = capsys.readouterr()
    assert "under the client layer openai-python" in text.out and "   margin: " in text.out
    assert re.search(r"screen \d+ settings x 1 seeds .* runs", text.err)
    d = json.loads(js.read_text())
    assert [x["kind"] for x in d["layers"]] == ["client"] and d["margin_axes"] == ["speed"]
    ranked = d["ranking"]
    assert len(ranked) >= 2
    for r in ranked[:3]:
        assert r["margin"]["axes"][0]["axis"] == "speed"
        assert r["margin"]["axes"][0]["probes"][0]["p"] == r["p"]          # the baseline probe is the ranking's
    # each figure is the layered deployment's own runs'
    by_name = {c.name: c for c in class_candidates(dep)}
    recs = [dep.run(seed=s, condition=by_name[ranked[0]["condition"]]) for s in range(3)]
    for name in ("chat", "batch"):
        h = [r["classes"][name]["cohorts"]["hold"] for r in recs]
        assert ranked[0]["classes"][name]["hold_timely"] == pytest.approx(
            sum(x["within_deadline"] / x["offered"] for x in h) / 3)
    rows = read_rows(str(out))
    assert len(rows) == d["candidates"] + len(ranked) * 2 and len({r["deployment"] for r in rows}) == 1
    # no-control's run (retries on) is the layer's, not the reference client's
    stored = next(r for r in rows if r["condition"] == "no-control" and r["seed"] == 0)
    key = "classes_batch_attempts_timeout"
    assert stored[key] == dep.run(seed=0, condition="no-control")["classes"]["batch"]["attempts"]["timeout"]
    bare = load(EXAMPLE).run(seed=0, condition="no-control")["classes"]["batch"]["attempts"]["timeout"]
    assert stored[key] != bare
    # the rerun finds every run in the store
    assert main(cmd + ["--margin-axes", "none"]) == 0
    again = capsys.readouterr()
    assert " runs" not in again.err
    d2 = json.loads(js.read_text())
    assert [{k: v for k, v in r.items() if k != "margin"} for r in d2["ranking"]] == \
        [{k: v for k, v in r.items() if k != "margin"} for r in ranked]
    assert all(r["margin"] is None for r in d2["ranking"]) and len(read_rows(str(out))) == len(rows)


def test_advise_by_class_refuses_a_margin_axis_it_has_no_layer_for(tmp_path, capsys):
    _, f = _layered(tmp_path)
    assert main(["advise", "--scenario", str(f), "--by-class", "--seeds", "1",
                 "--margin-axes", "layer.gateway.timeout_s"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "gateway" in err[0]
