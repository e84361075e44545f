"""Helpers of the kill -9 drills (tests/test_drills_*.py): the CLI run in a
subprocess with hooks into the results store, and a results table compared
cell by cell."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from sim.experiments.sweep import cell_key, read_rows

_DIE_IN_REWRITE = textwrap.dedent("""
    import os, signal
    import pyarrow.parquet as pq
    from sim.experiments import sweep as S
    real = pq.write_table
    def write_half_then_die(table, where, **kw):
        real(table, where, **kw)
        with open(where, "r+b") as f:
            f.truncate(os.path.getsize(where) // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    S.pq.write_table = write_half_then_die
""")
_LOG_ADDED = textwrap.dedent("""
    import json, os
    from sim.experiments import sweep as S
    real_add = S.ParquetStore.add
    def add_and_log(self, row):
        real_add(self, row)
        with open(os.environ["DRILL_ADDED"], "a") as f:
            f.write(json.dumps(list(S.cell_key(row))) + "\\n")
    S.ParquetStore.add = add_and_log
""")
_MAIN = textwrap.dedent("""
    import sys
    from llmsim.cli import main
    sys.exit(main(sys.argv[1:]))
""")
# `python -c KILL_IN_REWRITE llmsim-args...`: the command, SIGKILLed halfway through writing its first Parquet temp file
KILL_IN_REWRITE = _DIE_IN_REWRITE + _MAIN


def cli_script(die_in_rewrite: bool = False, log_added: bool = False) -> str:
    """A `python -c` script running the llmsim command line given as its arguments;
    die_in_rewrite: as KILL_IN_REWRITE; log_added: every row the results store
    records (it is in the journal) is appended, as its cell key in JSON, to the
    file named by $DRILL_ADDED."""
    return (_DIE_IN_REWRITE if die_in_rewrite else "") + (_LOG_ADDED if log_added else "") + _MAIN


def added_keys(path) -> list[tuple]:
    """The cell keys a cli_script(log_added=True) run logged, in order (none if no file)."""
    try:
        with open(path) as f:
            return [tuple(json.loads(line)) for line in f if line.endswith("\n")]
    except FileNotFoundError:
        return []


def rows_by_cell(path) -> dict:
    """The results at path (Parquet file and journal) by cell key, without wall_s
    (the simulator's own wall time differs from run to run)."""
    out = {}
    for r in read_rows(str(path)):
        r = dict(r)
        r.pop("wall_s")
        out[cell_key(r)] = r
    return out


def kill_and_resume(cmd: list[str], out, tmp_path, kills: int, seed: int, within_s: float,
                    timeout_s: float = 600.0) -> tuple[str, int]:
    """Run `llmsim *cmd` (results at `out`) in subprocesses until it finishes: the
    first run dies inside its first Parquet rewrite, the next `kills` runs are
    SIGKILLed at a random moment within `within_s` seconds after they record a
    new row, the last runs to the end. Asserts that no run records a cell that
    was stored before it started and that no cell is recorded twice. Returns the
    finished run's stdout and the number of kills survived."""
    root = Path(__file__).resolve().parent.parent
    log = tmp_path / "added.jsonl"
    env = {**os.environ, "DRILL_ADDED": str(log)}
    rng = random.Random(seed)
    survived, runs = 0, 0
    while True:
        runs += 1
        assert runs <= kills + 4, f"{cmd[0]} never finished"
        before, n0 = set(rows_by_cell(out)), len(added_keys(log))
        so, se = tmp_path / f"run{runs}.out", tmp_path / f"run{runs}.err"
        with open(so, "w") as fo, open(se, "w") as fe:
            p = subprocess.Popen([sys.executable, "-c", cli_script(runs == 1, True), *cmd], cwd=root, env=env,
                                 stdout=fo, stderr=fe)
            killed = False
            if 1 < runs <= kills + 1:
                t_end = time.monotonic() + timeout_s
                while p.poll() is None and len(added_keys(log)) == n0 and time.monotonic() < t_end:
                    time.sleep(0.05)
                time.sleep(rng.uniform(0.0, within_s))
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
                    killed = True
            p.wait(timeout=timeout_s)
        new = added_keys(log)[n0:]
        assert not set(new) & before, f"run {runs} ran cells already stored: {sorted(set(new) & before)}"
        if runs == 1:
            assert p.returncode == -signal.SIGKILL and new, se.read_text()[-2000:]
            survived += 1
            continue
        if killed and p.returncode == -signal.SIGKILL:
            survived += 1
            continue
        assert p.returncode == 0, se.read_text()[-2000:]
        break
    added = added_keys(log)
    assert len(added) == len(set(added)), "a finished cell ran twice"
    assert not list(Path(out).parent.glob(Path(out).name + ".tmp-*"))
    return so.read_text(), survived
