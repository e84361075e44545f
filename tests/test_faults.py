"""Engine faults as scenario events ([faults] in a scenario file): a stall
(the engine does nothing for S seconds from T) and a KV block leak on abort.
Unset, a scenario's records are the reference's (the golden test)."""
from __future__ import annotations

import pytest

from llmsim.cli import main
from sim.deployment import load


def _file(tmp_path, faults: str, proxy: str = "no-retry"):
    f = tmp_path / "s.toml"
    f.write_text(f'[model]\nprofile = "qwen2.5-7b"\n[proxy]\ncondition = "{proxy}"\n{faults}')
    return str(f)


def test_a_stall_is_read_written_back_and_reaches_the_engine(tmp_path):
    dep = load(_file(tmp_path, "[faults]\nstalls = [[300, 60]]\n"))
    assert dep.scenario.stalls == ((300.0, 60.0),)
    assert "[faults]" in dep.to_toml() and "stalls = [[300.0, 60.0]]" in dep.to_toml()
    rec = dep.run(0)
    (tmp_path / "plain.toml").write_text('[model]\nprofile = "qwen2.5-7b"\n[proxy]\ncondition = "no-retry"\n')
    base = load(str(tmp_path / "plain.toml")).run(0)
    # a minute with no steps: the engine takes fewer steps, the hold waits behind the stall
    assert rec["engine"]["steps"] < base["engine"]["steps"]
    assert rec["cohorts"]["hold"]["within_deadline"] < base["cohorts"]["hold"]["within_deadline"]
    assert rec["deployment"]["content_hash"] != base["deployment"]["content_hash"]


def test_a_kv_block_leak_on_abort_keeps_service_from_coming_back(tmp_path):
    """Cancellation aborts executions; with the leak their blocks stay taken,
    the KV cache fills and admission stops: the run that recovers without the
    leak does not with it."""
    leak = load(_file(tmp_path, "[faults]\nleak_blocks_on_abort = true\n", "no-retry+cancel")).run(0)
    (tmp_path / "p.toml").write_text('[model]\nprofile = "qwen2.5-7b"\n[proxy]\ncondition = "no-retry+cancel"\n')
    plain = load(str(tmp_path / "p.toml")).run(0)
    assert plain["recovered"] and not leak["recovered"]
    assert leak["cohorts"]["hold"]["delivered"] < plain["cohorts"]["hold"]["delivered"]


@pytest.mark.parametrize("faults,key", [("[faults]\nstalls = [[300]]\n", "stalls"),
                                        ("[faults]\nstalls = [[300, -5]]\n", "duration_s"),
                                        ("[faults]\nleak_blocks_on_abort = 1\n", "leak_blocks_on_abort"),
                                        ("[faults]\nstall = [[1, 2]]\n", "stall")])
def test_a_bad_fault_is_one_line_naming_the_key(tmp_path, capsys, faults, key):
    out = tmp_path / "r.json"
    assert main(["run", "--scenario", _file(tmp_path, faults), "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and key in err and not out.exists()
