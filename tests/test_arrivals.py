"""Constant-rate arrivals (a fixed interval per phase, as inference-perf and
guidellm send) beside Poisson, and the latency command's means."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llmsim.cli import main
from sim.deployment import load
from sim.latency import latency
from sim.profile import load_profile
from sim.scenario import PAPER, Lengths, Phase
from sim.workload import constant_arrivals, make_trace


def write(path, text) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def test_constant_arrivals_are_evenly_spaced_from_the_phase_start():
    t = constant_arrivals(4.0, 10.0, 20.0)
    assert len(t) == 40 and t[0] == pytest.approx(10.0) and t[-1] < 20.0
    assert np.allclose(np.diff(t), 0.25)


def test_trace_with_a_constant_phase_keeps_the_poisson_phases_calls():
    sc = PAPER.with_(phases=(Phase(30.0, rate=2.0, name="a", arrivals="constant"), Phase(60.0, rate=3.0, name="b")))
    tr = make_trace(1.0, sc, 5)
    a = tr.arrival[tr.arrival < 30.0]
    assert len(a) == 60 and np.allclose(np.diff(a), 0.5)
    b = tr.arrival[tr.arrival >= 30.0]
    assert abs(len(b) - 180) < 5 * np.sqrt(180) and np.std(np.diff(b)) > 0.1


def test_poisson_is_the_default_and_reads_as_before():
    sc = PAPER.with_(phases=(Phase(50.0, rate=2.0, name="a"),), burst=0)
    explicit = make_trace(1.0, sc, 3, phases=[(0.0, 50.0, 2.0)])
    default = make_trace(1.0, sc, 3)
    assert np.array_equal(explicit.arrival, default.arrival)
    assert "arrivals" not in sc.phases[0].to_dict()
    assert Phase(5.0, rate=1.0, arrivals="constant").to_dict()["arrivals"] == "constant"
    with pytest.raises(ValueError, match="arrivals"):
        Phase(5.0, rate=1.0, arrivals="uniform")


def test_scenario_file_phase_arrivals(tmp_path, capsys):
    text = """
[model]
capacity = 3.0
[workload]
phases = [{name = "a", duration_s = 20.0, rate = 5.0, arrivals = "constant"},
          {name = "b", duration_s = 20.0, rate = 1.0}]
prompt = {dist = "fixed", value = 500}
response = {dist = "fixed", value = 50}
shared_prefix = 100
"""
    dep = load(write(tmp_path / "c.toml", text))
    tr = dep.trace(0)
    first = tr.arrival[tr.arrival < 20.0]
    assert len(first) == 100 and np.allclose(np.diff(first), 0.2)
    bad = write(tmp_path / "bad.toml", text.replace('"constant"', '"steady"') + '[measures]\nburst = "a"\n')
    rc = main(["run", "--condition", "no-control", "--scenario", bad])
    err = capsys.readouterr().err
    assert rc == 2 and "phases[0].arrivals" in err and err.count("\n") == 1


def test_latency_reports_means_beside_percentiles(tmp_path):
    prof = load_profile("qwen2.5-7b")
    sc = PAPER.with_(prompt=Lengths("fixed", value=600), response=Lengths("fixed", value=100), shared_prefix=0)
    r = latency(prof, 4.0, duration_s=40.0, warmup_s=10.0, scenario=sc, arrivals="constant")
    assert r["arrivals"] == "constant" and r["calls"] == 120
    assert r["ttft_mean"] < r["e2e_mean"] and r["ttft_p50"] <= r["ttft_p90"]
    out = tmp_path / "l.json"
    assert main(["latency", "--model", "qwen2.5-7b", "--rate", "1", "--duration", "120", "--arrivals", "constant",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["arrivals"] == "constant" and rec["e2e_mean"] > rec["ttft_mean"] > 0 and "e2e_p90" in rec
