"""Engine semantics on hand-built tiny scenarios with exact expected numbers.
Unless said otherwise every step takes 1 s, blocks hold 4 tokens, the token
budget is 8 and one step is in flight (depth 1)."""
import math

import pytest

from engine_harness import Harness


@pytest.mark.parametrize("depth", [1, 2])
def test_chunked_prefill_splits_prompt_under_budget(depth):
    h = Harness(depth=depth)
    a = h.add(0.0, 0, prompt=20, max_tokens=3)
    h.run()
    assert h.requests[0].chunks == [[0, 8], [1, 8], [2, 4]]
    assert a.prompt_computed == 20
    assert a.first_scheduled_at == 0.0
    assert a.first_token_at == 3.0          # end of the step that completes the prefill
    assert a.finished_at == 5.0             # then one token per step
    assert a.tokens_generated == 3 and a.fate == "completed"
    assert h.sched.num_steps == 5


def test_running_requests_are_served_before_waiting_ones():
    h = Harness()
    a = h.add(0.0, 0, prompt=6, max_tokens=2)
    b = h.add(0.0, 1, prompt=10, max_tokens=2)
    h.run()
    # step 0: A 6 + B 2 (budget left); step 1: A decodes 1, B takes the other 7
    assert h.requests[1].chunks == [[0, 2], [1, 7], [2, 1]]
    assert (a.first_token_at, a.finished_at) == (1.0, 2.0)
    assert (b.first_token_at, b.finished_at) == (3.0, 4.0)


def test_head_of_line_blocking_when_whole_prompt_does_not_fit():
    h = Harness(num_gpu_blocks=10, budget=64)
    h.add(0.0, 0, prompt=30, max_tokens=10)     # 8 blocks, grows to 10 while decoding
    b = h.add(0.5, 1, prompt=12, max_tokens=1)  # needs 3 blocks: only 2 free
    c = h.add(0.6, 2, prompt=4, max_tokens=1)   # needs 1 block and 1 is free, but B is ahead
    h.run()
    assert h.requests[0].record.finished_at == 10.0
    assert b.first_scheduled_at == 10.0
    assert c.first_scheduled_at == 10.0


def test_preemption_takes_most_recent_and_returns_it_to_the_front():
    h = Harness(num_gpu_blocks=6, budget=64)
    a = h.add(0.0, 0, prompt=8, max_tokens=10)
    b = h.add(0.0, 1, prompt=8, max_tokens=10)
    c = h.add(5.5, 2, prompt=4, max_tokens=1)   # arrives after the preemption, queues behind B
    h.run()
    assert h.sched.num_preemptions == 1
    assert (a.preemptions, b.preemptions) == (0, 1)
    assert a.finished_at == 10.0
    # B left with 5 outputs (13 tokens); at step 9 A evicted the top block of
    # B's cached prompt, so B's readmission at step 10 hits one block
    assert b.prefix_hit_tokens == 4
    assert b.prompt_computed == 8 + (13 - 4)
    assert b.first_scheduled_at == 0.0
    assert b.finished_at == 15.0 and b.tokens_generated == 10
    assert c.first_scheduled_at == 10.0       # behind B at the head of the queue
    # queries count each request once, at its first admission
    assert h.sched.counters["prefix_cache_queries_total"] == 8 + 8 + 4
    assert h.sched.counters["prefix_cache_hits_total"] == 0


def test_prefix_cache_hit_on_shared_prefix():
    h = Harness(budget=64)
    h.add(0.0, 0, prompt=12, max_tokens=1, prefix=8)
    b = h.add(2.0, 1, prompt=12, max_tokens=1, prefix=8)
    h.run()
    assert b.prefix_hit_tokens == 8
    assert b.prompt_computed == 4
    assert h.sched.counters["prefix_cache_hits_total"] == 8
    assert h.sched.counters["prefix_cache_queries_total"] == 24


def test_retry_hits_its_aborted_predecessors_blocks():
    h = Harness(budget=64)
    a = h.add(0.0, 0, prompt=16, max_tokens=5, call=7)
    h.abort(1.5, 0)
    b = h.add(3.0, 1, prompt=16, max_tokens=1, call=7)   # same call: same prompt
    c = h.add(3.0, 2, prompt=16, max_tokens=1, call=8)   # another call
    h.run()
    assert a.fate == "aborted" and a.finished_at == 2.0
    assert b.prefix_hit_tokens == 12        # all but the last token, in whole blocks
    assert b.prompt_computed == 4
    assert c.prefix_hit_tokens == 0


def test_freed_blocks_are_evicted_tail_first():
    h = Harness(num_gpu_blocks=8, budget=64)
    h.add(0.0, 0, prompt=17, max_tokens=1, call=1)   # 5 blocks: 4 full prompt blocks + a partial one
    h.add(2.0, 1, prompt=20, max_tokens=1, call=2)   # 5 blocks: evicts 3 never-used, the partial, and A's block 3
    b = h.add(4.0, 2, prompt=17, max_tokens=1, call=1)
    h.run()
    assert b.prefix_hit_tokens == 12        # blocks 0-2 survived, block 3 went first
    assert h.sched.block_pool.evicted >= 1


def test_abort_while_waiting_computes_nothing():
    h = Harness()
    h.add(0.0, 0, prompt=64, max_tokens=1)           # takes the whole budget for 8 steps
    b = h.add(0.5, 1, prompt=8, max_tokens=1)
    h.abort(2.5, 1)
    h.run()
    assert b.fate == "aborted" and b.finished_at == 3.0
    assert b.prompt_computed == 0
    assert math.isnan(b.first_scheduled_at)
    assert h.engine.aborted_before_scheduled == 1


@pytest.mark.parametrize("depth,computed,in_flight", [(1, 24, 8), (2, 32, 16)])
def test_abort_counts_steps_in_flight(depth, computed, in_flight):
    # the abort arrives during step 2: steps 0-1 finished before it (body);
    # step 2 and, at depth 2, step 3 were issued before it and finish after
    h = Harness(depth=depth)
    a = h.add(0.0, 0, prompt=40, max_tokens=1)
    h.abort(2.5, 0)
    h.run()
    assert a.fate == "aborted" and a.finished_at == 3.0
    assert a.prompt_computed == computed
    assert a.prompt_in_flight == in_flight


def test_prompt_tokens_total_misses_prompt_aborted_before_first_output():
    h = Harness()
    h.add(0.0, 0, prompt=40, max_tokens=1)
    h.abort(2.5, 0)
    h.add(4.0, 1, prompt=8, max_tokens=1)
    h.run()
    c = h.sched.counters
    assert c["prompt_tokens_total"] == 8
    assert c["prefix_cache_queries_total"] == 48


def test_abort_at_depth_two_leaves_after_next_step():
    # a decoding request aborted during step k still runs in steps k and k+1
    h = Harness(depth=2)
    a = h.add(0.0, 0, prompt=8, max_tokens=50)
    h.abort(5.5, 0)
    h.run()
    assert a.finished_at == 6.0
    assert a.tokens_generated == 6       # outputs of steps 0-5; step 6's is discarded
    assert h.sched.num_steps == 7        # steps 0..6 ran


def test_engine_cap_refuses_beyond_q():
    h = Harness(max_queued=2)
    h.add(0.0, 0, prompt=64, max_tokens=1)
    h.add(0.1, 1, prompt=8, max_tokens=1)
    h.add(0.2, 2, prompt=8, max_tokens=1)
    h.run()
    assert h.refused == [2]


@pytest.mark.parametrize("depth", [1, 2])
def test_fast_forward_matches_single_steps(depth):
    from sim.engine.step_time import StepTimeModel
    model = StepTimeModel(0.01, 0.001, 0.0001, 1e-7, 1e-6)
    out, events = [], []
    for ff in (True, False):
        h = Harness(num_gpu_blocks=60, budget=32, depth=depth, model=model, fast_forward=ff)
        recs = [h.add(0.05 * i, i, prompt=20 + 3 * i, max_tokens=30 + 7 * i) for i in range(8)]
        h.abort(0.7, 3)
        h.run()
        out.append([(r.first_token_at, r.finished_at, r.tokens_generated, r.prompt_computed, r.preemptions)
                    for r in recs] + [h.sched.num_steps, h.sched.num_preemptions])
        events.append(h.engine.num_step_events)
    assert out[0][-2:] == out[1][-2:]
    assert events[1] == out[1][-2] and events[0] < events[1] / 2   # decode steps were fast-forwarded
    for x, y in zip(out[0][:-2], out[1][:-2]):
        assert x[2:] == y[2:]
        assert x[0] == pytest.approx(y[0], rel=1e-12) and x[1] == pytest.approx(y[1], rel=1e-12)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("bound", ["seats", "blocks"])
def test_requests_added_while_admission_is_blocked_do_not_cut_a_fast_forward(depth, bound):
    # two long decoders hold the engine (every seat, or the blocks the next
    # prompt needs); requests keep arriving every 0.3 s and wait. With the
    # engine told when the next abort comes, the arrivals no longer cut
    # the decode stretches into single steps, and the run is the same as
    # stepping one step at a time: the same requests served at the same
    # times, the waiting queue logged at the same boundaries
    from sim.engine.step_time import StepTimeModel
    model = StepTimeModel(0.1, 0.001, 0.0001, 1e-7, 1e-6)
    # seats: both taken; blocks: a waiting prompt needs 50 of the 44 (then fewer) left free
    seats, blocks, prompt = (2, 200, 40) if bound == "seats" else (16, 64, 200)
    runs = {}
    for ff, abort_bound in ((False, False), (True, False), (True, True)):
        h = Harness(num_gpu_blocks=blocks, budget=64, max_num_seqs=seats, depth=depth, model=model,
                    fast_forward=ff, abort_bound=abort_bound)
        recs = [h.add(0.0, 0, prompt=40, max_tokens=60), h.add(0.0, 1, prompt=40, max_tokens=80)]
        recs += [h.add(0.15 + 0.3 * i, 2 + i, prompt=prompt, max_tokens=5) for i in range(20)]
        # aborts of a waiting request and a decoding one: a stretch runs up to them
        h.abort(2.02, 4)
        h.abort(4.04, 1)
        h.abort(30.0, 21)
        h.run()
        runs[ff, abort_bound] = (recs, h)
    (slow, hs), (ff_any, h_any), (ff_abort, h_abort) = runs[False, False], runs[True, False], runs[True, True]
    # each of the 20 arrivals cuts a stretch when any input bounds it
    assert h_abort.engine.num_step_events <= h_any.engine.num_step_events - 15
    for recs, h in ((ff_any, h_any), (ff_abort, h_abort)):
        assert h.sched.num_steps == hs.sched.num_steps
        for x, y in zip(recs, slow):
            assert (x.fate, x.tokens_generated, x.prompt_computed) == (y.fate, y.tokens_generated, y.prompt_computed)
            for a, b in ((x.first_scheduled_at, y.first_scheduled_at), (x.first_token_at, y.first_token_at),
                         (x.finished_at, y.finished_at)):
                assert a == pytest.approx(b, rel=1e-9, nan_ok=True)
        assert [g[1:] for g in h.engine.gauge_log] == [g[1:] for g in hs.engine.gauge_log]
        assert [g[0] for g in h.engine.gauge_log] == pytest.approx([g[0] for g in hs.engine.gauge_log], rel=1e-9)
    assert max(g[1] for g in hs.engine.gauge_log) >= 10      # requests did wait


class RecordingModel:
    """A step-time model that notes each single step's composition."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        for k in ("fixed_s", "per_request_s", "per_token_s", "per_prefill_pair_s", "per_decode_ctx_s"):
            setattr(self, k, getattr(inner, k))

    def duration(self, num_reqs, num_tokens, pairs, decode_ctx):
        self.calls.append((num_reqs, num_tokens, decode_ctx))
        return self.inner.duration(num_reqs, num_tokens, pairs, decode_ctx)

    def fast_forward_duration(self, num_decode_reqs, decode_context, num_steps):
        raise AssertionError("stepping one step at a time")


def test_decode_context_counts_only_requests_decoding_in_the_step():
    """A request whose prefill completes in step S decodes from S+1: step S's
    decode context is that of the requests already decoding, however late in
    the run S falls."""
    from sim.engine.step_time import StepTimeModel
    model = RecordingModel(StepTimeModel(0.1, 0.0, 0.0, 0.0, 1e-5))
    h = Harness(num_gpu_blocks=200, block_size=4, budget=16, model=model, fast_forward=False)
    h.add(0.0, 1, prompt=8, max_tokens=300)         # A: prefill in step 0, decodes in steps 1..299
    h.add(20.05, 2, prompt=8, max_tokens=3)         # B: prefill in step k, decodes in k+1, k+2
    h.run()
    calls = model.calls
    k = next(s for s, c in enumerate(calls) if s > 0 and c[1] == 9)    # A's decode + B's 8 prompt tokens
    assert k > 100                                  # late enough for a wrong context to show
    for s, (nreq, ntok, ctx) in enumerate(calls):
        want = (8 + s if 1 <= s <= 299 else 0) + (s - k + 8 if k + 1 <= s <= k + 2 else 0)
        assert ctx == want, (s, nreq, ntok, ctx, want)


# ------------------------------------------------------------ fault injection

def _leak_run(leak, n=10):
    h = Harness(num_gpu_blocks=16, budget=64, leak_blocks_on_abort=leak)
    recs = [h.add(2.0 * i + 0.5, i, prompt=12, max_tokens=20) for i in range(n)]
    for i in range(4):                  # the first four are cancelled after two steps
        h.abort(2.0 * i + 2.0, i)
    h.run(until=200.0)
    return h, recs


def test_block_leak_on_abort_stops_admission_for_good():
    # each of the first four holds 4 blocks (3 prompt blocks, then a 4th for
    # its 13th token) when its abort is applied at the end of its second step
    h, recs = _leak_run(leak=True)
    ttft = [r.first_token_at - r.created_at for r in recs]
    assert ttft[:4] == [1.0] * 4
    assert all(math.isnan(t) for t in ttft[4:])          # never served: no recovery
    assert h.sched.block_pool.num_free == 0 and h.sched.kv_cache_manager.num_leaked_blocks == 16
    assert h.sched.block_pool.usage() == 1.0
    t, waiting, running = h.engine.gauge_log[-1]
    assert (waiting, running) == (6, 0)                  # every later arrival waits, nothing runs
    # the waiting queue only grows once admission has stopped
    after = [w for t, w, r in h.engine.gauge_log if t >= 8.5]
    assert after == sorted(after) and after[-1] == 6


def test_without_the_leak_aborted_blocks_come_back():
    h, recs = _leak_run(leak=False)
    assert not any(math.isnan(r.first_token_at) for r in recs)
    assert [r.fate for r in recs] == ["aborted"] * 4 + ["completed"] * 6
    assert h.sched.block_pool.num_free == 16 and h.sched.kv_cache_manager.num_leaked_blocks == 0
    assert h.engine.gauge_log[-1][1:] == (0, 0)


@pytest.mark.parametrize("fast_forward", [True, False])
def test_stall_delays_the_step_after_it_begins(fast_forward):
    # steps of 1 s: step 2 runs [2, 3) across the stall's start at 2.5; the
    # boundary at 3 falls in the stall, so step 3 starts at 6.5
    h = Harness(stalls=[(2.5, 4.0)], fast_forward=fast_forward)
    a = h.add(0.0, 0, prompt=8, max_tokens=10)
    b = h.add(4.0, 1, prompt=4, max_tokens=1)           # arrives during the stall
    h.run()
    assert a.first_token_at == 1.0
    assert a.finished_at == 6.5 + 7                      # steps 3..9 after the stall
    assert b.first_scheduled_at == 6.5 and b.first_token_at == 7.5
    assert h.sched.num_steps == 10


@pytest.mark.parametrize("fast_forward", [True, False])
def test_stall_at_depth_two_lets_the_queued_step_run_and_holds_the_next(fast_forward):
    # steps 0, 1 are launched at 0; step k+2 at the end of step k. Steps 2
    # [2, 3) and 3 [3, 4) are on the device when the stall begins at 2.5; the
    # boundary at 3 is handled at 6.5, so step 4 starts at 6.5
    h = Harness(depth=2, stalls=[(2.5, 4.0)], fast_forward=fast_forward)
    a = h.add(0.0, 0, prompt=8, max_tokens=10)
    h.run()
    assert a.first_token_at == 1.0
    assert a.finished_at == 6.5 + 6                      # steps 4..9 after the stall
    assert h.sched.num_steps == 10


@pytest.mark.parametrize("depth", [1, 2])
def test_stall_gives_the_same_run_with_and_without_fast_forward(depth):
    from sim.engine.step_time import StepTimeModel
    model = StepTimeModel(0.01, 0.001, 0.0001, 1e-7, 1e-6)
    out = []
    for ff in (True, False):
        h = Harness(num_gpu_blocks=60, budget=32, depth=depth, model=model, fast_forward=ff,
                    stalls=[(0.9, 0.5), (2.0, 0.25)])
        recs = [h.add(0.05 * i, i, prompt=20 + 3 * i, max_tokens=30 + 7 * i) for i in range(8)]
        h.run()
        out.append([(r.first_token_at, r.finished_at, r.tokens_generated) for r in recs] + [h.sched.num_steps])
    assert out[0][-1] == out[1][-1]
    for x, y in zip(out[0][:-1], out[1][:-1]):
        assert x[2] == y[2]
        assert x[0] == pytest.approx(y[0], rel=1e-12) and x[1] == pytest.approx(y[1], rel=1e-12)


def test_stall_must_be_a_pair_of_times():
    from sim.engine.core import EngineConfig
    from sim.engine.scheduler import SchedulerConfig
    for bad in ([(1.0,)], [(1.0, 0.0)], [(-1.0, 2.0)], [(float("nan"), 1.0)], [("x", 1.0)]):
        with pytest.raises(ValueError):
            EngineConfig(SchedulerConfig(), stalls=bad)
    assert EngineConfig(SchedulerConfig(), stalls=[(5, 1), (1, 2)]).stalls == ((1.0, 2.0), (5.0, 1.0))


# ------------------------------------------------------ the engine's parts

def test_kv_cache_manager_verbs():
    from sim.engine.kv_cache_manager import KVCacheManager
    from sim.engine.request import Request
    kv = KVCacheManager(num_gpu_blocks=10, block_size=4)
    a = Request(0, 1, 12, 4)
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 12, 0, [])              # admission: 3 blocks
    a.num_computed_tokens = 12
    assert kv.num_free_blocks == 7
    kv.free(a)
    assert kv.num_free_blocks == 10
    retry = Request(1, 1, 12, 4)                        # same call: same prompt
    blocks, num_computed = kv.get_computed_blocks(retry)
    assert num_computed == 8                            # whole blocks, the last token left to compute
    assert kv.allocate_slots(retry, 4, num_computed, blocks)
    assert kv.num_free_blocks == 7                      # 2 blocks taken back from the free queue, 1 new
    big = Request(2, 2, 40, 4)                          # needs 10 blocks, 7 free
    assert not kv.allocate_slots(big, 40, 0, [])
    assert kv.num_free_blocks == 7 and big.blocks == []  # nothing taken


def test_preempted_request_waits_at_the_front_with_status_preempted():
    from sim.engine.request import PREEMPTED, RUNNING, Request
    from sim.engine.scheduler import Scheduler, SchedulerConfig
    from sim.engine.step_time import StepTimeModel
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, num_gpu_blocks=5, block_size=4),
                  StepTimeModel(1.0, 0, 0, 0, 0))
    a, b = Request(0, 0, 8, 10), Request(1, 1, 8, 10)
    s.add_request(a)
    s.add_request(b)
    for _ in range(6):                                  # each needs a third block at its 9th token
        out = s.schedule()
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1 and out.first_step == 1
    assert (a.status, b.status) == (RUNNING, PREEMPTED)
    assert s.waiting[0] is b and b.num_computed_tokens == 0 and b.blocks == []


def test_decode_group_aggregates():
    from sim.engine.decode_group import DecodeGroup
    from sim.engine.request import Request
    g = DecodeGroup(block_size=4)
    a, b = Request(0, 0, 6, 5), Request(1, 1, 9, 3)
    for r, step in ((a, 3), (b, 4)):
        r.num_computed_tokens, r.num_output_tokens = r.num_prompt_tokens, 1
        g.join(r, step)
    # step 5: a has 6 + 2 tokens before, reads 9; b has 9 + 1 before, reads 11
    assert g.context_sum(5) == 9 + 11
    assert g.new_blocks(5, 4) == 2                      # each needs one block every 4 steps
    assert (a.decode_last_step, b.decode_last_step) == (6, 5)
    assert g.finishing_at(5) == [b] and g.pop_done(6) == [b]
    g.leave(b, 5)
    assert (b.num_computed_tokens, b.num_output_tokens) == (11, 3)
    assert g.num_reqs == 1 and g.outputs_through(a, 4) == a.outputs_done + 2


def test_uncomputed_prompt_tokens_counted_once_between_boundaries_equals_a_fresh_count():
    """The engine counts the scheduler's uncomputed prompt tokens once per
    step boundary and keeps the inbox's share as requests come in; at every
    wait estimate of a run under the deadline queue (overload, preemption,
    aborts) the figure equals a count made from scratch, and so does the
    number of requests in the engine."""
    from sim.conditions import get_condition
    from sim.engine.request import WAITING_STATUSES
    from sim.model import Run
    from sim.profile import load_profile
    from sim.run import make_trace, workload_capacity
    from sim.scenario import PAPER

    def fresh(eng):
        s = eng.scheduler
        tok = sum(r.num_prompt_tokens - min(r.num_prompt_tokens, r.num_computed_tokens)
                  for r in s.waiting if r.status in WAITING_STATUSES)
        tok += sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in s.prefilling)
        return tok + sum(r.num_prompt_tokens for k, r in eng.inbox if k == "add")

    profile = load_profile("qwen2.5-7b")
    sc = PAPER.with_(pulse=2.7)
    cap = workload_capacity(profile, sc)["capacity"]
    run = Run(profile, make_trace(cap, sc, 3), get_condition("deadline-check"), sc, 3)
    seen = []
    counted = run.engine.uncomputed_prompt_tokens

    def checked():
        got = counted()
        seen.append((got, fresh(run.engine)))
        eng, s = run.engine, run.engine.scheduler
        held.append((eng.num_in_engine(),
                     s.num_waiting + len(s.running) + sum(1 for k, _ in eng.inbox if k == "add")))
        return got
    held = []
    run.engine.uncomputed_prompt_tokens = checked
    run.run(until=900.0)
    assert len(seen) > 1000 and any(g > 0 for g, _ in seen)
    assert [g for g, _ in seen] == [f for _, f in seen]
    # the requests in the engine, the inbox's kept as they come in: a fresh count too
    assert any(n > 100 for n, _ in held) and [n for n, _ in held] == [f for _, f in held]


@pytest.mark.parametrize("prefix_group", [0, 3])
def test_a_requests_kv_layout_names_the_block_pools_spaces(prefix_group):
    """The KV cache manager's layout of a request (its spaces computed inline)
    is the block pool's: its prefix group's, its call's and its own space."""
    from sim.engine.block_pool import call_space, exec_space, prefix_space
    from sim.engine.kv_cache_manager import KVCacheManager
    from sim.engine.request import Request
    r = Request(7, 5, 100, 10, shared_prefix=40, prefix_group=prefix_group)
    layout = KVCacheManager(64, 16, False)._layout(r)
    assert layout == (prefix_space(prefix_group), 40 // 16, call_space(5), 100 // 16, exec_space(7))
    assert len({layout[0], layout[2], layout[4]}) == 3


# ---------------------------------------------------------------- the frontend (engine.frontend_s)

@pytest.mark.parametrize("depth", [1, 2])
def test_a_request_reaches_the_scheduler_a_frontend_time_after_it_came_in(depth):
    plain, fe = Harness(depth=depth), Harness(depth=depth, frontend_s=0.25)
    recs = [(h.add(0.0, 0, prompt=20, max_tokens=3), h.add(1.5, 1, prompt=6, max_tokens=4)) for h in (plain, fe)]
    plain.run(), fe.run()
    for a, b in zip(*recs):
        # an idle engine at the start: the whole run 0.25 s later
        assert b.first_scheduled_at == a.first_scheduled_at + 0.25
        assert b.first_token_at == a.first_token_at + 0.25 and b.finished_at == a.finished_at + 0.25
    assert fe.requests[1].arrival_time == 1.75      # when it reached the scheduler


def test_a_request_in_the_frontend_joins_at_the_first_boundary_after_it():
    h = Harness(frontend_s=0.5)
    h.add(0.0, 0, prompt=4, max_tokens=5)          # steps [0.5, 1.5), [1.5, 2.5), ...
    b = h.add(1.2, 1, prompt=4, max_tokens=1)      # through the frontend by 1.7: joins at the boundary 2.5
    h.run()
    assert b.first_scheduled_at == 2.5 and b.first_token_at == 3.5


def test_an_abort_before_the_frontend_time_is_over_never_reaches_a_step():
    h = Harness(frontend_s=0.5)
    a = h.add(0.0, 0, prompt=8, max_tokens=3)
    b = h.add(0.2, 1, prompt=8, max_tokens=3)
    h.abort(0.4, 1)
    h.run()
    assert b.fate == "aborted" and b.finished_at == 0.4 and b.first_scheduled_at != b.first_scheduled_at
    assert h.requests[1].chunks == [] and h.engine.aborted_before_scheduled == 1
    assert a.fate == "completed" and h.sched.num_waiting == 0 and not h.sched.running
    assert h.engine.num_in_engine() == 0


def test_an_abort_after_the_frontend_time_applies_at_the_boundary_as_without_one():
    h = Harness(frontend_s=0.5)
    h.add(0.0, 0, prompt=8, max_tokens=6)          # steps from 0.5
    b = h.add(0.2, 1, prompt=8, max_tokens=3)      # reaches the scheduler at 0.7, during the first step
    h.abort(0.9, 1)                                # during that step too: both apply at its end, in order
    h.run()
    assert b.fate == "aborted" and b.finished_at == 1.5
    assert h.requests[1].chunks == [] and h.engine.aborted_before_scheduled == 1
    assert h.sched.num_waiting == 0


def test_requests_in_the_frontend_count_toward_the_engine_cap():
    h = Harness(frontend_s=0.5, max_queued=1)
    h.add(0.0, 0, prompt=8, max_tokens=2)
    h.add(0.1, 1, prompt=8, max_tokens=2)          # the first is still in the frontend: refused
    h.run()
    assert h.refused == [1]


@pytest.mark.parametrize("depth", [1, 2])
def test_fast_forward_with_a_frontend_matches_stepping_one_step_at_a_time(depth):
    runs = []
    for ff in (True, False):
        h = Harness(depth=depth, frontend_s=0.3, fast_forward=ff, budget=16)
        recs = [h.add(0.0, 0, prompt=8, max_tokens=40), h.add(0.05, 1, prompt=8, max_tokens=30),
                h.add(7.4, 2, prompt=12, max_tokens=5), h.add(9.95, 3, prompt=4, max_tokens=2)]
        h.abort(12.2, 0)
        h.run()
        runs.append([(r.first_scheduled_at, r.first_token_at, r.finished_at, r.fate) for r in recs])
    assert runs[0] == runs[1]


def test_a_bad_frontend_time_is_refused():
    with pytest.raises(ValueError, match="frontend_s"):
        Harness(frontend_s=-0.1)


def _with_frontend(frontend_s):
    import copy

    from sim.profile import from_dict, load_profile
    d = copy.deepcopy(load_profile("qwen2.5-7b").raw)
    d["engine"]["frontend_s"] = frontend_s
    return from_dict(d, "test")


def test_a_profiles_frontend_is_on_every_calls_way_in():
    from sim.latency import latency
    from sim.profile import load_profile
    plain, fe = load_profile("qwen2.5-7b"), _with_frontend(0.02)
    assert plain.frontend_s == 0.0 and fe.frontend_s == 0.02
    a, b = latency(plain, 1.5, duration_s=120, warmup_s=20), latency(fe, 1.5, duration_s=120, warmup_s=20)
    # a constant delay on every request's way in: the engine's input moved as a whole, the times 20 ms longer
    assert a["calls"] == b["calls"]
    for k in ("ttft_p50", "ttft_mean", "e2e_p50", "e2e_p90"):
        assert b[k] == pytest.approx(a[k] + 0.02, abs=1e-9), k


@pytest.mark.parametrize("bad", [-0.01, "5 ms", 11.0, True])
def test_a_profiles_bad_frontend_is_refused_in_one_line(bad):
    from sim.profile import ProfileError
    with pytest.raises(ProfileError, match="engine.frontend_s"):
        _with_frontend(bad)
