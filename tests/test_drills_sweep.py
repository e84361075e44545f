"""Drills: sweeps survive kill -9, and a results file that cannot be read is
reported, never overwritten. `llmsim sweep` runs in a subprocess on a small
grid (the qwen2.5-7b profile, one condition, eight seeds: under a second a cell) and
is SIGKILLed mid-run again and again (once inside the Parquet rewrite), then
rerun until it finishes; the final table must equal an uninterrupted run's and
no cell that had finished may run again."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from drills import KILL_IN_REWRITE, rows_by_cell
from llmsim.cli import main
from sim.experiments.sweep import ResultsFileError, grid, read_rows, sweep
from validate.engine import children

ROOT = Path(__file__).resolve().parent.parent
SEEDS = "0-7"
ARGS = ["sweep", "--models", "qwen2.5-7b", "--conditions", "no-retry", "--pulses", "2", "--seeds", SEEDS,
        "--workers", "1"]
DONE = re.compile(r"^\[\d+/\d+\] qwen2.5-7b no-retry pulse 2 seed (\d+) ", re.M)


def finished_seeds(text: str) -> list[int]:
    return [int(s) for s in DONE.findall(text)]


def test_sweep_killed_with_sigkill_resumes_to_the_same_table_without_rerunning_finished_cells(tmp_path):
    ref = tmp_path / "ref.parquet"
    sweep(grid(["qwen2.5-7b"], ["no-retry"], [2.0], range(8)), str(ref), workers=1, progress=False)
    out = tmp_path / "out.parquet"
    cmd = ARGS + ["--out", str(out)]
    finished: list[int] = []
    # 1: killed inside its first Parquet rewrite (the journal already holds the finished cell)
    r = subprocess.run([sys.executable, "-c", KILL_IN_REWRITE, *cmd], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == -signal.SIGKILL
    finished += finished_seeds(r.stderr)
    assert finished and not out.exists() and list(tmp_path.glob("out.parquet.tmp-*"))
    # 2: killed at random moments, each after at least one more cell finished; then left to finish
    rng = random.Random(17)
    kills, runs = 1, 0
    while True:
        runs += 1
        assert runs <= 12, "the sweep never finished"
        log = tmp_path / f"run{runs}.err"
        with open(log, "w") as err:
            p = subprocess.Popen([sys.executable, "-m", "llmsim", *cmd], cwd=ROOT, stdout=subprocess.DEVNULL,
                                 stderr=err)
            killed = False
            if runs <= 4:
                t_end = time.monotonic() + 300
                while p.poll() is None and not finished_seeds(log.read_text()) and time.monotonic() < t_end:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, 0.3))
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    killed = True
            p.wait(timeout=600)
        finished += finished_seeds(log.read_text())
        if killed and p.returncode == -signal.SIGKILL:
            kills += 1
            continue
        assert p.returncode == 0, log.read_text()[-2000:]
        break
    print(f"kills survived: {kills} (one inside the Parquet rewrite); runs {runs + 1}")
    assert kills >= 3
    assert sorted(finished) == list(range(8)), f"cells finished (a repeat means one ran twice): {finished}"
    assert rows_by_cell(out) == rows_by_cell(ref)
    assert not list(tmp_path.glob("out.parquet.tmp-*")) and not Path(str(out) + ".journal").exists()


def one_line_error(capsys, *needles):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert n in err, err
    return err


@pytest.mark.parametrize("damage", ["truncated", "junk", "empty"])
def test_a_corrupt_results_file_is_reported_and_never_overwritten(tmp_path, capsys, damage):
    out = tmp_path / "res.parquet"
    sweep(grid(["vllm-cpu-tiny"], ["no-retry"], [2.0], [0]), str(out), workers=1, progress=False)
    data = out.read_bytes()
    bad = {"truncated": data[:len(data) // 2], "junk": b"\x00\xffnot parquet" * 50, "empty": b""}[damage]
    out.write_bytes(bad)
    assert main(ARGS + ["--out", str(out)]) == 2
    one_line_error(capsys, str(out), "not a readable results file", "move it aside")
    assert out.read_bytes() == bad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["res.parquet"]
    with pytest.raises(ResultsFileError):
        read_rows(str(out))                                  # `llmsim paper --report-only` reads the same way


def test_a_corrupt_journal_line_is_reported_and_a_cut_off_last_row_is_dropped(tmp_path, capsys):
    out = tmp_path / "res.parquet"
    journal = Path(str(out) + ".journal")
    journal.write_text('{"model": "vllm-cpu-tiny"\n{"also": "junk"}\n')
    assert main(ARGS + ["--out", str(out)]) == 2
    one_line_error(capsys, str(journal), "line 1", "move it aside")
    assert not out.exists() and journal.read_text().startswith('{"model"')
    # a last row without its newline: the cell a kill interrupted; dropped, the sweep runs it
    journal.write_text('{"model": "vllm-cpu-tiny", "condition": "no-re')
    assert main(["sweep", "--models", "vllm-cpu-tiny", "--conditions", "no-retry", "--pulses", "2", "--seeds", "0",
                 "--workers", "1", "--quiet", "--out", str(out)]) == 0
    assert len(read_rows(str(out))) == 1 and not journal.exists()


def test_two_sweeps_never_write_one_file_at_once(tmp_path):
    import fcntl
    out = tmp_path / "res.parquet"
    with open(str(out) + ".journal", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ResultsFileError, match="another sweep is writing"):
            sweep(grid(["vllm-cpu-tiny"], ["no-retry"], [2.0], [0]), str(out), workers=1, progress=False)


def test_a_sweep_killed_with_sigkill_leaves_no_worker_behind(tmp_path):
    out = tmp_path / "out.parquet"
    err = tmp_path / "err"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "llmsim", *ARGS[:-2], "--workers", "2", "--out", str(out)],
                             cwd=ROOT, stdout=subprocess.DEVNULL, stderr=f)
    t_end = time.monotonic() + 300
    while not finished_seeds(err.read_text()) and p.poll() is None and time.monotonic() < t_end:
        time.sleep(0.05)
    workers = children(p.pid)
    assert p.poll() is None and len(workers) >= 2, err.read_text()
    p.send_signal(signal.SIGKILL)
    p.wait()
    t_end = time.monotonic() + 30                     # a bound for a slow machine, not a timing check
    while any(Path(f"/proc/{w}").exists() for w in workers) and time.monotonic() < t_end:
        time.sleep(0.1)
    left = [w for w in workers if Path(f"/proc/{w}").exists()]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, "pool workers outlived the killed sweep"
