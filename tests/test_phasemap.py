"""The phase map's grid parsing, backlog line and output files."""
import dataclasses

import numpy as np
import pyarrow.parquet as pq
import pytest

from sim.conditions import CONDITIONS
from sim.experiments import phasemap as P
from sim.profile import load_profile
from sim.scenario import PAPER, get_scenario


def test_parse_range():
    assert P.parse_range("pulse=1:3:5") == ("pulse", [1.0, 1.5, 2.0, 2.5, 3.0])
    assert P.parse_range("speed=0.5,2") == ("speed", [0.5, 2.0])
    for bad in ("pulse", "warp=1:2:3", "pulse=1:2", "pulse=1:2:0", "kv=0,1", "hold_load=a,b"):
        with pytest.raises(ValueError):
            P.parse_range(bad)


def test_backlog_line_is_where_the_pulse_backlog_is_one_deadline():
    # the reference: (p - 1) x 107 s = 120 s at p = 1 + 120/107
    z = P.backlog_excess(PAPER, ("pulse", "hold_load"), np.array([1 + 120 / 107, 2.7]), np.array([0.6, 0.6]))
    assert z[0] == pytest.approx(0.0, abs=1e-9) and z[1] == pytest.approx(1.7 * 107 - 120)
    z = P.backlog_excess(PAPER, ("hold_load", "deadline_s"), np.array([0.5]), np.array([1.7 * 107]))
    assert z[0] == pytest.approx(0.0, abs=1e-9)


def test_phase_map_writes_rows_and_a_png(tmp_path):
    ns = get_scenario("cpu-tiny")
    prof = dataclasses.replace(load_profile("vllm-cpu-tiny"), capacity=4.0)
    rows = P.phase_map(prof, ns.scenario, ns.condition(CONDITIONS["no-retry"]), ("pulse", [1.0, 4.0]),
                       ("hold_load", [0.3, 0.95]), range(2))
    assert [(r["x"], r["y"]) for r in rows] == [(1.0, 0.3), (4.0, 0.3), (1.0, 0.95), (4.0, 0.95)]
    assert rows[0]["p"] == 1.0 and rows[-1]["p"] == 0.0          # light burst and load vs heavy burst and load
    P.write_table(rows, str(tmp_path / "map.parquet"))
    assert pq.read_table(str(tmp_path / "map.parquet")).num_rows == 4
    assert P.plot(rows, ns.scenario, str(tmp_path / "map.png"))
    assert (tmp_path / "map.png").stat().st_size > 0
