"""The notebooks (jupytext percent sources under notebooks/) execute top to bottom in a
Jupyter kernel of this interpreter, write their results file and figure, and plot/tabulate
what the results file holds."""
from __future__ import annotations

import os
import sys
import time

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
import pyarrow.parquet as pq  # noqa: E402

from sim.conditions import DIAGNOSTIC  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL = "llmsim-notebook-test"
SEEDS = 2


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """A kernelspec that starts ipykernel with this interpreter (so a fresh venv needs no
    `ipykernel install`), the notebooks' output folder and the repo on the kernel's path."""
    from ipykernel.kernelspec import write_kernel_spec
    write_kernel_spec(str(tmp_path / "jupyter" / "kernels" / KERNEL))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("LLMSIM_NOTEBOOK_OUT", str(tmp_path / "out"))
    monkeypatch.setenv("LLMSIM_NOTEBOOK_SEEDS", str(SEEDS))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    return tmp_path


def execute(name: str, tmp_path) -> tuple[object, float]:
    nb = jupytext.read(os.path.join(ROOT, "notebooks", f"{name}.py"))
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")     # no stored outputs
    client = nbclient.NotebookClient(nb, kernel_name=KERNEL, timeout=240,
                                     resources={"metadata": {"path": str(tmp_path)}})
    t0 = time.perf_counter()
    client.execute()
    wall = time.perf_counter() - t0
    print(f"{name}: executed in {wall:.1f} s", file=sys.stderr)
    return nb, wall


def outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


def check_png(path: str) -> None:
    assert os.path.getsize(path) > 5000, path
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_policy_sweep_notebook(kernel_env):
    nb, _ = execute("policy_sweep", kernel_env)
    out = kernel_env / "out" / "policy_sweep"
    conds = DIAGNOSTIC + ("coalesce", "budget", "deferred", "lifo")
    rows = pq.read_table(str(out / "results.parquet")).to_pylist()
    assert sorted((r["condition"], r["seed"]) for r in rows) == sorted((c, s) for c in conds for s in range(SEEDS))
    assert {(r["model"], r["pulse"]) for r in rows} == {("qwen2.5-7b", 2.7)}
    check_png(str(out / "hold_vs_created.png"))
    assert len(outputs(nb, "image/png")) == 1                               # the figure, shown inline
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + len(conds)
    for c in conds:                                                         # one row per condition, both seeds
        assert any(line.startswith(f"| {c} | {SEEDS} |") for line in table), c
    # the table is the Parquet's numbers: no-control's hold delivered mean
    nc = [100 * r["hold_delivered"] / r["hold_offered"] for r in rows if r["condition"] == "no-control"]
    line = next(ln for ln in table if ln.startswith("| no-control |"))
    assert line.split("|")[3].strip() == f"{sum(nc) / len(nc):.1f}"
    md = outputs(nb, "text/markdown")
    assert md and "| lifo |" in md[-1]["data"]["text/markdown"]


def test_trigger_sweep_notebook(kernel_env):
    nb, _ = execute("trigger_sweep", kernel_env)
    out = kernel_env / "out" / "trigger_sweep"
    rows = pq.read_table(str(out / "results.parquet")).to_pylist()
    want = sorted((c, p, s) for c in DIAGNOSTIC for p in (1.5, 2.0, 2.7) for s in range(SEEDS))
    assert sorted((r["condition"], r["pulse"], r["seed"]) for r in rows) == want
    check_png(str(out / "trigger.png"))
    assert len(outputs(nb, "image/png")) == 1
    table = (out / "table.md").read_text().splitlines()
    assert len(table) == 2 + 4 * 3
    # recovered counts in the table match the results file
    for c in DIAGNOSTIC:
        n = sum(bool(r["recovered"]) for r in rows if r["condition"] == c and r["pulse"] == 2.7)
        line = next(ln for ln in table if ln.startswith(f"| {c} | 2.7 |"))
        assert line.split("|")[5].strip() == f"{n}/{SEEDS}"
