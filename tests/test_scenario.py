"""Scenario files and trace replay: the reference design round-trips through
`llmsim scenario show`, a replayed trace is replayed exactly, engine
overrides reach the engine, and Ĉ belongs to the workload."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import golden
from llmsim.cli import main
from sim.capacity import capacity_protocol
from sim.deployment import ScenarioError, from_document, load
from sim.engine.step_time import prefill_pairs
from sim.model import Run
from sim.profile import load_profile
from sim.run import needs_recalibration, workload_capacity
from sim.scenario import PAPER, SCENARIOS


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("LLMSIM_CACHE_DIR", "")


def write(path, text) -> str:
    with open(path, "w") as f:
        f.write(text)
    return str(path)


def trace_file(tmp_path, rows, header="arrived_at,num_prefill_tokens,num_decode_tokens", name="t.csv") -> str:
    return write(tmp_path / name, header + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))


# Ĉ given in the file where the test is not about it (the protocol on a tiny
# trace's mix would run for minutes)
def replay_toml(tmp_path, trace, extra="", measures="burst_start_s = 0.0\nburst_end_s = 10.0\nhold_end_s = 100.0\n"):
    return write(tmp_path / "s.toml", f'name = "replay"\n[model]\ncapacity = 2.0\n[workload]\n'
                                      f'trace = "{os.path.basename(trace)}"\n{extra}[measures]\n{measures}')


# ------------------------------------------------------------------ round trip
def test_show_paper_given_back_gives_the_default_records(tmp_path, capsys):
    assert main(["scenario", "show", "paper"]) == 0
    toml = write(tmp_path / "paper.toml", capsys.readouterr().out)
    a, b = str(tmp_path / "a.json"), str(tmp_path / "b.json")
    assert main(["run", "--condition", "cancel", "--json", a]) == 0
    assert main(["run", "--scenario", toml, "--condition", "cancel", "--json", b]) == 0
    ra, rb = json.load(open(a)), json.load(open(b))
    ra.pop("wall_s"), rb.pop("wall_s")
    assert golden.differences(ra, rb) == []
    assert ra["deployment"]["name"] == "paper" and ra["deployment"]["content_hash"] == rb["deployment"]["content_hash"]
    # and the same as the library's reference run (which the golden records guard)
    ref = json.loads(json.dumps(golden.run_case("qwen2.5-7b", "cancel")))
    for k in ("deployment", "engine_config"):
        ra.pop(k)
    assert golden.differences(ra, ref) == []


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_named_scenario_round_trips_through_its_file(tmp_path, name):
    dep = load(name)
    back = load(write(tmp_path / f"{name}.toml", dep.to_toml()))
    assert back.scenario == dep.scenario and back.content_hash == dep.content_hash
    assert back.condition_for("deferred") == dep.condition_for("deferred")
    assert back.profile.engine == dep.profile.engine


def test_a_directory_named_as_a_scenario_does_not_hide_it(tmp_path, monkeypatch, capsys):
    # `llmsim paper` writes ./paper; a command run there afterwards still means the named scenario
    monkeypatch.chdir(tmp_path)
    (tmp_path / "paper").mkdir()
    assert load("paper").content_hash == load(write(tmp_path / "p.toml", load("paper").to_toml())).content_hash
    assert main(["run", "--scenario", "paper", "--condition", "no-retry", "--seed", "0", "--json", "r.json"]) == 0
    # a file of that name is a scenario file, and read as one
    (tmp_path / "cpu-tiny").write_text("not toml [")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load("cpu-tiny")


def test_the_record_carries_a_toml_that_reruns_it(tmp_path):
    dep = load("paper").with_changes(pulse=1.5)
    rec = dep.run(0, "no-retry")
    again = load(write(tmp_path / "again.toml", rec["deployment"]["toml"])).run(0, "no-retry")
    rec.pop("wall_s"), again.pop("wall_s")
    assert golden.differences(json.loads(json.dumps(rec)), json.loads(json.dumps(again))) == []


# ------------------------------------------------------------------ trace replay
def test_a_hand_made_trace_gives_exactly_its_calls(tmp_path):
    rows = [(0.0, 900, 5), (0.5, 1200, 7), (0.5, 2000, 1), (3.25, 700, 30), (9.0, 4000, 12), (20.0, 1500, 3)]
    dep = load(replay_toml(tmp_path, trace_file(tmp_path, rows)))
    tr = dep.trace()
    assert len(tr) == len(rows)
    assert tr.arrival.tolist() == [r[0] for r in rows]
    assert tr.prompt_len.tolist() == [r[1] for r in rows] and tr.max_tokens.tolist() == [r[2] for r in rows]
    run = Run(dep.profile, tr, dep.condition_for(), dep.scenario, 0)
    log = run.run()
    assert [c.planned_at for c in log.calls] == [r[0] for r in rows]
    first = [e for e in log.executions if e.attempt == 0]
    assert sorted((e.call, e.prompt_len, e.max_tokens) for e in first) == \
        [(i, r[1], r[2]) for i, r in enumerate(rows)]
    rec = dep.run()
    assert rec["attempts"]["first"] == len(rows) and rec["calls_failed"]["outstanding"] == 0
    assert rec["cohorts"]["pulse"]["offered"] == 5 and rec["cohorts"]["hold"]["offered"] == 1


def test_azure_columns_with_date_times_and_a_speedup(tmp_path):
    rows = [("2023-11-16 18:15:46.6805900", 374, 44), ("2023-11-16 18:15:50.9951690", 396, 109),
            ("2023-11-16 18:16:06.6805900", 879, 2)]
    t = trace_file(tmp_path, rows, header="TIMESTAMP,ContextTokens,GeneratedTokens")
    dep = load(replay_toml(tmp_path, t, extra="trace_speedup = 2.0\n"))
    np.testing.assert_allclose(dep.trace().arrival, [0.0, 4.314579 / 2, 10.0], rtol=0, atol=1e-6)
    assert dep.trace().prompt_len.tolist() == [374, 396, 879]
    # the command line's --trace-speedup replaces the file's
    assert load(replay_toml(tmp_path, t), trace_speedup=4.0).trace().arrival[-1] == pytest.approx(5.0)


def test_a_one_call_trace_gives_the_step_models_prefill_time(tmp_path):
    prompt = 3000
    dep = load(replay_toml(tmp_path, trace_file(tmp_path, [(0.0, prompt, 1)])))
    st = dep.profile.step_time
    assert prompt <= dep.profile.engine["max_num_batched_tokens"]      # one prefill step
    expected = st.duration(1, prompt, prefill_pairs(prompt, 0), 0.0)
    log = Run(dep.profile, dep.trace(), dep.condition_for(), dep.scenario, 0).run()
    (ex,) = log.executions
    assert ex.first_token_at - ex.created_at == pytest.approx(expected, rel=1e-9)


def test_the_shipped_sample_trace_is_small_and_replays():
    here = os.path.join(os.path.dirname(__file__), "..", "examples")
    assert os.path.getsize(os.path.join(here, "sample_trace.csv")) < 1_000_000
    dep = load(os.path.join(here, "sample-trace-replay.toml"))
    assert len(dep.trace()) == sum(1 for _ in open(os.path.join(here, "sample_trace.csv"))) - 1


# ------------------------------------------------------------------ engine overrides
def test_a_kv_override_reaches_the_engine(tmp_path):
    base = load("paper").run(0, "no-retry")
    f = write(tmp_path / "kv.toml", "[model]\ncapacity = 2.764097786271699\n[engine]\nkv_cache_tokens = 40000\n")
    dep = load(f)
    assert dep.profile.engine["num_gpu_blocks"] == 40000 // 16
    rec = dep.run(0, "no-retry")
    assert base["engine_config"]["num_gpu_blocks"] == 63786 and rec["engine_config"]["num_gpu_blocks"] == 2500
    run = Run(dep.profile, dep.trace(0), dep.condition_for("no-retry"), dep.scenario, 0)
    assert run.engine.scheduler.block_pool.num_blocks == 2500
    # 40,000 tokens hold the shared 2,000-token prefix and at most four calls' own 10,000 tokens, partly
    assert max(rec["series"]["running"]) <= 4 < max(base["series"]["running"])


def test_a_seats_override_caps_running_requests(tmp_path):
    f = write(tmp_path / "seats.toml", "[model]\ncapacity = 2.764097786271699\n[engine]\nmax_num_seqs = 4\n")
    rec = load(f).run(0, "no-retry")
    assert rec["engine_config"]["max_num_seqs"] == 4
    assert max(rec["series"]["running"]) == 4


def test_gpu_memory_utilization_uses_the_profiles_kv_formula(tmp_path):
    dep = load(write(tmp_path / "u.toml", "[engine]\ngpu_memory_utilization = 0.9\n"))
    assert dep.profile.engine["num_gpu_blocks"] == load_profile("qwen2.5-7b").engine["num_gpu_blocks"]
    assert not needs_recalibration(dep.profile, dep.scenario)        # the same flags: the profile's Ĉ holds
    half = load(write(tmp_path / "h.toml", "[engine]\ngpu_memory_utilization = 0.5\n"))
    assert half.profile.engine["num_gpu_blocks"] < dep.profile.engine["num_gpu_blocks"]


def test_an_engine_cap_from_the_file_reaches_the_condition(tmp_path):
    dep = load(write(tmp_path / "q.toml", "[engine]\nmax_num_queued_reqs = 50\n[proxy]\ncondition = \"cancel\"\n"))
    assert dep.condition_for().engine_cap == 50 and dep.condition_for().name == "cancel"


# ------------------------------------------------------------------ Ĉ of a workload
def test_capacity_belongs_to_the_workload():
    prof = load_profile("qwen2.5-7b")
    assert workload_capacity(prof, PAPER) == {"capacity": prof.capacity, "source": "profile", "key": None}
    mixed = workload_capacity(prof, PAPER.with_(mixed_share=0.5))
    assert mixed["source"].startswith("capacity protocol") and mixed["capacity"] > 1.3 * prof.capacity
    assert workload_capacity(prof, PAPER.with_(mixed_share=0.5)) is mixed            # once, cached
    # the same protocol as `llmsim capacity` (docs/model.md#capacity-ĉ, from 1.0 calls/s)
    assert mixed["capacity"] == capacity_protocol(prof, PAPER.with_(mixed_share=0.5))["capacity"]


def test_check_gives_an_autoscaled_fleets_capacity_as_its_starting_replicas(capsys):
    """An autoscaled fleet's Ĉ is the sum of the replicas it starts with,
    not of the replicas it may grow to."""
    f = os.path.join(os.path.dirname(__file__), "..", "examples", "autoscale.toml")
    assert main(["scenario", "check", f]) == 0
    out = capsys.readouterr().out
    cap = load(f).capacity
    assert f"Ĉ {cap:.3f} calls/s, of the 1 replica the autoscaler starts with (at most 4; profile)" in out


def test_mixed_prompts_scale_by_the_mix_capacity():
    from sim.run import run_one
    prof = load_profile("qwen2.5-7b")
    rec = run_one(prof, "no-retry", 2.7, 0, mixed_prompts=True)
    assert rec["capacity"] == pytest.approx(workload_capacity(prof, PAPER.with_(mixed_share=0.5))["capacity"])


def test_phases_given_as_rates_and_loads(tmp_path):
    dep = load(write(tmp_path / "p.toml", """
[model]
capacity = 3.0
[workload]
phases = [{name = "a", duration_s = 50.0, rate = 2.0}, {name = "b", duration_s = 20.0, load = 1.5},
          {name = "c", duration_s = 100.0, rate = 1.0}]
prompt = {dist = "fixed", value = 4000}
response = {dist = "fixed", value = 100}
[measures]
burst = "b"
"""))
    s = dep.scenario
    assert (s.pulse_start, s.pulse_end, s.hold_end) == (50.0, 70.0, 170.0)
    assert s.primary_start == 70.0 + s.deadline_s and s.delivery_horizon_s == 100.0 + s.deadline_s
    tr = dep.trace(3)
    assert set(tr.prompt_len.tolist()) == {4000} and set(tr.max_tokens.tolist()) == {100}
    assert dep.capacity_info["source"] == "given in the scenario file" and dep.capacity == 3.0
    n_b = np.count_nonzero((tr.arrival >= 50) & (tr.arrival < 70))
    assert abs(n_b - 1.5 * dep.capacity * 20) < 5 * np.sqrt(1.5 * dep.capacity * 20)


# ------------------------------------------------------------------ bad input
def _bad(tmp_path, capsys, toml_text=None, path=None, argv=("run", "--condition", "no-control")):
    f = path or write(tmp_path / "bad.toml", toml_text)
    out = tmp_path / "out.json"
    rc = main([*argv, "--scenario", f, "--json", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert err.count("\n") == 1 and "Traceback" not in err
    return err


def test_unknown_key_names_the_closest(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "[client]\ndeadline = 60\n")
    assert "bad.toml" in err and "client.deadline" in err and "did you mean 'deadline_s'" in err
    err = _bad(tmp_path, capsys, "[engine]\nmax_num_seq = 8\n")
    assert "max_num_seqs" in err
    err = _bad(tmp_path, capsys, "[wrkload]\n")
    assert "wrkload" in err and "workload" in err


def test_wrong_type(tmp_path, capsys):
    err = _bad(tmp_path, capsys, '[client]\ndeadline_s = "sixty"\n')
    assert "client.deadline_s" in err and "number" in err
    err = _bad(tmp_path, capsys, '[engine]\nmax_num_seqs = 2.5\n')
    assert "max_num_seqs" in err


@pytest.mark.parametrize("dur", ["0.0", "-5.0"])
def test_zero_or_negative_duration(tmp_path, capsys, dur):
    err = _bad(tmp_path, capsys, f'[workload]\nphases = [{{name = "x", duration_s = {dur}, load = 1.0}}]\n'
                                 '[measures]\nburst = "x"\n')
    assert "phases[0].duration_s" in err and "positive" in err


def test_rate_and_load_both_given(tmp_path, capsys):
    err = _bad(tmp_path, capsys, '[workload]\nphases = [{name = "x", duration_s = 10.0, load = 1.0, rate = 2.0}]\n'
                                 '[measures]\nburst = "x"\n')
    assert "phases[0].load" in err and "both" in err


def test_no_burst_declared_while_cohorts_need_one(tmp_path, capsys):
    text = ('[workload]\nphases = [{name = "x", duration_s = 10.0, load = 1.0}, '
            '{name = "y", duration_s = 10.0, load = 2.0}]\n')
    err = _bad(tmp_path, capsys, text)
    assert "no burst declared" in err and "measures" in err
    assert main(["scenario", "check", str(tmp_path / "bad.toml")]) == 0      # checking needs no cohorts
    assert "no burst declared" in capsys.readouterr().out
    err = _bad(tmp_path, capsys, text + '[measures]\nburst = "z"\n')
    assert "measures.burst" in err


def test_missing_or_unreadable_trace(tmp_path, capsys):
    err = _bad(tmp_path, capsys, '[workload]\ntrace = "nowhere.csv"\n')
    assert "bad.toml" in err and "workload.trace" in err and "nowhere.csv" in err
    os.mkdir(tmp_path / "adir.csv")
    err = _bad(tmp_path, capsys, '[workload]\ntrace = "adir.csv"\n')
    assert "adir.csv" in err
    write(tmp_path / "bin.csv", "")
    with open(tmp_path / "bin.csv", "wb") as f:
        f.write(b"\xff\xfe\x00\x81")
    err = _bad(tmp_path, capsys, '[workload]\ntrace = "bin.csv"\n')
    assert "bin.csv" in err


@pytest.mark.parametrize("row,what", [
    ("-1.0,100,10", "non-negative time"),
    ("abc,100,10", "neither seconds nor a date-time"),
    ("0.5,100,10", "earlier than the row before"),
    ("2.0,0,10", "num_prefill_tokens"),
    ("2.0,100,-3", "num_decode_tokens"),
    ("2.0,1e2x,5", "num_prefill_tokens"),
])
def test_bad_trace_rows_name_their_line(tmp_path, capsys, row, what):
    write(tmp_path / "t.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,5\n1.0,100,5\n" + row + "\n")
    err = _bad(tmp_path, capsys, replay_text("t.csv"))
    assert "line 4" in err and what in err and "t.csv" in err


def replay_text(name):
    return (f'[workload]\ntrace = "{name}"\n[measures]\nburst_start_s = 0.0\nburst_end_s = 1.0\n'
            'hold_end_s = 10.0\n')


@pytest.mark.parametrize("text", ["", "arrived_at,num_prefill_tokens,num_decode_tokens\n"])
def test_empty_trace(tmp_path, capsys, text):
    write(tmp_path / "e.csv", text)
    err = _bad(tmp_path, capsys, replay_text("e.csv"))
    assert "empty trace" in err and "e.csv" in err


def test_a_trace_with_unknown_columns(tmp_path, capsys):
    write(tmp_path / "c.csv", "time,prompt,response\n0,1,1\n")
    err = _bad(tmp_path, capsys, replay_text("c.csv"))
    assert "arrived_at" in err and "TIMESTAMP" in err


def test_kv_cache_too_small_for_one_request(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "[engine]\nkv_cache_tokens = 16000\n")
    assert "max_model_len" in err and "engine" in err and "bad.toml" in err
    err = _bad(tmp_path, capsys, "[engine]\nnum_gpu_blocks = 100\nkv_cache_tokens = 16000\n")
    assert "one way" in err


def test_bad_toml_and_unknown_scenario(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "[client\n")
    assert "not valid TOML" in err
    err = _bad(tmp_path, capsys, path=str(tmp_path / "nothing.toml"))
    assert "nothing.toml" in err


def test_bad_input_on_every_command(tmp_path, capsys):
    f = write(tmp_path / "bad.toml", "[client]\ndeadline = 60\n")
    out = str(tmp_path / "x.parquet")
    for argv in (["diagnose"], ["capacity"], ["latency", "--rate", "1"], ["scenario", "check", f],
                 ["sweep", "--conditions", "cancel", "--out", out],
                 ["validate", "--engine", "http://127.0.0.1:9", "--points", "cancel"]):
        full = argv + (["--scenario", f] if argv[0] != "scenario" else [])
        assert main(full) == 2
        assert "deadline_s" in capsys.readouterr().err
    assert not os.path.exists(out)


def test_sweep_rows_carry_the_scenario_and_resume(tmp_path, capsys):
    from sim.experiments import sweep as sw
    f = write(tmp_path / "s.toml", '[workload]\nphases = [{name = "a", duration_s = 60.0, load = 0.5}, '
                                   '{name = "b", duration_s = 30.0, load = 2.0}, {name = "c", duration_s = 120.0, '
                                   'load = 0.5}]\n[client]\ndeadline_s = 30.0\n[measures]\nburst = "b"\n')
    out = str(tmp_path / "s.parquet")
    argv = ["sweep", "--scenario", f, "--conditions", "no-retry", "--out", out, "--workers", "1", "--quiet"]
    assert main(argv) == 0 and main(argv) == 0
    assert "1 already in" in capsys.readouterr().out
    (row,) = sw.read_rows(out)
    dep = load(f)
    assert row["scenario_name"] == "s" and row["scenario_hash"] == dep.content_hash and row["pulse"] == 2.0
    ref = sw.flatten(dep.run(0, "no-retry"))
    assert row["hold_delivered"] == ref["hold_delivered"] and row["attempts_sent"] == ref["attempts_sent"]


def test_from_document_raises_scenario_error():
    with pytest.raises(ScenarioError, match="proxy.condition"):
        from_document({"proxy": {"condition": "cancle"}}, "doc")


# ------------------------------------------------------------------ prefix groups
@pytest.mark.parametrize("groups,hits", [("a,b,a,b", 2 * 1600), ("a,a,a,a", 3 * 1600)])
def test_prefix_groups_share_their_own_prefix(tmp_path, groups, hits):
    rows = [(10.0 * i, 2000, 4, 1600, g) for i, g in enumerate(groups.split(","))]
    t = trace_file(tmp_path, rows, header="arrived_at,num_prefill_tokens,num_decode_tokens,prefix_tokens,prefix_group")
    dep = load(replay_toml(tmp_path, t, measures="burst_start_s = 0.0\nburst_end_s = 15.0\nhold_end_s = 40.0\n"))
    assert dep.trace().prefix_group.tolist() == [{"a": 0, "b": 1}[g] for g in groups.split(",")]
    rec = dep.run(0, "no-retry")
    assert rec["counters"]["prefix_cache_hits_total"] == hits


def test_generated_prefix_groups_follow_their_shares(tmp_path):
    dep = load(write(tmp_path / "g.toml", "[model]\ncapacity = 2.0\n[workload]\nprefix_groups = "
                                          "[{tokens = 3000, share = 0.25}, {tokens = 500, share = 0.75}]\n"))
    tr = dep.trace(0)
    assert tr.shared_prefix == 500 and set(tr.prefix_len.tolist()) == {3000, 500}
    assert (tr.prefix_len == np.array([3000, 500])[tr.prefix_group]).all() and (tr.prompt_len > tr.prefix_len).all()
    assert abs(np.mean(tr.prefix_group == 0) - 0.25) < 0.05
    back = load(write(tmp_path / "back.toml", dep.to_toml()))
    assert back.scenario == dep.scenario


def test_a_capacity_in_the_file_and_the_protocols(tmp_path):
    given = load(write(tmp_path / "c.toml", "[model]\ncapacity = 5.0\n[workload]\nmixed_share = 0.5\n"))
    assert given.capacity == 5.0 and given.trace(0).arrival.size > 0
    assert "capacity" not in given.with_changes(model="llama-3.1-8b").model      # another model: its own Ĉ


def test_prefix_group_shares_must_add_up(tmp_path, capsys):
    err = _bad(tmp_path, capsys, "[workload]\nprefix_groups = [{tokens = 3000, share = 0.5}]\n")
    assert "prefix_groups" in err and "add up to 1" in err


def test_a_scenarios_proxy_times_yield_to_an_explicit_deferral():
    from sim.conditions import compose
    small = load("cpu-small")
    assert small.condition_for("deferred").proxy.defer_s == 2.5
    assert small.condition_for("budget").proxy.budget_window_s == 15.0
    assert small.condition_for(compose("deferred", cancel="deferred:5")).proxy.defer_s == 5.0
    assert load("paper").condition_for("deferred") == compose("deferred", name="deferred")


def test_trace_speedup_needs_a_trace(tmp_path, capsys):
    assert main(["run", "--condition", "cancel", "--trace-speedup", "2"]) == 2
    assert "--trace-speedup" in capsys.readouterr().err


LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
                "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_hidden_layers": 16, "vocab_size": 128256, "torch_dtype": "bfloat16",
                "tie_word_embeddings": True}


def test_a_model_from_a_hf_config_is_a_prior(tmp_path, capsys):
    from llmsim.scenario_cmds import build_prior
    write(tmp_path / "config.json", json.dumps(LLAMA_CONFIG))
    f = write(tmp_path / "m.toml", '[model]\nhf_config = "config.json"\ngpu = "h100"\n')
    dep = load(f, build_prior=build_prior)
    assert dep.profile.provenance["kind"] == "roofline prior"
    assert needs_recalibration(dep.profile, dep.scenario)          # a prior's Ĉ is a placeholder
    assert dep.profile.engine["num_gpu_blocks"] > 0
    with pytest.raises(ScenarioError, match="needs the roofline prior"):
        load(f)
    for text, what in (('[model]\nhf_config = "config.json"\n', "model.gpu"),
                       ('[model]\nhf_config = "config.json"\ngpu = "h900"\n', "h900"),
                       ('[model]\nhf_config = "nothing.json"\ngpu = "h100"\n', "nothing.json")):
        err = _bad(tmp_path, capsys, text)
        assert what in err and "bad.toml" in err
