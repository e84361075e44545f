"""Sweeps: a grid of runs (models x conditions x pulses x seeds x step budgets
[x mixed prompts]) executed on local processes or a Ray cluster, with the
results kept in ONE Parquet file that grows as cells finish.

Cell identity is (model, condition, pulse, seed, max_batched_tokens,
mixed_prompts); `max_batched_tokens` is resolved to the profile's value when
not given, `model` is the profile's name. All conditions of one (model, pulse,
seed, budget, mixed) group run on the same trace: the trace is a pure function
of (capacity, scenario, seed, mixed) and each worker caches it per group, and
the cells are handed out group by group.

Table layout (one row per cell): the result record (docs/model.md) flattened with `_` between
keys, the `cohorts.` prefix dropped (cohorts.hold.delivered -> hold_delivered,
rates_xC.created -> rates_xC_created, condition_settings.cancellation ->
condition_settings_cancellation, ...). Arrays stay in the row as list columns:
the 1 s time series `series_t`, `series_waiting`, `series_running`,
`series_proxy_queue`, the per-60 s `series_delivered_per_60s`, and the hold
windows `windows_*`.

Resuming and kill -9: a cell is finished once its row is appended (one JSON
line, flushed to the OS) to the journal `OUT.journal`, before its progress line
is printed. The Parquet file is rewritten whole (temp file + os.replace, so it
is never half-written) from its rows and the journal's, after which the journal
is emptied; the rewrite runs after finished cells at most as often as keeps it
under ~3% of the sweep's time (the sweep's process shares the cores with its
workers), and always when the sweep stops (finished,
error or Ctrl-C). At start the Parquet file's cells and the journal's are read
and skipped, so a sweep killed at any point (even during the rewrite) and run
again runs no finished cell twice and ends with the same table; a row cut off
mid-line by the kill is the one cell not yet finished and is dropped. A
results file or journal that cannot be read (truncated, corrupt, a directory)
stops the sweep with `ResultsFileError` naming it and what to do; it is never
overwritten. One sweep at a time writes a file (a lock on the journal).
"""
from __future__ import annotations

import dataclasses
import fcntl
import functools
import glob
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

from ..conditions import get_condition
from ..deployment import load as load_deployment
from ..profile import load_profile
from ..run import run_one, workload_capacity
from ..scenario import PAPER
from ..workload import make_trace

KEY = ("model", "condition", "pulse", "seed", "max_batched_tokens", "mixed_prompts")
GROUP = ("model", "pulse", "seed", "max_batched_tokens", "mixed_prompts")


@dataclass(frozen=True, order=True)
class Cell:
    model: str                  # profile name (the identity)
    pulse: float
    seed: int
    max_batched_tokens: int
    mixed_prompts: bool
    condition: str
    source: str = ""            # how to load the profile (name or path); not part of the identity
    scenario: str = ""          # a scenario file or name (`sim.deployment`); not part of the identity
    scenario_hash: str = ""     # its resolved deployment's content hash (identity; "" for the reference design)

    @property
    def key(self) -> tuple:
        k = tuple(getattr(self, k) for k in KEY)
        return k + (self.scenario_hash,) if self.scenario_hash else k


def cell_key(row: dict) -> tuple:
    """The identity of a table row or record (a scenario's rows add its content hash)."""
    k = (str(row["model"]), str(row["condition"]), float(row["pulse"]), int(row["seed"]),
         int(row["max_batched_tokens"]), bool(row["mixed_prompts"]))
    h = row.get("scenario_hash")
    return k + (str(h),) if h else k


# ------------------------------------------------------------------ the grid
def parse_seeds(spec: str) -> list[int]:
    """`0-4`, `0,2,7` or a mix (`0-2,9`)."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            lo, hi = int(a), int(b)
            if hi < lo:
                raise ValueError(f"seed range {part!r} runs backwards")
            out.extend(range(lo, hi + 1))
        else:
            out.append(int(part))
    if not out or any(s < 0 for s in out):
        raise ValueError(f"expected seeds like 0-4 or 0,1,2 (non-negative), got {spec!r}")
    return sorted(set(out))


def grid(models: Sequence[str | None], conditions: Sequence[str], pulses: Sequence[float | None],
         seeds: Iterable[int], max_batched_tokens: Sequence[int | None] = (None,),
         mixed_prompts: Sequence[bool] = (False,), scenario: str | None = None) -> list[Cell]:
    """The cells of the grid, grouped so that a group's conditions are adjacent.
    With `scenario` (a file or name) each cell runs that deployment with the
    given model, pulse (the burst's load), step budget and mixed prompts
    applied where not None/False."""
    for c in conditions:
        get_condition(c)                                    # ValueError on an unknown name
    if scenario is not None:
        return _dedup(_scenario_cells(scenario, models, conditions, pulses, list(seeds), max_batched_tokens,
                                      mixed_prompts))
    cells = []
    for spec in models:
        prof = load_profile(spec)
        default_mbt = int(prof.engine["max_num_batched_tokens"])
        for pulse in pulses:
            for seed in seeds:
                for mbt in max_batched_tokens:
                    for mixed in mixed_prompts:
                        for c in conditions:
                            cells.append(Cell(prof.name, float(pulse), int(seed),
                                              int(mbt) if mbt else default_mbt, bool(mixed), c, spec))
    return _dedup(cells)


def _scenario_cells(scenario, models, conditions, pulses, seeds, max_batched_tokens, mixed_prompts) -> list[Cell]:
    cells = []
    for spec in models:
        for pulse in pulses:
            for mbt in max_batched_tokens:
                for mixed in mixed_prompts:
                    dep = _deployment(scenario, spec, pulse, mbt, mixed)
                    dep.require_burst()
                    p = dep.run_pulse
                    for seed in seeds:
                        for c in conditions:
                            cells.append(Cell(dep.profile.name, float(p) if p is not None else 0.0, int(seed),
                                              int(dep.profile.engine["max_num_batched_tokens"]), bool(mixed), c,
                                              spec or "", scenario, dep.content_hash))
    return cells


@functools.lru_cache(maxsize=16)
def _deployment(scenario: str, model: str | None, pulse: float | None, mbt: int | None, mixed: bool):
    return load_deployment(scenario).with_changes(model=model or None, pulse=pulse, max_batched_tokens=mbt,
                                                  mixed_prompts=mixed)


def _dedup(cells: list[Cell]) -> list[Cell]:
    seen, out = set(), []
    for c in cells:                                         # repeated inputs give one cell
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


# ------------------------------------------------------------------ one cell
@functools.lru_cache(maxsize=8)
def _profile(source: str):
    return load_profile(source)


@functools.lru_cache(maxsize=16)
def _trace(source: str, pulse: float, seed: int, mixed: bool):
    sc = PAPER.with_(pulse=pulse, mixed_share=0.5 if mixed else None)
    return make_trace(workload_capacity(_profile(source), sc)["capacity"], sc, seed)


@functools.lru_cache(maxsize=16)
def _scenario_trace(cell: Cell):
    return _cell_deployment(cell).trace(cell.seed)


def _cell_deployment(cell: Cell):
    return _deployment(cell.scenario, cell.source or None, cell.pulse if cell.pulse else None,
                       cell.max_batched_tokens, cell.mixed_prompts)


def run_cell(cell: Cell) -> dict:
    """Run one cell (sharing its group's trace) and return its flattened row."""
    if cell.scenario:
        dep = _cell_deployment(cell)
        rec = dep.run(cell.seed, cell.condition,
                      trace=_scenario_trace(dataclasses.replace(cell, condition="")))
        row = flatten(rec)
        row.update(pulse=cell.pulse, scenario_name=dep.name, scenario_hash=dep.content_hash)
        return row
    prof = _profile(cell.source or cell.model)
    rec = run_one(prof, cell.condition, cell.pulse, cell.seed, cell.max_batched_tokens, cell.mixed_prompts,
                  trace=_trace(cell.source or cell.model, cell.pulse, cell.seed, cell.mixed_prompts))
    return flatten(rec)


def flatten(rec: dict) -> dict:
    """A result record as one flat row (see the module docstring)."""
    row: dict = {}

    def walk(prefix: str, v) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}_{k}" if prefix else str(k), x)
        elif isinstance(v, tuple):
            row[prefix] = list(v)
        else:
            row[prefix] = v
    for k, v in rec.items():
        walk("" if k == "cohorts" else k, v)
    return row


# ------------------------------------------------------------------ storage
class ResultsFileError(ValueError):
    """A results file or its journal cannot be read; it is left as it is."""


def _journal_path(path: str) -> str:
    return path + ".journal"


def _read_parquet(path: str):
    if not os.path.exists(path):
        return None
    if os.path.isdir(path):
        raise ResultsFileError(f"{path} is a directory, not a results file; give another path")
    try:
        t = pq.read_table(path)
        t.select(list(KEY))
    except (pa.ArrowException, OSError, KeyError) as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ResultsFileError(f"{path} is not a readable results file ({why}); it was left untouched: move it "
                               "aside to start afresh, or give another path") from None
    return t


def _read_journal(path: str, repair: bool = False) -> list[dict]:
    """The journal's rows. A last line without its newline is a row cut off by
    a kill (that cell did not finish): dropped, and with `repair` cut from the
    file; any other unreadable line is a ResultsFileError."""
    jp = _journal_path(path)
    if not os.path.exists(jp):
        return []
    if os.path.isdir(jp):
        raise ResultsFileError(f"{jp} is a directory, not a sweep journal; move it aside")
    with open(jp, "rb") as f:
        data = f.read()
    end = data.rfind(b"\n") + 1
    if repair and end < len(data):
        with open(jp, "r+b") as f:
            f.truncate(end)
    rows = []
    for n, line in enumerate(data[:end].splitlines(), 1):
        try:
            row = json.loads(line)
            cell_key(row)
        except (ValueError, KeyError, TypeError):
            raise ResultsFileError(f"{jp}: line {n} is not a result row (the journal is corrupt); move it aside "
                                   f"to drop its cells (they run again), then rerun") from None
        rows.append(row)
    return rows


def read_table(path: str):
    """The results as a pyarrow Table: the Parquet file's rows and any journal
    rows not yet in it (None if there are none). ResultsFileError if either
    cannot be read."""
    t = _read_parquet(path)
    done = set() if t is None else {cell_key(r) for r in t.select(_key_columns(t)).to_pylist()}
    extra = [r for r in _read_journal(path) if cell_key(r) not in done]
    if not extra:
        return t
    new = _table(extra)
    return new if t is None else pa.concat_tables([t, new], promote_options="permissive")


def _key_columns(t) -> list[str]:
    """The columns of a table that `cell_key` reads."""
    return list(KEY) + (["scenario_hash"] if "scenario_hash" in t.column_names else [])


def _table(rows: Sequence[dict]):
    """The rows as a pyarrow Table with a column for every key of any row (a
    row without it holds null there), in the order the keys first appear;
    pa.Table.from_pylist keeps only the first row's keys."""
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys})


def read_rows(path: str) -> list[dict]:
    t = read_table(path)
    return [] if t is None else t.to_pylist()


def _plain(v):
    """JSON for the numpy scalars and arrays a row may hold."""
    if hasattr(v, "tolist"):
        return v.tolist()
    raise TypeError(f"cannot store {type(v).__name__} in a result row")


class ParquetStore:
    """The rows of one Parquet file and its journal (see the module docstring)."""

    def __init__(self, path: str):
        self.pa = pa
        self.path = path
        jp = _journal_path(path)
        t = _read_parquet(path)
        self._journal = open(jp, "a")
        try:
            fcntl.flock(self._journal, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._journal.close()
            raise ResultsFileError(f"another sweep is writing {path} (its journal {jp} is locked); wait for "
                                   "it or give another path") from None
        for tmp in glob.glob(glob.escape(path) + ".tmp-*"):    # a rewrite cut off by a kill
            pid = tmp.rsplit("-", 1)[-1]
            if pid.isdigit() and not _pid_alive(int(pid)):
                os.unlink(tmp)
        self.tables = []
        self.done: set[tuple] = set()
        if t is not None and t.num_rows:
            self.tables.append(t)
            self.done = {cell_key(r) for r in t.select(_key_columns(t)).to_pylist()}
        self.pending: list[dict] = [r for r in _read_journal(path, repair=True) if cell_key(r) not in self.done]
        self.done |= {cell_key(r) for r in self.pending}
        self.write_s = 0.0
        self.last_flush = time.monotonic()

    def add(self, row: dict) -> None:
        """Record a finished cell: its row is in the journal when this returns."""
        line = json.dumps(row, default=_plain)
        self._journal.write(line + "\n")
        self._journal.flush()
        self.pending.append(row)
        self.done.add(cell_key(row))

    def due(self) -> bool:
        return bool(self.pending) and time.monotonic() - self.last_flush >= 30.0 * self.write_s

    def flush(self) -> None:
        if not self.pending:
            return
        t0 = time.perf_counter()
        new = _table(self.pending)
        table = self.pa.concat_tables(self.tables + [new], promote_options="permissive") if self.tables else new
        tmp = f"{self.path}.tmp-{os.getpid()}"
        pq.write_table(table, tmp)
        os.replace(tmp, self.path)
        self._journal.seek(0)
        self._journal.truncate()
        self.tables = [table]
        self.pending = []
        self.write_s = time.perf_counter() - t0
        self.last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._journal.close()
        if os.path.exists(self.path) and os.path.getsize(_journal_path(self.path)) == 0:
            os.unlink(_journal_path(self.path))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ------------------------------------------------------------------ executors
def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """In a pool worker: exit when the sweep that started it is gone (even
    killed by SIGKILL), instead of lingering with its memory."""
    def watch():
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def run_local(cells: list, workers: int, fn: Callable = None) -> Iterator[dict]:
    """fn(cell) for each cell (default run_cell) on `workers` local processes, yielded as they finish."""
    fn = fn or run_cell
    if workers <= 1:
        for c in cells:
            yield fn(c)
        return
    ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_exit_with_parent,
                             initargs=(os.getpid(),)) as ex:
        todo = iter(cells)
        live = set()
        try:
            # keep a couple of cells per worker in flight so they run in grid (group) order
            for c in todo:
                live.add(ex.submit(fn, c))
                if len(live) >= 2 * workers:
                    break
            while live:
                done, live = wait(live, return_when=FIRST_COMPLETED)
                for f in done:
                    yield f.result()
                    nxt = next(todo, None)
                    if nxt is not None:
                        live.add(ex.submit(fn, nxt))
        finally:
            for f in live:
                f.cancel()


def run_ray(cells: list, address: str | None, fn: Callable = None) -> Iterator[dict]:
    """fn(cell) for each cell (default run_cell) as Ray tasks, yielded as they finish."""
    try:
        import ray  # optional dependency (llmsim[ray]), loaded only for --ray
    except ImportError:
        raise RuntimeError("the Ray executor needs ray: pip install 'llmsim[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=None if address in (None, "", "local") else address, log_to_driver=False)
    remote = ray.remote(num_cpus=1)(fn or run_cell)
    refs = [remote.remote(c) for c in cells]
    try:
        while refs:
            done, refs = ray.wait(refs, num_returns=1)
            for r in done:
                yield ray.get(r)
    finally:
        for r in refs:
            ray.cancel(r)


def _progress_line(total: int) -> Callable[[dict, int], None]:
    t0 = time.perf_counter()

    def show(row: dict, n: int) -> None:
        el = time.perf_counter() - t0
        eta = el / n * (total - n)
        print(f"[{n}/{total}] {row['model']} {row['condition']} pulse {row['pulse']:g} seed {row['seed']} "
              f"mbt {row['max_batched_tokens']}{' mixed' if row['mixed_prompts'] else ''}: "
              f"{row['wall_s']:.2f} s  (elapsed {el:.0f} s, eta {eta:.0f} s)", file=sys.stderr, flush=True)
    return show


def sweep(cells: Sequence[Cell], out: str, workers: int | None = None, ray_address: str | None = None,
          progress: bool | Callable[[dict, int], None] = True) -> dict:
    """Run the cells not yet in `out`, appending their rows as they finish.
    Returns {"total", "skipped", "ran", "wall_s"}."""
    t0 = time.perf_counter()
    d = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(d):
        raise ValueError(f"cannot write {out}: directory {d} does not exist")
    store = ParquetStore(out)
    todo = [c for c in cells if c.key not in store.done]
    show = progress if callable(progress) else (_progress_line(len(todo)) if progress else None)
    if ray_address is not None:
        rows = run_ray(todo, ray_address)
    else:
        rows = run_local(todo, workers if workers else (os.cpu_count() or 1))
    ran = 0
    try:
        for row in rows:
            store.add(row)
            ran += 1
            if show:
                show(row, ran)
            if store.due():
                store.flush()
    finally:
        store.close()
        close = getattr(rows, "close", None)
        if close:
            close()
    return {"total": len(cells), "skipped": len(cells) - len(todo), "ran": ran,
            "wall_s": time.perf_counter() - t0}


def cells_of(rows: Iterable[dict]) -> list[tuple]:
    return sorted(cell_key(r) for r in rows)


__all__ = ["Cell", "KEY", "GROUP", "ResultsFileError", "grid", "parse_seeds", "run_cell", "flatten", "sweep",
           "read_table", "read_rows", "cells_of", "asdict"]
