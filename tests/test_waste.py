"""Early termination, KV reservation and abort latency (docs/model.md#steady-load-cancellation-waste), on the
engine harness with exact numbers: every step takes 1 s, blocks hold 4
tokens, the token budget is 8, unless said otherwise."""
import pytest
from hypothesis import given, settings, strategies as st

from calibrate.prior import GPUS, MODELS, kv_cache
from engine_harness import Harness
from sim.engine.core import EngineConfig
from sim.engine.request import Request
from sim.engine.scheduler import Scheduler, SchedulerConfig
from sim.engine.step_time import StepTimeModel
from sim.experiments import waste as W
from sim.experiments.figures import waste_plot
from sim.profile import load_profile

MiB = 1024 ** 2


def test_llama3_8b_block_arithmetic():
    shape = MODELS["llama-3.1-8b"]
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype_bytes) == (32, 8, 128, 2)
    per_block = kv_cache(shape, GPUS["h100"], block_size=16)["bytes_per_block"]
    assert per_block == 2 * MiB
    # max_tokens 512 reserves 32 blocks beyond the prompt; finishing at 80 uses 5
    bs = 16
    h = Harness(num_gpu_blocks=100, block_size=bs, budget=64, kv_policy="reserve")
    rec = h.add(0.0, 0, prompt=16, max_tokens=512, stop_at=80)
    h.run()
    r = h.requests[0]
    assert r.reserve_top == 1 + 32                   # the prompt's block + 32 for max_tokens
    assert rec.fate == "completed" and rec.tokens_generated == 80
    used = -(-80 // bs)
    assert used == 5
    unused = 32 - used
    assert unused == 27 and unused * per_block == 54 * MiB
    # the gap series: 32 set aside at admission; once its 80 outputs are
    # scheduled (one closed-form run) 27 were never needed; all back at finish
    assert h.engine.gap_log == [(0, 0), (0.0, 32), (1.0, unused), (80.0, 0)]


def test_early_stop_counts_as_completed():
    h = Harness()
    a = h.add(0.0, 0, prompt=4, max_tokens=10, stop_at=3)
    b = h.add(0.0, 1, prompt=4, max_tokens=2, stop_at=5)   # max_tokens cuts first
    c = h.add(0.0, 2, prompt=4, max_tokens=10, stop_at=1)  # ends with its first token
    h.run()
    assert (a.fate, a.tokens_generated, a.finished_at) == ("completed", 3, 3.0)
    assert (b.fate, b.tokens_generated, b.finished_at) == ("completed", 2, 2.0)
    assert (c.fate, c.tokens_generated, c.finished_at) == ("completed", 1, 2.0)   # budget: step 1
    assert h.sched.block_pool.num_free == 100


def test_stop_at_must_be_positive():
    with pytest.raises(ValueError):
        Request(0, 0, 4, 10, stop_at=0)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("fast_forward", [True, False])
def test_v0_abort_takes_one_more_step_than_v1(depth, fast_forward):
    out = {}
    for lat in ("v1", "v0"):
        h = Harness(depth=depth, abort_latency=lat, fast_forward=fast_forward)
        a = h.add(0.0, 0, prompt=4, max_tokens=10)
        h.abort(3.5, 0)        # during step 3; outputs of steps 0..2 were streamed
        h.run()
        r = h.requests[0]
        out[lat] = (a.fate, a.finished_at, a.tokens_generated, r.num_output_tokens, r.outputs_seen,
                    h.sched.num_steps)
    # v1: applied at the end of step 3; steps 3 (and 4 at depth 2) still hold it
    assert out["v1"] == ("aborted", 4.0, 4, 3 + depth, 3, 3 + depth)
    # v0: applied one iteration later, at the end of step 4: one more forward pass
    assert out["v0"] == ("aborted", 5.0, 5, 4 + depth, 3, 4 + depth)


def test_v0_abort_of_a_waiting_request_on_an_idle_engine_is_immediate():
    h = Harness(num_gpu_blocks=2, abort_latency="v0")
    a = h.add(0.0, 0, prompt=12, max_tokens=1)      # needs 3 blocks: never fits
    h.abort(2.0, 0)
    h.run()
    assert (a.fate, a.finished_at) == ("aborted", 2.0)


def test_reserve_waits_for_the_whole_reservation():
    out = {}
    for policy in ("on-demand", "reserve"):
        h = Harness(num_gpu_blocks=10, kv_policy=policy, budget=64)
        a = h.add(0.0, 0, prompt=8, max_tokens=20, stop_at=5)   # reserve: 7 blocks
        b = h.add(0.0, 1, prompt=8, max_tokens=20, stop_at=3)   # 7 more do not fit
        h.run()
        out[policy] = (a.finished_at, b.first_scheduled_at, b.finished_at, h.sched.num_preemptions)
    assert out["on-demand"] == (5.0, 0.0, 3.0, 0)
    assert out["reserve"] == (5.0, 5.0, 8.0, 0)


def test_reservation_gap_series():
    h = Harness(num_gpu_blocks=10, kv_policy="reserve", budget=64)
    h.add(0.0, 0, prompt=8, max_tokens=20, stop_at=5)
    h.add(0.0, 1, prompt=8, max_tokens=20, stop_at=3)
    h.run()
    # A holds 2 prompt blocks of 7 reserved (gap 5); its outputs 1..4 need a
    # third block (gap 4); B likewise once A has returned the rest
    assert h.engine.gap_log == [(0, 0), (0.0, 5), (1.0, 4), (5.0, 5), (6.0, 4), (8.0, 0)]


def test_on_demand_logs_no_gap():
    h = Harness()
    h.add(0.0, 0, prompt=8, max_tokens=3)
    h.run()
    assert h.engine.gap_log == []


def test_bad_policy_names_are_refused():
    with pytest.raises(ValueError):
        SchedulerConfig(kv_policy="eager")
    with pytest.raises(ValueError):
        EngineConfig(SchedulerConfig(), abort_latency="v2")


def _first_step_admitted(reqs, policy, blocks, budget):
    s = Scheduler(SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=budget, num_gpu_blocks=blocks,
                                  block_size=4, kv_policy=policy), StepTimeModel(1.0, 0, 0, 0, 0))
    for i, (p, m) in enumerate(reqs):
        s.add_request(Request(i, i, p, m))
    admitted = []
    for _ in range(6):          # a few steps: the decode group grows, requests finish
        plan = s.schedule()
        if plan is None:
            break
        admitted.append(len(s.running))
        if policy == "reserve":     # every seat's whole reservation fits in the pool
            assert sum(r.reserve_top for r in s.running) <= blocks
            assert s.reservation_gap(plan.last) <= s.block_pool.num_free
        for r in plan.finishing:
            s.finish(r, plan.last)
    return admitted


@settings(max_examples=150, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=1, max_size=12),
       blocks=st.integers(12, 80), budget=st.integers(8, 200))
def test_reserve_never_admits_more_than_on_demand(reqs, blocks, budget):
    on_demand = _first_step_admitted(reqs, "on-demand", blocks, budget) or [0]
    reserve = _first_step_admitted(reqs, "reserve", blocks, budget) or [0]
    # from the same state, the reservation check is the stricter one
    assert reserve[0] <= on_demand[0]



@pytest.mark.parametrize("policy", ["on-demand", "reserve"])
def test_reserve_never_preempts_and_frees_everything(policy):
    h = Harness(num_gpu_blocks=12, budget=16, kv_policy=policy)
    for i in range(6):
        h.add(0.5 * i, i, prompt=6, max_tokens=12, stop_at=4 + i)
    h.run()
    recs = [h.requests[i].record for i in range(6)]
    assert all(r.fate == "completed" and r.tokens_generated == 4 + i for i, r in enumerate(recs))
    assert h.sched.block_pool.num_free == 12
    if policy == "reserve":
        assert h.sched.num_preemptions == 0


# ------------------------------------------------------------- the study


def test_sharegpt_fit_matches_stated_means():
    calls = W.make_calls(200.0, 100.0, max_tokens=100_000, stop_rate=0.0, tpot_s=0.01, seed=3)
    assert abs(calls["prompt"].mean() / W.SHAREGPT["prompt_mean"] - 1) < 0.05
    assert abs(calls["length"].mean() / W.SHAREGPT["response_mean"] - 1) < 0.05
    assert calls["ended"].all()
    cut = W.make_calls(200.0, 100.0, max_tokens=200, stop_rate=0.5, tpot_s=0.01, seed=3)
    assert 0.4 < cut["stopped"].mean() < 0.6
    assert ((cut["length"] >= 200) == ~cut["ended"]).all()


@pytest.fixture(scope="module")
def small_study():
    prof = load_profile("llama-3.1-8b")
    return W.waste_study(prof, [0.0, 0.3], rate=8.0, duration_s=60.0, warmup_s=10.0, max_tokens=512, seed=1)


def test_study_reports_every_setting_and_the_waste_metrics(small_study):
    rows = small_study["results"]
    assert {(r["kv_policy"], r["abort_latency"]) for r in rows} == set(W.SETTINGS)
    for r in rows:
        for k in ("abort_rate", "completion_ratio", "useful_token_ratio", "useful_tokens_per_s",
                  "discarded_busy_share", "queueing_delay_mean_s", "throughput_loss", "busy_fraction"):
            assert r[k] is not None and r[k] >= 0 or k == "throughput_loss"
        assert r["useful_token_ratio"] <= r["completion_ratio"] <= 1
        assert r["unfinished"] == 0
        if r["cancel_rate"] == 0:
            assert r["abort_rate"] == 0 and r["discarded_busy_share"] == 0 and r["throughput_loss"] == 0
        else:
            assert 0 < r["abort_rate"] <= 0.4 and r["discarded_busy_share"] > 0
        if r["kv_policy"] == "on-demand":
            assert r["reservation_gap_mean_blocks"] == 0
        else:
            assert r["reservation_gap_mean_blocks"] > 0
    by = {(r["kv_policy"], r["abort_latency"], r["cancel_rate"]): r for r in rows}
    for kv in W.KV_POLICIES:
        # v0 keeps aborted requests one more step: at least as much discarded work
        assert by[(kv, "v0", 0.3)]["discarded_busy_share"] >= by[(kv, "v1", 0.3)]["discarded_busy_share"]
        # without cancellations the abort latency changes nothing
        assert by[(kv, "v0", 0.0)]["useful_tokens_per_s"] == by[(kv, "v1", 0.0)]["useful_tokens_per_s"]


def test_table_and_plot_come_from_the_record(small_study, tmp_path):
    import json
    rec = json.loads(json.dumps(small_study))
    text = W.table(rec)
    assert text.count("\n") == 2 + len(rec["results"])
    out = tmp_path / "w.png"
    waste_plot(rec, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_waste_refuses_bad_rates(capsys):
    from llmsim.cli import main
    assert main(["waste", "--model", "llama-3.1-8b", "--cancel-rate", "0,1.5"]) == 2
    assert "rates must lie in [0, 1]" in capsys.readouterr().err
