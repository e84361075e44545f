"""llmsim paper: the blocks' cells, the report and figures on a tiny grid, resuming,
and the report computed from the Parquet file only."""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llmsim.cli import main
from sim.conditions import CONDITIONS, DIAGNOSTIC
from sim.experiments import paper as pp

MODEL = "qwen2.5-7b"


def test_block_definitions_give_the_expected_cells():
    n = {b.name: len(b.cells(models=pp.MODELS, seeds=range(2))) for b in pp.BLOCKS}
    per = 3 * 2                                              # models x seeds
    assert n == {"diagnostic": 4 * per, "trigger": 4 * 3 * per, "tracing": 4 * 2 * per,
                 "composition": 6 * per, "queue": 3 * per, "engine-cap": 3 * per, "deferral": 2 * per,
                 "budget-cancel": 3 * per, "mixed": 4 * per}
    trig = pp.get_blocks(["trigger"])[0].cells(models=[MODEL], seeds=[0])
    assert sorted({c.pulse for c in trig}) == [1.5, 2.0, 2.7]
    assert {c.max_batched_tokens for c in pp.get_blocks(["tracing"])[0].cells([MODEL], [0])} == {8192, 2048}
    assert all(c.mixed_prompts for c in pp.get_blocks(["mixed"])[0].cells([MODEL], [0]))
    assert {c.condition for c in pp.get_blocks(["diagnostic"])[0].cells([MODEL], [0])} == set(DIAGNOSTIC)
    for b in pp.BLOCKS:
        assert set(b.conditions) <= set(CONDITIONS)
    # shared cells run once: the union is smaller than the sum of the blocks
    union = pp.paper_cells(seeds=1)
    assert len({c.key for c in union}) == len(union) < sum(len(b.cells(pp.MODELS, [0])) for b in pp.BLOCKS)
    assert {c.model for c in union} == set(pp.MODELS)
    assert pp.DEFAULT_SEEDS >= 1
    with pytest.raises(ValueError):
        pp.get_blocks(["nope"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("paper"))
    res = pp.paper(out, seeds=1, workers=2, blocks=["diagnostic", "deferral"], models=[MODEL], progress=False)
    return out, res


def test_tiny_paper_writes_tables_and_figures(tiny):
    out, res = tiny
    assert res["total"] == res["ran"] == 6 and res["skipped"] == 0
    text = open(os.path.join(out, "report.md")).read()
    assert "<!-- block: diagnostic -->" in text and "<!-- block: deferral -->" in text
    assert "<!-- block: trigger -->" not in text
    lines = [line for line in text.splitlines() if line.startswith(f"| {MODEL} |")]
    assert len(lines) == 4 + 2
    for c in DIAGNOSTIC + ("deferred", "coalesce+cancel"):
        assert any(line.startswith(f"| {MODEL} | {c} |") for line in lines), c
    assert "hold delivered %" in text and "recovery time s" in text and "created ×Ĉ" in text
    assert "Against the published figures (vLLM on one H100, Qwen2.5-7B-Instruct)" in text
    assert "SPEC" not in text
    ref = [line for line in text.splitlines() if line.startswith("| no-retry |")]
    assert len(ref) == 1 and "| 72.4-74.8% |" in ref[0] and "| 480-540 s |" in ref[0]
    for f in pp.FIGURES:
        p = os.path.join(out, f)
        assert os.path.getsize(p) > 5000, f
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_second_call_runs_nothing(tiny):
    out, _ = tiny
    res = pp.paper(out, seeds=1, workers=2, blocks=["diagnostic", "deferral"], models=[MODEL], progress=False)
    assert res["ran"] == 0 and res["skipped"] == 6


def test_report_is_computed_from_the_parquet_file(tiny, tmp_path):
    out, _ = tiny
    d = str(tmp_path)
    t = pq.read_table(os.path.join(out, "results.parquet"))
    rows = t.to_pylist()
    for r in rows:
        if r["condition"] == "no-retry":
            r["hold_delivered"] = r["hold_offered"]          # 100.0 % hold delivered
            r["rates_xC_created"] = 7.25
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), os.path.join(d, "results.parquet"))
    pp.write_report(d, blocks=["diagnostic"], models=[MODEL], seeds=1)
    line = next(ln for ln in open(os.path.join(d, "report.md")).read().splitlines()
                if ln.startswith(f"| {MODEL} | no-retry |"))
    cols = [c.strip() for c in line.strip("|").split("|")]
    assert cols[5] == "100.0" and "7.25" in cols
    ref = next(line for line in open(os.path.join(d, "report.md")).read().splitlines()
               if line.startswith("| no-retry |"))
    cols = [c.strip() for c in ref.strip("|").split("|")]
    assert cols[1] == "100.0%" and cols[3] == "25.2" and cols[6].startswith("OFF: hold delivery 25.2 points above")
    for f in pp.FIGURES:
        assert os.path.getsize(os.path.join(d, f)) > 5000


def test_cli_paper_report_only_and_errors(tiny, tmp_path, capsys):
    out, _ = tiny
    assert main(["paper", "--out", out, "--report-only", "--seeds", "1"]) == 0
    assert "report.md" in capsys.readouterr().out
    assert main(["paper", "--out", str(tmp_path / "empty"), "--report-only"]) == 2
    assert main(["paper", "--out", out, "--seeds", "0"]) == 2


def test_block_figures_from_the_parquet_file(tiny, tmp_path):
    """Trigger / tracing / mixed figures: drawn from the rows in results.parquet (here the diagnostic
    rows relabelled as the other blocks' cells), embedded under their block; absent when not reported."""
    out, _ = tiny
    t = pq.read_table(os.path.join(out, "results.parquet"))
    (tmp_path / "other").mkdir()
    pq.write_table(t, str(tmp_path / "other" / "results.parquet"))
    pp.write_report(str(tmp_path / "other"), blocks=["diagnostic", "deferral"], models=[MODEL], seeds=1)
    assert not any((tmp_path / "other" / f).exists() for f in pp.BLOCK_FIGURES.values())
    diag = [r for r in t.to_pylist() if r["condition"] in DIAGNOSTIC]
    rows = list(diag)
    for change in ({"pulse": 1.5}, {"pulse": 2.0}, {"max_batched_tokens": 2048}, {"mixed_prompts": True}):
        rows += [{**r, **change} for r in diag]
    d = str(tmp_path)
    pq.write_table(pa.Table.from_pylist(rows, schema=t.schema), os.path.join(d, "results.parquet"))
    pp.write_report(d, blocks=["diagnostic", "trigger", "tracing", "mixed"], models=[MODEL], seeds=1)
    text = open(os.path.join(d, "report.md")).read()
    for block, f in pp.BLOCK_FIGURES.items():
        p = os.path.join(d, f)
        assert os.path.getsize(p) > 5000, f
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        section = text.split(f"<!-- block: {block} -->", 1)[1].split("\n## ", 1)[0]
        assert f"![{f}]({f})" in section
    # the trigger table has the relabelled pulses
    trig = text.split("<!-- block: trigger -->", 1)[1].split("\n## ", 1)[0]
    assert sum(line.startswith(f"| {MODEL} |") for line in trig.splitlines()) == 4 * 3
