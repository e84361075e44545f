"""The commands that run many points take a scenario with [[layer]] tables:
`map` (over a layer's key too, `layer.client.max_retries=0,2`) and `sweep`
run the stack the scenario describes, as `run` does."""
from __future__ import annotations

import dataclasses

import pyarrow.parquet as pq
import pytest

from llmsim.cli import main
from sim.deployment import from_document
from sim.experiments import margin as M, phasemap as P
from tests.test_preset_client import TINY

CLIENT = {"preset": "openai-python", "timeout_s": 2.0, "max_retries": 0}


def _dep(layer=CLIENT):
    return from_document({**TINY, "layer": [layer]}, "tiny.toml")


def test_a_layers_key_is_a_map_axis_with_the_values_of_margins_axis():
    assert P.parse_range("layer.client.max_retries=0,2", _dep().run_layers()) == ("layer.client.max_retries",
                                                                                   [0.0, 2.0])
    for bad, why in [("layer.client.max_retries=0.5", "whole numbers"), ("layer.client.timeout_s=-1,2", "values from"),
                     ("layer.client.warp_s=1,2", "unknown axis"), ("layer.gateway.timeout_s=1,2", "gateway")]:
        with pytest.raises(ValueError, match=why):
            P.parse_range(bad, _dep().run_layers())
    with pytest.raises(ValueError, match="needs a client"):
        P.parse_range("layer.client.timeout_s=1,2", None)


def test_the_map_runs_the_layers_with_the_axis_value_set():
    dep = _dep()
    prof, sc = dataclasses.replace(dep.profile, capacity=dep.capacity), dep.scenario
    cond, layers = dep.condition_for(), dep.run_layers()
    rows = P.phase_map(prof, sc, cond, ("layer.client.timeout_s", [2.0, 7.5]), ("pulse", [sc.pulse]), [0, 1],
                       workers=1, layers=layers)
    cells = [M.cell(prof, sc, cond, [0, 1], layers=M.axis("layer.client.timeout_s").layers_at(layers, t))
             for t in (2.0, 7.5)]
    for row, c in zip(rows, cells):
        assert row["p"] == c["p"] and row["hold_delivered_median"] == c["hold_delivered"]["median"]
    # a 2 s attempt timeout cuts calls the 7.5 s one lets finish: the axis reached the client layer
    assert rows[0]["hold_delivered_median"] < rows[1]["hold_delivered_median"]


def test_map_and_sweep_take_a_scenario_with_layers(tmp_path, capsys):
    f = tmp_path / "tiny.toml"
    f.write_text(_dep({"preset": "openai-python", "timeout_s": 2.0}).to_toml())
    m = tmp_path / "m.parquet"
    assert main(["map", "--scenario", str(f), "--condition", "no-control", "--x", "layer.client.timeout_s=2,4",
                 "--y", "pulse=1.5,2.7", "--seeds", "2", "--workers", "1", "--quiet", "--out", str(m)]) == 0
    rows = pq.read_table(str(m)).to_pylist()
    assert [(r["x"], r["y"]) for r in rows] == [(2.0, 1.5), (4.0, 1.5), (2.0, 2.7), (4.0, 2.7)]
    assert {r["x_name"] for r in rows} == {"layer.client.timeout_s"}
    s = tmp_path / "s.parquet"
    assert main(["sweep", "--scenario", str(f), "--conditions", "no-control", "--seeds", "0-1", "--workers", "1",
                 "--quiet", "--out", str(s)]) == 0
    srows = pq.read_table(str(s)).to_pylist()
    assert len(srows) == 2 and {r["scenario_hash"] for r in srows} == {from_document(
        {**TINY, "layer": [{"preset": "openai-python", "timeout_s": 2.0}]}, "tiny.toml").content_hash}
