"""Drills: `llmsim advise` and `llmsim paper` survive kill -9. Each command
runs in a subprocess, dies once inside its first Parquet rewrite and is
SIGKILLed at random moments after it has recorded rows, and is rerun until it
finishes; its final results table must equal an uninterrupted run's, what it
prints (advise's ranking, paper's report) must be the same, and no cell that
had finished may run again (tests/drills.py)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from drills import kill_and_resume, rows_by_cell
from sim.experiments.paper import paper
from sim.experiments.sweep import grid, read_rows, sweep

ROOT = Path(__file__).resolve().parent.parent


def scenario_file(tmp_path) -> str:
    """cpu-tiny on the tiny CPU engine's profile with Ĉ 4 calls/s (tests/test_advise.py's deployment)."""
    toml = subprocess.run([sys.executable, "-m", "llmsim", "scenario", "show", "cpu-tiny"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    line = 'profile = "vllm-cpu-tiny"\n'
    assert line in toml
    path = tmp_path / "tiny.toml"
    path.write_text(toml.replace(line, line + "capacity = 4.0\n", 1))
    return str(path)


def without_wall(res: dict) -> dict:
    return {k: v for k, v in res.items() if k != "wall_s"}


def test_advise_killed_with_sigkill_resumes_to_the_same_table_and_ranking(tmp_path):
    args = ["advise", "--scenario", scenario_file(tmp_path), "--seeds", "3", "--screen", "1", "--finalists", "3",
            "--only", "proxy", "--margin-axes", "none", "--workers", "1"]
    ref, ref_json = tmp_path / "ref.parquet", tmp_path / "ref.json"
    r = subprocess.run([sys.executable, "-m", "llmsim", *args, "--out", str(ref), "--json", str(ref_json)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out, out_json = tmp_path / "out.parquet", tmp_path / "out.json"
    stdout, kills = kill_and_resume(args + ["--out", str(out), "--json", str(out_json)], out, tmp_path, kills=3,
                                    seed=17, within_s=1.0)
    print(f"advise: kills survived {kills} (one inside the Parquet rewrite)")
    assert kills >= 3
    ref_rows = rows_by_cell(ref)
    assert len(read_rows(str(out))) == len(ref_rows) > 200
    assert rows_by_cell(out) == ref_rows

    def ranking(text):
        return text.rsplit("\n(", 1)[0]             # all but the closing "(N s)" line

    assert ranking(stdout) == ranking(r.stdout) and "1. " in stdout
    assert without_wall(json.loads(out_json.read_text())) == without_wall(json.loads(ref_json.read_text()))


def test_paper_killed_with_sigkill_resumes_to_the_same_table_and_report(tmp_path):
    ref = tmp_path / "ref"
    paper(str(ref), seeds=1, workers=1, progress=False)
    out = tmp_path / "out"
    stdout, kills = kill_and_resume(["paper", "--seeds", "1", "--workers", "1", "--out", str(out)],
                                    out / "results.parquet", tmp_path, kills=2, seed=17, within_s=3.0)
    print(f"paper: kills survived {kills} (one inside the Parquet rewrite)")
    assert kills >= 3
    ref_rows = rows_by_cell(ref / "results.parquet")
    assert len(read_rows(str(out / "results.parquet"))) == len(ref_rows) == 99
    assert rows_by_cell(out / "results.parquet") == ref_rows
    assert "paper: 99 cells, " in stdout
    assert (out / "report.md").read_text() == (ref / "report.md").read_text()
    assert not (out / "results.parquet.journal").exists()


def test_a_column_only_later_rows_have_survives_the_journal_and_the_rewrite(tmp_path):
    # the paper's mixed cells alone carry scenario_mixed_share, and a resumed run's journal may begin
    # with a cell without it
    out = tmp_path / "res.parquet"
    cell = {"model": "m", "condition": "c", "pulse": 2.0, "max_batched_tokens": 1, "mixed_prompts": False}
    rows = [{**cell, "seed": 0}, {**cell, "seed": 1, "mixed_prompts": True, "later": 0.5}]
    Path(str(out) + ".journal").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r["later"] for r in read_rows(str(out))] == [None, 0.5]
    sweep(grid(["vllm-cpu-tiny"], ["no-retry"], [2.0], [0]), str(out), workers=1, progress=False)
    got = {(r["model"], r["seed"]): r["later"] for r in pq.read_table(out).to_pylist()}
    assert got == {("m", 0): None, ("m", 1): 0.5, ("vllm-cpu-tiny", 0): None}


def test_a_scenario_row_in_both_the_parquet_file_and_the_journal_is_read_once(tmp_path):
    # a kill between the rewrite's rename and the journal's truncation leaves the journal's rows in both
    out = tmp_path / "res.parquet"
    rows = [{"model": "m", "condition": "c", "pulse": 2.0, "max_batched_tokens": 1, "mixed_prompts": False,
             "seed": s, "scenario_hash": "h", "x": float(s)} for s in (0, 1)]
    pq.write_table(pa.Table.from_pylist(rows), out)
    Path(str(out) + ".journal").write_text(json.dumps(rows[1]) + "\n")
    assert [r["seed"] for r in read_rows(str(out))] == [0, 1]
