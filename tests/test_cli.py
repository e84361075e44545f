"""The command line: bad input exits non-zero with a one-line reason naming
the valid choices; good input writes the result record."""
import json
import subprocess
import sys

import pytest

from llmsim.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "llmsim", *args], capture_output=True, text=True)


@pytest.mark.parametrize("args,needle", [
    (["run", "--model", "nope", "--condition", "cancel"], "qwen2.5-7b"),
    (["run", "--condition", "bogus"], "no-control"),
    (["run", "--condition", "cancel", "--pulse", "-1"], "positive"),
    (["run", "--condition", "cancel", "--pulse", "abc"], "number"),
    (["latency", "--rate", "0"], "positive"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_one_line_reason(args, needle):
    r = run_cli(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0]


@pytest.mark.parametrize("content,needle", [
    ("not json", "not valid JSON"),
    ('{"name": "x"}', "missing key"),
    ('{"name": "x", "step_time": {"fixed_s": 1}, "engine": {}, "capacity": 1, "provenance": {"kind": "k"}}',
     "step_time lacks"),
])
def test_malformed_profile_file(tmp_path, content, needle):
    f = tmp_path / "p.json"
    f.write_text(content)
    r = run_cli("run", "--model", str(f), "--condition", "cancel")
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and needle in r.stderr


def test_run_writes_record(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["run", "--condition", "no-retry+cancel", "--pulse", "1.5", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["condition"] == "no-retry+cancel" and rec["pulse"] == 1.5
    for k in ("cohorts", "recovered", "recovery_time_s", "rates_xC", "prompt_tokens", "counters",
              "counters_hold", "retries", "waste", "engine", "wall_s", "capacity", "seed", "model"):
        assert k in rec
    assert "no-retry+cancel" in capsys.readouterr().out


def test_json_to_missing_directory_fails_cleanly(tmp_path):
    r = run_cli("run", "--condition", "cancel", "--json", str(tmp_path / "no" / "r.json"))
    assert r.returncode != 0 and "does not exist" in r.stderr


def test_capacity_over_several_seeds(tmp_path):
    one = tmp_path / "one.json"
    assert main(["capacity", "--seed", "1", "--json", str(one)]) == 0
    several = tmp_path / "several.json"
    assert main(["capacity", "--seeds", "0-1", "--json", str(several)]) == 0
    a, b = json.loads(one.read_text()), json.loads(several.read_text())
    assert a["profile_capacity"] == b["profile_capacity"]
    caps = [r["capacity"] for r in b["runs"]]
    assert b["seeds"] == [0, 1] and caps[1] == a["capacity"] and caps[0] != caps[1]
    assert b["capacity_mean"] == pytest.approx(sum(caps) / 2)
    assert b["capacity_sd"] == pytest.approx(abs(caps[0] - caps[1]) / 2 ** 0.5)
