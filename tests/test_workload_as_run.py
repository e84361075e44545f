"""The workload as a load generator runs it (sim.workload, sim.latency,
docs/scenarios.md): a pool of whole prompts sent in turn, Poisson arrivals
with an exact count (inference-perf's `constant` load), stages that
start once the one before has drained, and calls as an engine's metrics
tell they came, seen in windows as its histograms see them."""
from __future__ import annotations

import numpy as np
import pytest

from llmsim.cli import main
from sim.latency import STRAIGHT, latency_stages, latency_windows
from sim.model import Run
from sim.profile import load_profile
from sim.scenario import PAPER, Lengths, Phase
from sim.workload import make_trace, poisson_exact_arrivals, pool_turns, uniform_exact_arrivals

POOL = PAPER.with_(prompt=Lengths("fixed", value=547), response=Lengths("fixed", value=8), shared_prefix=0,
                   prompt_pool=10, deadline_s=1e9, delivery_horizon_s=1e9)


def test_call_n_of_a_phase_sends_prompt_n_mod_the_pool():
    assert pool_turns([12, 3], 5).tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2]
    tr = make_trace(1.0, POOL, 0, phases=[(0, 10, 3.0, "poisson_exact"), (10, 20, 2.0, "poisson_exact")])
    assert len(tr) == 50
    assert tr.prompt_id.tolist() == [n % 10 for n in range(30)] + [n % 10 for n in range(20)]
    assert (tr.prompt_len == 547).all() and tr.shared_prefix == 0
    assert (tr.prefix_len == 0).all() and (tr.prefix_group == 0).all()      # no system prompt


def test_the_pool_lengths_are_drawn_once_and_repeat_with_their_prompt():
    sc = POOL.with_(prompt=Lengths("normal", mean=800, sd=200))
    tr = make_trace(1.0, sc, 3, phases=[(0, 20, 3.0)])
    for g in range(10):
        assert len(set(tr.prompt_len[tr.prompt_id == g].tolist())) == 1
    assert len(set(tr.prompt_len.tolist())) > 1


def test_repeated_prompts_hit_the_whole_prompt_in_the_prefix_cache():
    prof = load_profile("llama-3.1-8b")
    tr = make_trace(1.0, POOL, 0, phases=[(0, 10, 4.0, "poisson_exact")])
    log = Run(prof, tr, STRAIGHT, POOL, 0).run(until=1000.0)
    c = log.counters
    bs = prof.engine["block_size"]
    # 30 repeats of the 10 prompts, each hitting all its full blocks short of its last token
    assert c["prefix_cache_hits_total"] == 30 * ((547 - 1) // bs * bs)
    assert c["prefix_cache_queries_total"] == 40 * 547


def test_poisson_exact_arrivals_count_span_and_gaps():
    rng = np.random.default_rng(1)
    t = poisson_exact_arrivals(rng, 8.0, 100.0, 700.0)
    assert len(t) == 4800 and np.all(np.diff(t) >= 0)
    assert t[0] > 100.0 and t[-1] == pytest.approx(700.0, abs=1e-9) and t[-1] <= 700.0
    gaps = np.diff(np.concatenate([[100.0], t]))
    assert gaps.sum() == pytest.approx(600.0, rel=1e-12)
    # exponential-ish: the coefficient of variation near 1 and about e^-1 of the gaps beyond the mean
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1
    assert abs((gaps > gaps.mean()).mean() - np.exp(-1)) < 0.03
    assert len(poisson_exact_arrivals(rng, 0.5, 0.0, 5.0)) == 2 and len(poisson_exact_arrivals(rng, 0.1, 0, 5)) == 0


def test_uniform_exact_arrivals_are_a_poisson_process_given_its_count():
    rng = np.random.default_rng(2)
    # one call a phase: anywhere in it, not at its end (as poisson_exact puts its last call)
    one = np.array([uniform_exact_arrivals(rng, 0.6, 0.0, 2.0)[0] for _ in range(4000)])
    assert one.min() >= 0.0 and one.max() < 2.0 and abs(one.mean() - 1.0) < 0.05
    assert abs((one < 0.5).mean() - 0.25) < 0.03
    t = uniform_exact_arrivals(rng, 8.0, 100.0, 700.0)
    assert len(t) == 4800 and np.all(np.diff(t) >= 0) and 100.0 <= t[0] and t[-1] < 700.0
    gaps = np.diff(t)
    assert abs(gaps.std() / gaps.mean() - 1) < 0.1
    assert len(uniform_exact_arrivals(rng, 0.1, 0, 5)) == 0
    assert make_trace(1.0, PAPER, 0, phases=[(0, 2, 3.0, "uniform_exact")]).arrival.size == 6


def test_constant_keeps_its_fixed_interval():
    tr = make_trace(1.0, PAPER, 0, phases=[(0, 2, 2.0, "constant")])
    assert tr.arrival.tolist() == [0.0, 0.5, 1.0, 1.5]


def test_drained_stages_start_once_the_one_before_has_finished():
    prof = load_profile("llama-3.1-8b")
    stages = [(4.0, 10.0, "poisson_exact"), (200.0, 10.0, "poisson_exact"), (4.0, 10.0, "poisson_exact")]
    rows = latency_stages(prof, stages, POOL)
    assert [r["calls"] for r in rows] == [40, 2000, 40]
    # the overloaded stage takes long to drain: the stage after it starts only once it has
    assert rows[2]["start_s"] > rows[1]["start_s"] + 10.0 + rows[1]["e2e_p90"]
    # any gap past the drain gives the same run (an idle engine keeps no clock)
    again = latency_stages(prof, stages, POOL, gap_s=5000.0)
    assert [r["calls"] for r in again] == [40, 2000, 40] and again[2]["start_s"] > rows[2]["start_s"]
    assert [r["e2e_mean"] for r in again] == pytest.approx([r["e2e_mean"] for r in rows], rel=1e-8)


def test_a_drained_phase_refused_where_arrivals_are_planned():
    sc = POOL.with_(phases=(Phase(10.0, rate=1.0, name="a"), Phase(10.0, rate=1.0, name="b", drained=True)),
                    burst=None)
    with pytest.raises(ValueError, match="b starts drained"):
        make_trace(1.0, sc, 0)
    assert sc.phases[1].to_dict()["drained"] is True and "drained" not in sc.phases[0].to_dict()


def test_a_pools_prompts_start_with_their_system_prompts_dealt_equally_and_shuffled():
    sc = POOL.with_(prompt_pool=100, shared_prefix=100, prefix_groups=tuple((100, 1.0) for _ in range(10)))
    tr = make_trace(1.0, sc, 0, phases=[(0, 100, 2.0, "poisson_exact")])
    assert tr.prompt_id.tolist() == [n % 100 for n in range(200)]
    assert (tr.prefix_len == 100).all() and tr.shared_prefix == 100 and (tr.prompt_len == 547).all()
    first = tr.prefix_group[:100]
    assert sorted(np.bincount(first, minlength=10).tolist()) == [10] * 10     # 10 system prompts x 10 questions
    assert (tr.prefix_group[100:] == first).all()                             # a prompt keeps its system prompt
    assert first.tolist() != sorted(first.tolist())                           # dealt in a shuffled order
    # without groups the trace is the pool's as before: the groups draw after every other draw
    plain = make_trace(1.0, POOL.with_(prompt_pool=100), 0, phases=[(0, 100, 2.0, "poisson_exact")])
    assert (plain.arrival == tr.arrival).all() and (plain.max_tokens == tr.max_tokens).all()


def test_prompts_of_one_system_prompt_share_its_blocks_at_their_first_send():
    prof = load_profile("llama-3.1-8b")
    bs = prof.engine["block_size"]
    one = (100, 1.0)
    for groups, shared in ((None, 0), ((one, one), 100)):
        sc = POOL.with_(prompt_pool=10, shared_prefix=shared, prefix_groups=groups)
        tr = make_trace(1.0, sc, 0, phases=[(0, 10, 1.0, "poisson_exact")])     # each prompt sent once
        c = Run(prof, tr, STRAIGHT, sc, 0).run(until=1000.0).counters
        # two system prompts of 100 tokens (6 full blocks): each prompt after its system prompt's first hits them
        assert c["prefix_cache_hits_total"] == (0 if groups is None else (10 - 2) * (100 // bs * bs))


def test_pool_and_per_call_prompts_refused_together():
    with pytest.raises(ValueError, match="prompt_pool and mixed_share"):
        make_trace(1.0, POOL.with_(mixed_share=0.5), 0, phases=[(0, 5, 1.0)])
    with pytest.raises(ValueError, match="prompt_pool must be a whole number"):
        POOL.with_(prompt_pool=0)


SCENARIO = """
[model]
profile = "llama-3.1-8b"
[workload]
prompt = {{ dist = "fixed", value = 547 }}
response = {{ dist = "fixed", value = 8 }}
{extra}
phases = [ {{ name = "s0", rate = 4.0, duration_s = 10, arrivals = "{arrivals}" }},
           {{ name = "s1", rate = 8.0, duration_s = 10, arrivals = "poisson_exact", drained = true }} ]
"""


def test_latency_stages_from_a_scenario_file(tmp_path, capsys):
    f = tmp_path / "load.toml"
    f.write_text(SCENARIO.format(extra="prompt_pool = 100", arrivals="poisson_exact"))
    assert main(["latency", "--scenario", str(f), "--stages"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("s0: 4 calls/s (poisson_exact) for 10 s from 0.0 s, 40 calls")
    assert out[1].startswith("s1: 8 calls/s (poisson_exact, drained)") and "80 calls" in out[1]
    assert main(["run", "--scenario", str(f), "--condition", "cancel"]) == 2
    assert "phases[1].drained" in capsys.readouterr().err


@pytest.mark.parametrize("extra,arrivals,says", [
    ("prompt_pool = 0", "poisson", "workload.prompt_pool must be >= 1, got 0"),
    ("prompt_pool = 10", "exact", "workload.phases[0].arrivals must be one of poisson, constant, "
                                  "poisson_exact, uniform_exact, got 'exact'"),
    ("prompt_pool = 10\nmixed_share = 0.5", "poisson", "workload.mixed_share and workload.prompt_pool both given"),
])
def test_bad_workload_as_run_is_one_line(tmp_path, capsys, extra, arrivals, says):
    f = tmp_path / "bad.toml"
    f.write_text(SCENARIO.format(extra=extra, arrivals=arrivals))
    assert main(["latency", "--scenario", str(f), "--stages"]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


def test_windows_of_one_run_see_each_call_once_as_an_engines_histograms_do():
    """Calls as they came (a phase's count exact), in one run: a window's
    E2E mean is of the calls that finished in it, its TTFT's of those whose
    first token came in it; windows that cover the run see every call once,
    and one window over all of it gives the whole run's means."""
    prof = load_profile("vllm-cpu-tiny")
    sc = POOL.with_(prompt_pool=None, prompt=Lengths("fixed", value=600), response=Lengths("fixed", value=16))
    phases = [(0.0, 10.0, 10), (10.0, 14.0, 40), (14.0, 30.0, 20)]
    cuts = [(0.0, 10.0), (10.0, 20.0), (20.0, 1e6)]
    rows = latency_windows(prof, phases, cuts, scenario=sc, seed=3)
    assert sum(r["calls"] for r in rows) == sum(r["ttft_calls"] for r in rows) == 70
    (whole,) = latency_windows(prof, phases, [(0.0, 1e6)], scenario=sc, seed=3)
    assert whole["calls"] == 70
    mean = sum(r["e2e_mean"] * r["calls"] for r in rows) / 70
    assert mean == pytest.approx(whole["e2e_mean"], rel=1e-9)
    # the burst of 40 in 4 s queues: the window it ends in sees longer calls than the quiet one before
    assert rows[1]["e2e_mean"] > rows[0]["e2e_mean"]
    # a window where no call finished has no mean
    (empty,) = latency_windows(prof, phases, [(1e6, 2e6)], scenario=sc, seed=3)
    assert empty["calls"] == 0 and empty["e2e_mean"] is None and empty["ttft_mean"] is None


def test_a_phase_given_a_prefix_gives_its_calls_that_prefix():
    """A phase's calls share the prefix given with it (one prefix; 0: none):
    the same calls without one take longer to their first token."""
    prof = load_profile("vllm-cpu-tiny")
    sc = POOL.with_(prompt_pool=None, prompt=Lengths("fixed", value=2048), response=Lengths("fixed", value=8))
    phases, cuts = [(0.0, 20.0, 10), (20.0, 40.0, 0), (40.0, 60.0, 10)], [(0.0, 30.0), (30.0, 1e6)]
    shared = latency_windows(prof, [p + (1536,) for p in phases], cuts, scenario=sc, seed=1)
    mixed = latency_windows(prof, [p + (0 if p[0] == 40.0 else 1536,) for p in phases], cuts, scenario=sc, seed=1)
    assert [r["calls"] for r in shared] == [r["calls"] for r in mixed]
    assert mixed[0]["ttft_mean"] == pytest.approx(shared[0]["ttft_mean"], rel=1e-9)
    assert mixed[1]["ttft_mean"] > 1.5 * shared[1]["ttft_mean"]
