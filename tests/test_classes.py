"""Traffic classes (docs/classes.md): the trace's class column, each call's
client and priority by its class, the record's `classes` and the
deployment's verdict by the classes that must recover."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os

import numpy as np
import pytest
from hypothesis import given, strategies as st

import golden
from llmsim.cli import main
from sim.classes import ClassClients, call_priorities, clients
from sim.conditions import CONDITIONS
from sim.deployment import from_document
from sim.measures import class_records, record, with_classes
from sim.model import simulate
from sim.profile import load_profile
from sim.run import run_one
from sim.scenario import PAPER, Lengths, TrafficClass
from sim.schema import ScenarioError
from sim.workload import make_trace
from tests.test_properties import cases, examples

with open(golden.GOLDEN) as _f:
    STORED = json.load(_f)


# ------------------------------------------------------------------ the trace
def test_no_class_and_one_class_draw_todays_trace():
    base = make_trace(2.0, PAPER, 3)
    one = make_trace(2.0, PAPER.with_(classes=(TrafficClass("all", 1.0, priority=4),)), 3)
    assert base.klass is None
    for k in ("arrival", "prompt_len", "max_tokens"):
        assert np.array_equal(getattr(base, k), getattr(one, k))
    assert (one.klass == 0).all()


def test_classes_draw_their_own_lengths_and_phases_their_own_shares():
    chat = TrafficClass("chat", 0.5, prompt=Lengths("fixed", value=2500), response=Lengths("fixed", value=7))
    batch = TrafficClass("batch", 0.5)
    phases = tuple(dataclasses.replace(p, shares=(("batch", 1.0),)) if p.name == "pulse" else p
                   for p in PAPER.phases)
    s = PAPER.with_(classes=(chat, batch), phases=phases)
    tr = make_trace(2.0, s, 0)
    is_chat = tr.klass == 0
    assert (tr.prompt_len[is_chat] == 2500).all() and (tr.max_tokens[is_chat] == 7).all()
    assert (tr.prompt_len[~is_chat] != 2500).any()
    in_pulse = (tr.arrival >= s.pulse_start) & (tr.arrival < s.pulse_end)
    assert in_pulse.any() and (tr.klass[in_pulse] == 1).all()
    before = tr.arrival < s.pulse_start
    assert 0.3 < is_chat[before].mean() < 0.7


def test_each_call_goes_through_its_class_client_with_its_priority():
    s = PAPER.with_(classes=(TrafficClass("a", 0.5, deadline_s=30.0, max_retries=0, priority=0),
                             TrafficClass("b", 0.5, priority=7)))
    tr = make_trace(2.0, s, 1)
    layer = clients(CONDITIONS["cancel"].client_config(s), CONDITIONS["cancel"], s, tr, lambda a, b: a)
    assert isinstance(layer, ClassClients)
    a, b = layer.by_class
    assert (a.policy.timeout_s, a.policy.max_retries, a.policy.retry_after_cap_s) == (30.0, 0, 30.0)
    assert (b.policy.timeout_s, b.policy.max_retries) == (PAPER.deadline_s, PAPER.max_retries)
    # the condition's retries off still rules every class
    no_retry = CONDITIONS["no-retry"]
    assert all(c.policy.max_retries == 0 for c in clients(no_retry.client_config(s), no_retry, s, tr, None).by_class)
    assert call_priorities(tr, s) == [0 if k == 0 else 7 for k in tr.klass.tolist()]


# ------------------------------------------------------------------ the records
@pytest.mark.parametrize("condition", ["cancel", "no-retry+cancel"])
def test_one_class_with_priority_0_under_fcfs_gives_todays_record(condition):
    """The golden record, plus the class (whose measures are the run's) and
    the verdict on all calls (the same)."""
    s = PAPER.with_(classes=(TrafficClass("all", 1.0),))
    rec = json.loads(json.dumps(run_one(load_profile("qwen2.5-7b"), condition, 2.7, 0, scenario=s)))
    rec.pop("wall_s")
    cls, every = rec.pop("classes"), rec.pop("all_calls")
    rec["scenario"].pop("classes")
    stored = STORED[f"qwen2.5-7b/{condition}"]
    assert not golden.differences(rec, stored)
    assert every == {"recovered": stored["recovered"], "recovery_time_s": stored["recovery_time_s"]}
    for k in ("cohorts", "recovered", "recovery_time_s", "retries", "attempts", "executions", "waste"):
        assert not golden.differences(cls["all"][k], stored[k]), k


@examples(25)
@given(case=cases(), data=st.data())
def test_a_calls_counted_once_under_its_class(case, data):
    n = data.draw(st.integers(2, 3))
    classes = tuple(TrafficClass(f"c{k}", data.draw(st.floats(0.2, 1.0)), priority=data.draw(st.integers(0, 3)),
                                 deadline_s=data.draw(st.sampled_from([None, case.scenario.deadline_s / 2])),
                                 max_retries=data.draw(st.sampled_from([None, 0, 1])),
                                 must_recover=data.draw(st.booleans()))
                    for k in range(n))
    s = case.scenario.with_(classes=classes)
    policy = data.draw(st.sampled_from(["fcfs", "priority"]))
    prof = dataclasses.replace(case.profile, engine=dict(case.profile.engine, scheduling_policy=policy))
    trace = make_trace(case.capacity, s, case.seed)
    log = simulate(prof, trace, case.condition, s, seed=case.seed)
    whole = record(log, s, case.capacity, {})
    by_class = class_records(log, s, case.capacity, trace.klass)
    assert list(by_class) == [c.name for c in classes]
    for cohort in ("pulse", "hold", "primary"):
        for key in ("offered", "delivered"):
            assert sum(v["cohorts"][cohort][key] for v in by_class.values()) == whole["cohorts"][cohort][key]
    for section, key in (("attempts", "sent"), ("executions", "created"), ("retries", "sent"),
                         ("calls_failed", "attempts"), ("calls_failed", "outstanding")):
        assert sum(v[section][key] for v in by_class.values()) == whole[section][key], (section, key)
    for k, (name, v) in enumerate(by_class.items()):
        offered = (trace.klass == k) & (trace.arrival >= s.pulse_end) & (trace.arrival < s.hold_end)
        assert v["cohorts"]["hold"]["offered"] == int(offered.sum())
    rec = with_classes(whole, by_class)
    must = [v for v in by_class.values() if v["must_recover"]]
    if must:
        assert rec["recovered"] == all(v["recovered"] for v in must)
        assert rec["all_calls"]["recovered"] == whole["recovered"]
    else:
        assert rec["recovered"] == whole["recovered"]


# ------------------------------------------------------------------ the scenario file
def _doc(classes, **workload):
    return {"engine": {"scheduling_policy": "priority"}, "workload": {"classes": classes, **workload}}


def test_a_scenario_file_declares_classes_and_the_policy():
    dep = from_document(_doc([{"name": "chat", "share": 0.6, "deadline_s": 30.0, "priority": 0,
                               "prompt": {"dist": "fixed", "value": 900}},
                              {"name": "batch", "share": 0.4, "priority": 5, "must_recover": False}]), "c.toml")
    chat, batch = dep.scenario.classes
    assert (chat.deadline_s, chat.priority, chat.prompt.value, chat.must_recover) == (30.0, 0, 900, True)
    assert (batch.priority, batch.must_recover, batch.deadline_s) == (5, False, None)
    assert dep.profile.scheduler_config().scheduling_policy == "priority"
    back = from_document(dep.document(), "back.toml")
    assert back.scenario == dep.scenario and back.content_hash == dep.content_hash


@pytest.mark.parametrize("classes,workload,message", [
    ([{"name": "a", "share": 0.5}], {}, "shares must add up to 1"),
    ([{"name": "a", "share": 0.5}, {"name": "a", "share": 0.5}], {}, "'a' names two classes"),
    ([{"share": 1.0}], {}, r"classes\[0\].name is missing"),
    ([{"name": "a", "share": 1.0, "priority": 0.5}], {}, "priority must be a whole number"),
    ([{"name": "a", "share": 1.0}], {"phases": [{"duration_s": 10.0, "load": 1.0, "shares": [["b", 1.0]]}]},
     "names no class 'b'"),
])
def test_a_bad_class_is_one_line_naming_the_key(classes, workload, message):
    with pytest.raises(ScenarioError, match=message):
        from_document(_doc(classes, **workload), "c.toml")


def test_an_unknown_policy_is_refused():
    with pytest.raises(ScenarioError, match="scheduling_policy must be one of fcfs, priority"):
        from_document({"engine": {"scheduling_policy": "sjf"}}, "c.toml")


def test_diagnose_prints_a_table_per_class(tmp_path):
    """`llmsim diagnose --scenario` on the worked example: after the usual
    table (the deployment's verdict, chat's), one per class with its deadline;
    the JSON runs carry each class's record."""
    out, path = io.StringIO(), tmp_path / "d.json"
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "classes-chat-batch.toml")
    with contextlib.redirect_stdout(out):
        assert main(["diagnose", "--scenario", example, "--seed", "0", "--json", str(path)]) == 0
    text = out.getvalue()
    assert "class chat (share 0.7, priority 0, deadline 30 s, must recover):" in text
    assert "class batch (share 0.3, priority 10, deadline 120 s):" in text
    assert "hold <=30s" in text and "the deployment recovers when chat does" in text
    runs = json.loads(path.read_text())["runs"]
    assert len(runs) == 4
    for r in runs:
        assert set(r["classes"]) == {"chat", "batch"}
        assert r["recovered"] == r["classes"]["chat"]["recovered"]
        assert r["engine_config"]["scheduling_policy"] == "priority"


TINY_CLASSES = os.path.join(os.path.dirname(__file__), "..", "examples", "classes-cpu-tiny.toml")


def _class_figures(recs: list[dict], name: str) -> dict:
    """A class's verdict figures computed from the records' class sections."""
    cs = [r["classes"][name] for r in recs]
    hold = [c["cohorts"]["hold"]["within_deadline"] / c["cohorts"]["hold"]["offered"] for c in cs]
    times = [c["recovery_time_s"] for c in cs if c["recovered"]]
    return {"n": len(cs), "recovered": sum(bool(c["recovered"]) for c in cs),
            "hold_within_deadline": float(np.median(hold)), "recovery_time": float(np.median(times)) if times else None}


def _assert_class_summary(summary: dict, recs: list[dict]) -> None:
    assert list(summary["classes"]) == ["chat", "batch"]
    for name, s in summary["classes"].items():
        want = _class_figures(recs, name)
        assert (s["n"], s["recovered"]) == (want["n"], want["recovered"])
        assert s["p"] == pytest.approx(want["recovered"] / want["n"])
        assert s["hold_within_deadline"]["median"] == pytest.approx(want["hold_within_deadline"])
        assert s["recovery_time"]["median"] == pytest.approx(want["recovery_time"])


def test_run_over_seeds_gives_each_class_its_verdict(tmp_path, capsys):
    """`llmsim run --seeds` on a scenario with classes prints a table per
    class and carries each class's verdict under summary.classes, as
    computed from the records' class sections."""
    path = tmp_path / "r.json"
    assert main(["run", "--scenario", TINY_CLASSES, "--seeds", "2", "--json", str(path)]) == 0
    text = capsys.readouterr().out
    assert "class chat (share 0.7, priority 0, deadline 4 s, must recover):" in text
    assert "class batch (share 0.3, priority 10, deadline 7.5 s):" in text
    d = json.loads(path.read_text())
    assert len(d["runs"]) == 2
    _assert_class_summary(d["summary"], d["runs"])
    assert d["summary"]["recovered"] == d["summary"]["classes"]["chat"]["recovered"]    # chat must recover


def test_diagnose_json_gives_each_condition_its_classes_verdicts(tmp_path, capsys):
    """diagnose's summary has, per condition, the classes' verdicts in the
    shape `run --seeds` gives its one cell."""
    diag, run = tmp_path / "d.json", tmp_path / "r.json"
    assert main(["diagnose", "--scenario", TINY_CLASSES, "--seeds", "2", "--json", str(diag)]) == 0
    assert main(["run", "--scenario", TINY_CLASSES, "--seeds", "2", "--json", str(run)]) == 0
    capsys.readouterr()
    d, r = json.loads(diag.read_text()), json.loads(run.read_text())
    for cond, s in d["summary"].items():
        _assert_class_summary(s, [x for x in d["runs"] if x["condition"] == cond])
    assert d["summary"][r["condition"]]["classes"] == r["summary"]["classes"]


def test_a_replayed_trace_gives_each_call_its_class_by_a_column(tmp_path):
    (tmp_path / "t.csv").write_text("arrived_at,num_prefill_tokens,num_decode_tokens,class\n"
                                    "0.0,3000,100,chat\n0.5,12000,300,batch\n1.0,3000,120,chat\n")
    doc = {"workload": {"trace": "t.csv", "classes": [{"name": "chat", "priority": 0},
                                                      {"name": "batch", "priority": 5}]},
           "measures": {"burst_start_s": 0.2, "burst_end_s": 0.6, "hold_end_s": 2.0}}
    dep = from_document(doc, str(tmp_path / "s.toml"), base_dir=str(tmp_path))
    assert dep.trace().klass.tolist() == [0, 1, 0]
    assert [round(c.share, 3) for c in dep.scenario.classes] == [0.667, 0.333]     # the trace's own
    assert call_priorities(dep.trace(), dep.scenario) == [0, 5, 0]
    doc["workload"]["classes"] = [{"name": "chat"}]
    with pytest.raises(ScenarioError, match="names a class 'batch' that workload.classes does not declare"):
        from_document(doc, "s.toml", base_dir=str(tmp_path))
    del doc["workload"]["classes"]
    with pytest.raises(ScenarioError, match="has a class column"):
        from_document(doc, "s.toml", base_dir=str(tmp_path))
