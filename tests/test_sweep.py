"""llmsim sweep: the grid, the Parquet file, resuming, equality with run_one,
and the Ray executor against local processes."""
from __future__ import annotations

import math

import pytest

from llmsim.cli import main
from sim.experiments import sweep as sw
from sim.profile import load_profile
from sim.run import run_one

MODEL = "qwen2.5-7b"
CONDS = ("cancel", "no-control")
PULSE = 1.5


def _grid(seeds=(0, 1)):
    return sw.grid([MODEL], CONDS, [PULSE], seeds)


def _by_key(rows):
    return {sw.cell_key(r): r for r in rows}


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("sweep") / "local.parquet")
    res = sw.sweep(_grid(), out, workers=2, progress=False)
    return out, res


def test_small_sweep_writes_the_expected_cells(local):
    out, res = local
    assert res == {**res, "total": 4, "skipped": 0, "ran": 4}
    rows = sw.read_rows(out)
    want = sorted((MODEL, c, PULSE, s, 8192, False) for c in CONDS for s in (0, 1))
    assert sw.cells_of(rows) == want
    r = rows[0]
    for col in ("hold_delivered", "pulse_offered", "primary_within_deadline", "rates_xC_created",
                "recovery_time_s", "series_waiting", "series_delivered_per_60s", "wall_s"):
        assert col in r
    assert all(r["hold_offered"] > 0 for r in rows)
    assert isinstance(r["series_waiting"], list) and len(r["series_waiting"]) > 900


def test_rerun_skips_finished_cells(local):
    out, _ = local
    seen = []
    res = sw.sweep(_grid(), out, workers=2, progress=lambda row, n: seen.append(row))
    assert (res["ran"], res["skipped"], seen) == (0, 4, [])
    assert len(sw.read_rows(out)) == 4


def test_interrupted_sweep_runs_only_the_missing_cells(tmp_path):
    out = str(tmp_path / "r.parquet")
    first = sw.sweep(_grid(seeds=(0,)), out, workers=1, progress=False)      # a sweep stopped half-way
    assert first["ran"] == 2
    ran = []
    res = sw.sweep(_grid(), out, workers=1, progress=lambda row, n: ran.append(sw.cell_key(row)))
    assert res["skipped"] == 2 and res["ran"] == 2
    assert sorted(ran) == sorted((MODEL, c, PULSE, 1, 8192, False) for c in CONDS)
    assert len(sw.read_rows(out)) == 4


def test_ctrl_c_keeps_the_finished_cells(tmp_path):
    out = str(tmp_path / "r.parquet")

    def stop(row, n):
        if n == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        sw.sweep(_grid(seeds=(0,)), out, workers=1, progress=stop)
    assert len(sw.read_rows(out)) == 1
    res = sw.sweep(_grid(seeds=(0,)), out, workers=1, progress=False)
    assert (res["skipped"], res["ran"]) == (1, 1)


def _same(a: dict, b: dict, skip=("wall_s",)) -> list[str]:
    """Columns where two rows differ (NaN equals NaN)."""
    bad = []
    for k in sorted(set(a) | set(b)):
        if k in skip:
            continue
        x, y = a.get(k), b.get(k)
        if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
            continue
        if x != y:
            bad.append(k)
    return bad


def test_rows_equal_run_one(local):
    out, _ = local
    rows = _by_key(sw.read_rows(out))
    prof = load_profile(MODEL)
    for cond in CONDS:
        ref = sw.flatten(run_one(prof, cond, PULSE, 1))
        row = rows[(MODEL, cond, PULSE, 1, 8192, False)]
        assert _same(row, ref) == []
        assert row["hold_delivered"] == ref["hold_delivered"]


def test_cli_sweep(tmp_path, capsys):
    out = str(tmp_path / "c.parquet")
    args = ["sweep", "--conditions", "cancel", "--pulses", "1.5", "--seeds", "0", "--out", out, "--workers", "1",
            "--quiet"]
    assert main(args) == 0
    assert main(args) == 0
    assert "1 already in" in capsys.readouterr().out
    assert len(sw.read_rows(out)) == 1
    assert main(["sweep", "--conditions", "nope", "--out", out]) == 2
    assert main(["sweep", "--conditions", "cancel", "--seeds", "4-1", "--out", out]) == 2
    assert main(["sweep", "--conditions", "cancel", "--out", str(tmp_path / "no" / "x.parquet")]) == 2


def test_ray_gives_the_same_table_as_local_processes(local, tmp_path):
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'llmsim[ray]')")
    out, _ = local
    ray_out = str(tmp_path / "ray.parquet")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        res = sw.sweep(_grid(), ray_out, ray_address="auto", progress=False)
    finally:
        ray.shutdown()
    assert res["ran"] == 4
    a, b = _by_key(sw.read_rows(out)), _by_key(sw.read_rows(ray_out))
    assert sorted(a) == sorted(b)
    for k in a:
        assert _same(a[k], b[k]) == [], k
