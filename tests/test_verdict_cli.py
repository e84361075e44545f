"""`llmsim margin`, `advise`, `map`, and --seeds on `run` and `diagnose`, on
a scaled-down deployment (cpu-tiny's workload on the tiny CPU engine's
profile with Ĉ taken as 4 calls/s) so that each runs in seconds."""
import json

import pytest

from llmsim.cli import main
from sim.profile import load_profile


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    raw = dict(load_profile("vllm-cpu-tiny").raw, name="tiny-at-4", capacity=4.0)
    p = tmp_path_factory.mktemp("prof") / "tiny.json"
    p.write_text(json.dumps(raw))
    return str(p)


def _one_line_error(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("llmsim:")
    return err[0]


def test_margin_finds_the_speed_crossing(tiny, tmp_path, capsys):
    out = tmp_path / "m.json"
    assert main(["margin", "--model", tiny, "--scenario", "cpu-tiny", "--condition", "cancel", "--seeds", "4",
                 "--axes", "speed", "--workers", "1", "--quiet", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["seeds"] == [0, 1, 2, 3] and [a["axis"] for a in d["axes"]] == ["speed"]
    ax = d["axes"][0]
    assert ax["recovers_at_baseline"] and ax["crossing"] is not None
    lo, hi = sorted(ax["bracket"])
    assert 1.0 < lo <= ax["crossing"] <= hi
    assert "slower" in capsys.readouterr().out


def test_margin_refuses_an_unknown_axis_and_scenario(tiny, capsys):
    assert main(["margin", "--model", tiny, "--condition", "cancel", "--axes", "warp"]) == 2
    assert "warp" in _one_line_error(capsys)
    assert main(["margin", "--model", tiny, "--scenario", "nowhere", "--condition", "cancel"]) == 2
    assert "nowhere" in _one_line_error(capsys)


def test_advise_on_the_client_layer(tiny, tmp_path, capsys):
    out, js = tmp_path / "a.parquet", tmp_path / "a.json"
    assert main(["advise", "--model", tiny, "--scenario", "cpu-tiny", "--only", "client", "--seeds", "6",
                 "--margin-axes", "none", "--workers", "1", "--quiet", "--out", str(out), "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    assert d["top"][0]["summary"]["lo"] > 0.5 and out.exists() and d["screen_cut"] is not None
    whole = tmp_path / "w.json"
    assert main(["advise", "--model", tiny, "--scenario", "cpu-tiny", "--only", "client", "--seeds", "6",
                 "--margin-axes", "none", "--workers", "1", "--quiet", "--screen-cut", "none", "--json",
                 str(whole)]) == 0
    w = json.loads(whole.read_text())
    assert w["screen_cut"] is None and w["top"][0]["condition"] == d["top"][0]["condition"]
    assert "1. " in capsys.readouterr().out


def test_map_writes_table_and_png(tiny, tmp_path, capsys):
    out = tmp_path / "m.parquet"
    assert main(["map", "--model", tiny, "--scenario", "cpu-tiny", "--condition", "no-retry", "--x", "pulse=1:4:2",
                 "--y", "hold_load=0.3,0.95", "--seeds", "2", "--workers", "1", "--quiet", "--out", str(out)]) == 0
    assert out.exists() and (tmp_path / "m.png").exists()
    assert main(["map", "--model", tiny, "--condition", "no-retry", "--x", "pulse=1:4", "--y", "hold_load=0.3,0.9",
                 "--out", str(tmp_path / "n.parquet")]) == 2
    assert "pulse" in _one_line_error(capsys) and not (tmp_path / "n.parquet").exists()


def test_run_over_seeds_reports_p_recovered(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["run", "--condition", "no-retry", "--pulse", "1.5", "--seeds", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["seeds"] == [0, 1] and d["summary"]["n"] == 2 and len(d["runs"]) == 2
    assert "P(recovered)" in capsys.readouterr().out


def test_seed_count_and_seed_exclude_each_other(capsys):
    assert main(["run", "--seed", "1", "--seeds", "3"]) == 2
    _one_line_error(capsys)


def test_sweep_ends_with_p_recovered_per_cell(tmp_path, capsys):
    out = str(tmp_path / "s.parquet")
    assert main(["sweep", "--models", "qwen3-14b", "--conditions", "no-retry", "--pulses", "1.5", "--seeds", "0-1",
                 "--out", out, "--workers", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "P(recovered)" in text and "qwen3-14b no-retry pulse 1.5" in text


def test_advise_only_router_on_one_engine_is_a_usage_error(tiny, tmp_path, capsys):
    out = tmp_path / "a.parquet"
    assert main(["advise", "--model", tiny, "--scenario", "cpu-tiny", "--only", "router", "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "--only router" in err and "[fleet]" in err and not out.exists()
    assert main(["advise", "--model", tiny, "--scenario", "cpu-tiny", "--screen-cut", "10"]) == 2
    assert "--screen-cut" in _one_line_error(capsys)


def test_advise_searches_a_fleets_router(tmp_path, capsys):
    import subprocess
    import sys
    toml = subprocess.run([sys.executable, "-m", "llmsim", "scenario", "show", "cpu-tiny"], capture_output=True,
                          text=True, check=True).stdout
    path = tmp_path / "fleet.toml"
    path.write_text(toml + '\n[fleet]\nreplicas = 2\nrouter = "round-robin"\nproxy = "deployment"\n')
    js = tmp_path / "a.json"
    assert main(["advise", "--scenario", str(path), "--only", "router", "--seeds", "2", "--screen", "1",
                 "--finalists", "3", "--workers", "1", "--quiet", "--json", str(js)]) == 0
    d = json.loads(js.read_text())
    assert d["candidates"] == 20 and d["top"] and d["router"]["chosen"] == d["top"][0]["router"]
    assert all(";router=" in x["condition"] or x["router"] == d["router"]["scenario"] for x in d["top"])
    assert d["top"][0]["margin"]["axes"][0]["probes"][0]["p"] == d["top"][0]["summary"]["p"]
    out = capsys.readouterr().out
    assert "router: " in out and "   margin: " in out


def test_diagnose_json_carries_each_conditions_verdict_as_run_seeds_does(tiny, tmp_path):
    diag, run = tmp_path / "d.json", tmp_path / "r.json"
    assert main(["diagnose", "--model", tiny, "--scenario", "cpu-tiny", "--seeds", "2", "--json", str(diag)]) == 0
    assert main(["run", "--model", tiny, "--scenario", "cpu-tiny", "--condition", "no-retry", "--seeds", "2",
                 "--json", str(run)]) == 0
    d, r = json.loads(diag.read_text()), json.loads(run.read_text())
    assert list(d["summary"]) == ["no-control", "cancel", "no-retry+cancel", "no-retry"]
    for cond, s in d["summary"].items():
        runs = [x for x in d["runs"] if x["condition"] == cond]
        assert set(s) == set(r["summary"]) and s["n"] == len(runs) == 2
        assert s["recovered"] == sum(bool(x["recovered"]) for x in runs)
        assert s["lo"] <= s["p"] <= s["hi"] and isinstance(s["tipping"], bool)
    mine, theirs = d["summary"]["no-retry"], r["summary"]
    assert (mine["recovered"], mine["tipping"], mine["too_few"]) == (theirs["recovered"], theirs["tipping"],
                                                                     theirs["too_few"])
    assert (mine["lo"], mine["hi"]) == pytest.approx((theirs["lo"], theirs["hi"]))
    assert mine["hold_delivered"] == pytest.approx(theirs["hold_delivered"])
