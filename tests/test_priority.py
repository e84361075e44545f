"""The engine's priority policy (vLLM's `--scheduling-policy priority`): the
waiting queue by (priority, arrival time), preemption of the running request
with the largest such key."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from sim.engine.request import RUNNING, WAITING_STATUSES
from sim.engine.scheduler import PriorityWaitingQueue, SchedulerConfig, priority_key
from tests.engine_harness import Harness

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="sjf")


class _R:
    def __init__(self, priority, arrival_time):
        self.priority, self.arrival_time = priority, arrival_time


def test_queue_orders_by_priority_then_arrival_and_ties_by_insertion():
    q = PriorityWaitingQueue()
    a, b, c, d = _R(1, 0.0), _R(0, 5.0), _R(0, 1.0), _R(0, 1.0)
    for r in (a, b, c, d):
        q.append(r)
    q.appendleft(_R(2, -1.0))          # a preempted request goes back by its key, not to the front
    assert list(q)[:4] == [c, d, b, a]
    assert q[0] is c and len(q) == 5
    assert [q.popleft() for _ in range(4)] == [c, d, b, a]


# arrivals close together, prompts of several chunks and long responses on a
# small KV pool: preemption of decoding and prefilling requests is common
requests = st.lists(st.tuples(st.floats(0, 15), st.integers(1, 40), st.integers(1, 40), st.integers(0, 2)),
                    min_size=1, max_size=30)


def _run(reqs, policy, num_gpu_blocks, budget, max_num_seqs, depth, watch=None):
    assume(max(p + m for _, p, m, _ in reqs) <= 4 * num_gpu_blocks)      # every request fits alone
    h = Harness(num_gpu_blocks=num_gpu_blocks, block_size=4, budget=budget, max_num_seqs=max_num_seqs,
                depth=depth, scheduling_policy=policy)
    if watch is not None:
        watch(h)
    for i, (t, prompt, max_tokens, prio) in enumerate(reqs):
        h.add(t, i, prompt, max_tokens, priority=prio)
    return h.run(5000.0)


@SETTINGS
@given(reqs=requests, num_gpu_blocks=st.integers(20, 60), budget=st.integers(2, 32),
       max_num_seqs=st.integers(1, 8), depth=st.integers(1, 2))
def test_no_waiting_request_is_admitted_before_one_of_higher_priority(reqs, num_gpu_blocks, budget,
                                                                     max_num_seqs, depth):
    """At every step, each request admitted from the waiting queue has a
    (priority, arrival) key no larger than that of any request left waiting:
    a lower-priority request never overtakes a higher one that waits (the
    head that does not fit blocks admission, as in vLLM)."""
    checked = []

    def watch(h):
        sched = h.sched
        schedule = sched.schedule

        def checked_schedule(*args, **kwargs):
            before = [r for r in sched.waiting if r.status in WAITING_STATUSES]
            out = schedule(*args, **kwargs)
            admitted = [r for r in before if r.status == RUNNING]
            left = [r for r in before if r.status in WAITING_STATUSES]
            for a in admitted:
                for w in left:
                    assert priority_key(a) <= priority_key(w), (a, w)
            checked.append(len(admitted))
            return out
        sched.schedule = checked_schedule

    _run(reqs, "priority", num_gpu_blocks, budget, max_num_seqs, depth, watch)
    assert sum(checked) >= len(reqs)       # every request was admitted at least once, and checked


@SETTINGS
@given(reqs=requests, num_gpu_blocks=st.integers(20, 60), budget=st.integers(2, 32),
       max_num_seqs=st.integers(1, 8), depth=st.integers(1, 2))
def test_priority_runs_every_request_to_its_end_and_gives_every_block_back(reqs, num_gpu_blocks, budget,
                                                                            max_num_seqs, depth):
    h = _run(reqs, "priority", num_gpu_blocks, budget, max_num_seqs, depth)
    for i, (t, prompt, max_tokens, prio) in enumerate(reqs):
        rec = h.requests[i].record
        assert rec.tokens_generated == max_tokens, (i, rec)
    assert h.sched.block_pool.num_free == num_gpu_blocks
    assert not h.sched.running and h.sched.num_waiting == 0


def test_preemption_takes_the_lowest_priority_not_the_last_admitted():
    """Two requests fill the cache; the one admitted last has the higher
    priority. When a block runs out, fcfs preempts the last admitted, the
    priority policy the one of lower priority (larger value)."""
    def victims(policy):
        h = Harness(num_gpu_blocks=8, block_size=4, budget=64, max_num_seqs=4, scheduling_policy=policy)
        h.add(0.0, 0, 12, 12, priority=1)     # low priority, admitted first
        h.add(0.0, 1, 12, 12, priority=0)     # high priority, admitted second in fcfs order
        h.run()
        return {i: h.requests[i].record.preemptions for i in (0, 1)}, h

    fcfs, _ = victims("fcfs")
    prio, h = victims("priority")
    assert fcfs[1] > 0 and fcfs[0] == 0
    assert prio[0] > 0 and prio[1] == 0
    assert h.requests[1].record.finished_at < h.requests[0].record.finished_at


def test_higher_priority_arrival_overtakes_the_waiting_queue():
    """Seats are full; a low-priority request waits; a high-priority one
    arriving later is admitted first when a seat frees."""
    def order(policy):
        h = Harness(num_gpu_blocks=200, block_size=4, budget=64, max_num_seqs=1, scheduling_policy=policy)
        h.add(0.0, 0, 8, 20)
        h.add(1.0, 1, 8, 4, priority=5)
        h.add(2.0, 2, 8, 4, priority=0)
        h.run()
        return sorted((1, 2), key=lambda i: h.requests[i].record.finished_at)

    assert order("fcfs") == [1, 2]
    assert order("priority") == [2, 1]
