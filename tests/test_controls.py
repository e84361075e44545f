"""The proxy's overload controls (docs/model.md#proxy) on hand-written event sequences,
with the exact actions expected, and hypothesis properties of the policy
core driven by random event sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from sim.conditions import CONDITIONS, compose, parse_cancel
from sim.policy.proxy import (
    Attempt,
    Cancel,
    Complete,
    Dispatch,
    Drop,
    EngineView,
    PromptRate,
    Proxy,
    ProxyConfig,
    Refuse,
    RetryBudget,
    Subscribe,
    Wake,
)

DEADLINE = 120.0


def proxy(view=EngineView(0.0, 1000.0), **cfg) -> Proxy:
    return Proxy(ProxyConfig(**cfg), engine_view=lambda t: view, prompt_throughput=500.0)


def send(p: Proxy, t: float, call: int, number: int, prompt: int = 1000) -> tuple[Attempt, list]:
    a = Attempt(call, number, t + DEADLINE)
    return a, p.on_attempt(t, a, (64,), prompt)


# ------------------------------------------------------- cancellation + coalescing

def _first_then_retry_2s_after_deadline(**cfg):
    p = proxy(**cfg)
    a0, out = send(p, 0.0, 7, 0)
    ex = out[0].execution
    assert out == [Subscribe(a0, ex), Dispatch(ex)]
    left = p.on_attempt_left(DEADLINE, a0)
    a1, out = send(p, DEADLINE + 2.0, 7, 1)
    return p, ex, left, a1, out


def test_retry_after_deadline_attaches_under_deferred_10():
    p, ex, left, a1, out = _first_then_retry_2s_after_deadline(cancellation="deferred", defer_s=10.0, coalesce=True)
    assert left == [Wake(130.0, ex)]
    assert out == [Subscribe(a1, ex)] and a1.attached and ex.live
    assert p.on_wake(130.0, ex) == []               # a subscriber attached within W
    assert p.on_finished(140.0, ex) == [Complete(a1)]


def test_retry_after_deadline_attaches_under_cancellation_off_with_coalescing():
    p, ex, left, a1, out = _first_then_retry_2s_after_deadline(cancellation="off", coalesce=True)
    assert left == [] and out == [Subscribe(a1, ex)] and a1.attached


def test_retry_after_deadline_finds_nothing_under_now():
    p, ex, left, a1, out = _first_then_retry_2s_after_deadline(cancellation="now", coalesce=True)
    assert left == [Cancel(ex)] and not ex.live
    new = out[0].execution
    assert out == [Subscribe(a1, new), Dispatch(new)] and new is not ex and not a1.attached


def test_retry_without_coalescing_gets_its_own_execution_even_if_one_runs():
    p, ex, left, a1, out = _first_then_retry_2s_after_deadline(cancellation="off")
    assert ex.live and ex.orphaned and out[0].execution is not ex and len(out) == 2


def test_deferred_cancels_after_w_when_nobody_attached():
    p = proxy(cancellation="deferred", defer_s=10.0, coalesce=True)
    a0, out = send(p, 0.0, 1, 0)
    ex = out[0].execution
    assert p.on_attempt_left(120.0, a0) == [Wake(130.0, ex)]
    assert p.on_wake(130.0, ex) == [Cancel(ex)] and ex.state == "cancelled"
    a1, out = send(p, 131.0, 1, 1)
    assert out[0].execution is not ex and not a1.attached


def test_deferred_counts_w_from_the_last_subscriber_leaving():
    p = proxy(cancellation="deferred", defer_s=10.0, coalesce=True)
    a0, out = send(p, 0.0, 1, 0)
    ex = out[0].execution
    p.on_attempt_left(120.0, a0)                    # wake due at 130
    a1, out = send(p, 125.0, 1, 1)
    assert out == [Subscribe(a1, ex)]
    assert p.on_attempt_left(127.0, a1) == [Wake(137.0, ex)]
    assert p.on_wake(130.0, ex) == []               # the earlier wake is stale
    assert p.on_wake(137.0, ex) == [Cancel(ex)]


def test_coalescing_needs_the_same_key():
    p = proxy(cancellation="off", coalesce=True)
    a0, out = send(p, 0.0, 1, 0)
    p.on_attempt_left(120.0, a0)
    other = Attempt(1, 1, 242.0)
    out = p.on_attempt(122.0, other, (128,), 1000)  # different generation parameters
    assert out[0].execution is not a0.execution and not other.attached
    b = Attempt(2, 1, 242.0)                        # another call
    assert len(p.on_attempt(122.0, b, (64,), 1000)) == 2 and not b.attached


# -------------------------------------------------------------- retry budget

def test_budget_admits_a_tenth_of_first_attempts_over_60s():
    b = RetryBudget(0.1, 60.0)
    for i in range(20):
        b.first(float(i))
    assert [b.admit(30.0), b.admit(31.0), b.admit(32.0)] == [True, True, False]
    # at 75 the first attempts of 0..15 s have left the window: 4 remain, 2 retries in it
    assert not b.admit(75.0)
    # at 92 both retries have left; 0 first attempts: nothing admitted (no minimum)
    assert not b.admit(92.0)


def _exhausted_budget(order: str) -> tuple[Proxy, Attempt]:
    """Call 0's first attempt has left; its execution runs on (cancellation
    off); one first attempt in the window, so the budget admits no retry."""
    p = proxy(view=EngineView(5000.0, 1000.0), cancellation="off", coalesce=True, budget=0.1, order=order)
    a0, _ = send(p, 100.0, 0, 0)
    p.on_attempt_left(130.0, a0)
    return p, a0


def test_lookup_first_attaches_a_retry_whose_call_has_a_live_execution():
    p, a0 = _exhausted_budget("lookup-first")
    a1, out = send(p, 132.0, 0, 1)
    assert out == [Subscribe(a1, a0.execution)] and a1.attached


def test_lookup_first_checks_the_budget_for_a_retry_that_found_nothing():
    p, a0 = _exhausted_budget("lookup-first")
    b1, out = send(p, 132.0, 5, 1, prompt=2000)
    # Retry-After: (nothing queued in the proxy + 5000 in the engine + own 2000) / 1000 tokens/s
    assert out == [Refuse(b1, 429, 7.0, "budget")]


def test_budget_first_refuses_a_retry_whose_call_has_a_live_execution():
    p, a0 = _exhausted_budget("budget-first")
    a1, out = send(p, 132.0, 0, 1)
    assert out == [Refuse(a1, 429, 6.0, "budget")] and a0.execution.live and not a0.execution.subscribers


def test_budget_first_counts_a_retry_that_attaches():
    p = proxy(cancellation="off", coalesce=True, budget=0.1, order="budget-first")
    for c in range(1, 11):
        send(p, 0.0, c, 0)                          # 10 first attempts: one retry admitted
    a0, _ = send(p, 0.0, 0, 0)
    p.on_attempt_left(1.0, a0)
    a1, out = send(p, 2.0, 0, 1)
    assert out == [Subscribe(a1, a0.execution)]
    b1, out = send(p, 3.0, 50, 1)
    assert out[0] == Refuse(b1, 429, 1.0, "budget")   # the attached retry used the budget
    q = proxy(cancellation="off", coalesce=True, budget=0.1, order="lookup-first")
    for c in range(1, 11):
        send(q, 0.0, c, 0)
    a0, _ = send(q, 0.0, 0, 0)
    q.on_attempt_left(1.0, a0)
    send(q, 2.0, 0, 1)
    b1, out = send(q, 3.0, 50, 1)
    assert isinstance(out[0], Subscribe) and len(out) == 2       # lookup-first: the attach was free


def test_retry_after_counts_the_proxy_queue():
    p = proxy(view=EngineView(1000.0, 1000.0), budget=0.1, proxy_cap=1, cancellation="now")
    send(p, 0.0, 1, 0, prompt=3000)                 # dispatched
    send(p, 0.0, 2, 0, prompt=4000)                 # queued
    a, out = send(p, 1.0, 3, 1, prompt=500)
    assert out == [Refuse(a, 429, (4000 + 1000 + 500) / 1000.0, "budget")]


def test_retry_after_uses_the_profile_throughput_without_history():
    p = Proxy(ProxyConfig(budget=0.1), engine_view=lambda t: EngineView(1000.0, None), prompt_throughput=500.0)
    a, out = send(p, 0.0, 1, 1, prompt=1500)
    assert out == [Refuse(a, 429, 5.0, "budget")]


def test_prompt_rate_is_over_a_sliding_window():
    r = PromptRate(60.0)
    assert r.rate(0.0) is None
    r.add(10.0, 6000)
    r.add(50.0, 12000)
    assert r.rate(60.0) == 300.0
    assert r.rate(70.0) == 200.0                    # the first left the window
    assert r.rate(200.0) is None



def test_prompt_rate_holds_only_the_last_window_without_being_asked():
    r = PromptRate(60.0)
    for i in range(1000):
        r.add(float(i), 100)
    assert len(r.events) == 60 and r.rate(999.0) == 100.0

# ------------------------------------------------------------------ proxy cap

def test_proxy_cap_queues_and_dispatches_fifo():
    p = proxy(proxy_cap=2, cancellation="now")
    outs = [send(p, float(i), i, 0) for i in range(4)]
    exs = [o[1][0].execution for o in outs]
    assert [len(o[1]) for o in outs] == [2, 2, 1, 1] and p.queued == 2
    assert p.on_finished(10.0, exs[0]) == [Complete(outs[0][0]), Dispatch(exs[2])]
    assert p.on_attempt_left(11.0, outs[1][0]) == [Cancel(exs[1]), Dispatch(exs[3])]
    assert p.queued == 0 and p.outstanding == 2


def test_lifo_dequeues_the_newest_once_more_than_50_are_queued():
    p = proxy(proxy_cap=1, queue="lifo", cancellation="now")
    outs = [send(p, float(i), i, 0) for i in range(53)]          # 1 dispatched, 52 queued
    exs = [o[1][0].execution for o in outs]
    assert p.queued == 52
    assert p.on_finished(60.0, exs[0])[-1] == Dispatch(exs[52])  # 52 > 50: newest
    assert p.on_finished(61.0, exs[52])[-1] == Dispatch(exs[51])  # 51 > 50: newest
    assert p.on_finished(62.0, exs[51])[-1] == Dispatch(exs[1])   # 50: oldest
    assert p.on_finished(63.0, exs[1])[-1] == Dispatch(exs[2])


def test_fifo_under_more_than_50_queued_stays_oldest_first():
    p = proxy(proxy_cap=1, queue="fifo", cancellation="now")
    exs = [send(p, float(i), i, 0)[1][0].execution for i in range(60)]
    assert p.on_finished(60.0, exs[0])[-1] == Dispatch(exs[1])


def test_a_queued_execution_whose_subscribers_left_is_dropped_and_never_dispatched():
    p = proxy(proxy_cap=1, cancellation="off", coalesce=True)
    a, out = send(p, 0.0, 1, 0)
    b, outb = send(p, 1.0, 2, 0)
    exb = outb[0].execution
    assert outb == [Subscribe(b, exb)] and exb.state == "queued"
    assert p.on_attempt_left(121.0, b) == [Drop(exb)] and exb.state == "dropped" and p.queued == 0
    b1, out1 = send(p, 123.0, 2, 1)                 # a dropped execution cannot be attached to
    assert out1 == [Subscribe(b1, out1[0].execution)] and out1[0].execution is not exb
    assert p.on_finished(130.0, a.execution) == [Complete(a), Dispatch(out1[0].execution)]


def test_a_queued_execution_is_dropped_only_when_its_last_subscriber_leaves():
    p = proxy(proxy_cap=1, cancellation="now", coalesce=True)
    send(p, 0.0, 1, 0)
    b0, outb = send(p, 1.0, 2, 0)
    exb = outb[0].execution
    b1, out1 = send(p, 2.0, 2, 1)
    assert out1 == [Subscribe(b1, exb)] and b1.attached
    assert p.on_attempt_left(50.0, b0) == [] and exb.state == "queued"
    assert p.on_attempt_left(60.0, b1) == [Drop(exb)] and p.queued == 0


def test_deadline_check_refuses_at_arrival_an_attempt_that_cannot_make_it():
    # 100 prompt tokens/s, nothing in the engine; proxy cap 1: a holds the
    # seat, c waits in the proxy queue with its 1000 tokens
    p = proxy(view=EngineView(0.0, 100.0), proxy_cap=1, queue="deadline", cancellation="now")
    a, outa = send(p, 0.0, 0, 0)
    c = Attempt(2, 0, 100.0)
    outc = p.on_attempt(0.5, c, (64,), 1000)
    assert len(outc) == 1 and outc[0].execution.state == "queued"
    # d at 0.7 s: (1000 queued + its own 1000) / 100 = 20 s > the 19 s it has left
    d = Attempt(3, 0, 19.7)
    n_exec = len(p.executions)
    assert p.on_attempt(0.7, d, (64,), 1000) == [Refuse(d, 503, None, "deadline")]
    assert not d.open and d.execution is None
    assert len(p.executions) == n_exec and p.queued == 1 and p.queued_tokens == 1000
    # e at 0.8 s with 20 s left: just in time, admitted and queued behind c
    e = Attempt(4, 0, 20.8)
    oute = p.on_attempt(0.8, e, (64,), 1000)
    assert oute == [Subscribe(e, oute[0].execution)] and p.queued == 2
    # the queue is first in, first out; no check at dequeue
    assert p.on_finished(1.0, outa[0].execution) == [Complete(a), Dispatch(outc[0].execution)]


def test_deadline_check_counts_the_engine_backlog():
    # 100 prompt tokens/s, 1000 uncomputed in the engine: a 1000-token prompt waits 20 s
    p = proxy(view=EngineView(1000.0, 100.0), queue="deadline", cancellation="now")
    b = Attempt(1, 0, 20.0)                         # 20 s needed, 19.5 s left
    c = Attempt(2, 0, 21.0)                         # 20 s needed, 20.5 s left
    assert p.on_attempt(0.5, b, (64,), 1000) == [Refuse(b, 503, None, "deadline")]
    outc = p.on_attempt(0.5, c, (64,), 1000)
    assert outc == [Subscribe(c, outc[0].execution), Dispatch(outc[0].execution)]


def test_deadline_check_lets_a_retry_attach_without_a_check():
    p = proxy(view=EngineView(0.0, 100.0), queue="deadline", coalesce=True)
    a = Attempt(0, 0, 100.0)
    outa = p.on_attempt(0.0, a, (64,), 1000)
    p.on_attempt_left(100.0, a)
    r = Attempt(0, 1, 101.0)                        # 1 s left, but its execution is live
    assert p.on_attempt(100.0, r, (64,), 1000) == [Subscribe(r, outa[0].execution)]


def test_deadline_check_only_under_the_deadline_queue():
    p = proxy(view=EngineView(1e6, 100.0), proxy_cap=1, queue="fifo")
    a = Attempt(0, 0, 1.0)
    out = p.on_attempt(0.0, a, (64,), 1000)
    assert isinstance(out[0], Subscribe) and isinstance(out[1], Dispatch)


def test_engine_refusal_frees_the_seat_for_the_queue():
    p = proxy(proxy_cap=1, cancellation="now")
    a, outa = send(p, 0.0, 0, 0)
    b, outb = send(p, 0.0, 1, 0)
    assert p.on_engine_refused(0.0, outa[0].execution) == [Refuse(a, 503, None, "engine"),
                                                            Dispatch(outb[0].execution)]


# ------------------------------------------------------- conditions and flags

def test_named_conditions_have_the_spec_settings():
    assert len(CONDITIONS) == 17
    s = {n: c.settings() for n, c in CONDITIONS.items()}
    assert s["deferred"]["cancellation"] == "deferred:10" and s["deferred"]["coalesce"]
    assert s["lookup-first"]["order"] == "lookup-first" and s["lookup-first"]["budget"] == 0.1
    assert s["budget-first"]["order"] == "budget-first" and s["budget-first"]["coalesce"]
    assert (s["lifo"]["proxy_cap"], s["lifo"]["queue"], s["lifo"]["cancellation"]) == (100, "lifo", "now")
    assert s["deadline-check"]["queue"] == "deadline" and s["proxy-cap"]["queue"] == "fifo"
    assert s["engine-cap-338+cancel"]["engine_cap"] == 338 and s["budget+cancel"]["cancellation"] == "now"
    assert not CONDITIONS["no-retry"].retries and CONDITIONS["coalesce+cancel"].proxy.coalesce


def test_compose_from_flags():
    c = compose("cancel", coalesce=True, budget=0.1, order="lookup-first", proxy_cap=100, queue="lifo",
                engine_cap=338)
    p = c.proxy
    assert (p.cancellation, p.coalesce, p.budget, p.order, p.proxy_cap, p.queue, c.engine_cap) == \
        ("now", True, 0.1, "lookup-first", 100, "lifo", 338)
    assert compose(cancel="deferred:4").proxy.defer_s == 4.0
    assert compose("budget", budget=0).proxy.budget is None
    assert compose("deferred", cancel="now").settings() == {**CONDITIONS["coalesce+cancel"].settings()}


@pytest.mark.parametrize("bad", ["later", "deferred:", "deferred:-1", "deferred:x"])
def test_bad_cancel_spec(bad):
    with pytest.raises(ValueError, match="deferred"):
        parse_cancel(bad)


# ---------------------------------------------------------------- properties

@st.composite
def event_sequences(draw):
    """Random attempts of a few calls (first attempts, then retries), leaves,
    engine completions and wake-ups, in time order."""
    n = draw(st.integers(5, 60))
    return [(draw(st.sampled_from(["attempt", "attempt", "leave", "finish", "wake", "refuse"])),
             draw(st.integers(0, 5)), draw(st.floats(0.0, 20.0))) for _ in range(n)]


def _drive(p: Proxy, events) -> tuple[list, dict]:
    """Feed the events; returns per-step snapshots and the attempts' answers."""
    t = 0.0
    number = {}
    open_atts: dict[int, list[Attempt]] = {}
    wakes = []
    answered = {}
    dispatched = set()
    snapshots = []

    def act(out):
        for a in out:
            if isinstance(a, Wake):
                wakes.append(a)
            elif isinstance(a, Dispatch):
                assert a.execution.id not in dispatched
                assert a.execution.state == "dispatched"
                dispatched.add(a.execution.id)
            elif isinstance(a, (Subscribe, Refuse)):
                answered.setdefault(a.attempt, []).append(type(a).__name__)
            elif isinstance(a, Drop):
                assert a.execution.id not in dispatched
    for kind, call, dt in events:
        t += dt
        if kind == "attempt" and not open_atts.get(call):
            k = number.get(call, 0)
            number[call] = k + 1
            att = Attempt(call, k, t + 30.0)
            out = p.on_attempt(t, att, (64,), 1000)
            act(out)
            if att.open:
                open_atts.setdefault(call, []).append(att)
        elif kind == "leave" and open_atts.get(call):
            att = open_atts[call].pop()
            act(p.on_attempt_left(t, att))
        elif kind in ("finish", "refuse"):        # the engine completes or refuses one in it
            live = [e for e in p.executions.values() if e.state == "dispatched"]
            if live:
                ex = live[call % len(live)]
                for a in ex.subscribers:
                    open_atts[a.call_id].remove(a)
                act((p.on_finished if kind == "finish" else p.on_engine_refused)(t, ex))
        elif kind == "wake":
            due = [w for w in wakes if w.at <= t]
            wakes[:] = [w for w in wakes if w.at > t]
            for w in due:
                act(p.on_wake(w.at, w.execution))
        for atts in open_atts.values():
            for a in list(atts):
                if not a.open:
                    atts.remove(a)
        snapshots.append(list(p.executions.values()))
    return snapshots, answered


configs = st.builds(
    ProxyConfig,
    cancellation=st.sampled_from(["off", "now", "deferred"]), defer_s=st.sampled_from([0.0, 5.0, 10.0]),
    coalesce=st.just(True), budget=st.sampled_from([None, 0.1, 0.5]),
    order=st.sampled_from(["budget-first", "lookup-first"]), proxy_cap=st.sampled_from([None, 1, 2, 3]),
    queue=st.sampled_from(["fifo", "deadline", "lifo"]), lifo_after=st.sampled_from([0, 1, 50]))


@settings(max_examples=200, deadline=None)
@given(configs, event_sequences())
def test_with_coalescing_never_more_than_one_live_execution_per_key(cfg, events):
    p = Proxy(cfg, engine_view=lambda t: EngineView(500.0, 100.0), prompt_throughput=100.0)
    snapshots, answered = _drive(p, events)
    for live in snapshots:
        keys = [e.key for e in live if e.live]
        assert len(keys) == len(set(keys))
        assert p.outstanding == sum(e.state == "dispatched" for e in p.executions.values())
    # every attempt got exactly one answer: a subscription or a refusal
    assert all(len(v) == 1 or v == ["Subscribe", "Refuse"] for v in answered.values())
    if cfg.proxy_cap is not None:
        assert p.outstanding <= cfg.proxy_cap


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([0.05, 0.1, 0.3]),
       st.lists(st.tuples(st.booleans(), st.floats(0.0, 10.0)), min_size=1, max_size=300))
def test_budget_never_admits_retries_above_its_share_over_60s(ratio, events):
    b = RetryBudget(ratio, 60.0)
    t = 0.0
    firsts, admitted = [], []
    for is_first, dt in events:
        t += dt
        if is_first:
            b.first(t)
            firsts.append(t)
        elif b.admit(t):
            admitted.append(t)
    # in every window ending at an admission: retries admitted <= ratio x first attempts
    for x in admitted:
        n_r = sum(x - 60.0 < y <= x for y in admitted)
        n_f = sum(x - 60.0 < y <= x for y in firsts)
        assert n_r <= ratio * n_f + 1e-9


# ------------------------------------------------------------ in the driver

def _tiny_run(condition, arrivals, max_tokens, deadline=1.0, retries=0):
    import numpy as np

    from sim.model import simulate
    from sim.profile import from_dict
    from sim.scenario import Scenario
    from sim.workload import Trace
    profile = from_dict({
        "name": "tiny", "capacity": 1.0, "provenance": {"kind": "test"},
        "step_time": {"fixed_s": 0.01, "per_request_s": 0.0, "per_token_s": 0.0,
                      "per_prefill_pair_s": 0.0, "per_decode_ctx_s": 0.0},
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 512, "block_size": 16,
                   "num_gpu_blocks": 300, "depth": 1, "max_model_len": 4096}})
    n = len(arrivals)
    trace = Trace(arrival=np.array(arrivals, dtype=float), prompt_len=np.full(n, 100),
                  max_tokens=np.array(max_tokens), shared_prefix=0)
    return simulate(profile, trace, condition,
                    Scenario(deadline_s=deadline, delivery_horizon_s=20.0, max_retries=retries))


def test_driver_drops_a_queued_execution_that_was_given_up_without_sending_it():
    # proxy cap 1: call 0 (1000 tokens of 10 ms steps) holds the seat, runs on
    # orphaned after its 5 s deadline; call 1 waits in the proxy queue, gives
    # up at 5.1 s and is dropped; call 2 arrives after call 0 finished and runs
    cond = compose("no-retry", proxy_cap=1, cancel="off")
    log = _tiny_run(cond, [0.0, 0.1, 11.0], [1000, 5, 5], deadline=5.0)
    e0, e1, e2 = log.executions
    assert e1.fate == "dropped" and e1.dispatched_at != e1.dispatched_at and not e1.accepted
    assert e1.finished_at == 5.1 and e1.prompt_computed == 0
    assert e0.fate == "completed" and e2.fate == "completed" and e2.dispatched_at == 11.0
    assert [c.outcome for c in log.calls] == ["failed_attempts", "failed_attempts", "delivered"]
    # the queue series: one queued from 0.1 s to 5.1 s
    assert list(log.series.proxy_queue[:7]) == [0, 1, 1, 1, 1, 1, 0]
    # the engine saw two executions' prompts
    assert log.counters["prompt_tokens_total"] == 200


def test_driver_refuses_at_arrival_with_503_and_no_execution_and_the_client_retries():
    # 10 ms steps, one output token a step, 100-token prompts, proxy cap 1,
    # 90 s deadline. Call 0 runs from 0 s to 10 s; its prompt, computed in
    # the first step, is the throughput history: 100 tokens / 60 s. Call 1
    # at 1 s: its own 100 tokens, 60 s < 89 s left: admitted, queued. Call 2
    # at 1.5 s: call 1's 100 queued tokens + its own, 120 s > 88.5 s left:
    # refused at arrival with 503, and so is its retry.
    from sim.runlog import refusal_outcome
    cond = compose("cancel", proxy_cap=1, queue="deadline")
    log = _tiny_run(cond, [0.0, 1.0, 1.5], [1000, 5, 5], deadline=90.0, retries=1)
    by_call = {c: [a for a in log.attempts if a.call == c] for c in range(3)}
    assert [a.outcome for a in by_call[1]] == ["complete"] and by_call[1][0].execution == 1
    assert [a.outcome for a in by_call[2]] == [refusal_outcome("deadline")] * 2
    assert all(a.execution == -1 and a.ended_at == a.sent_at for a in by_call[2])
    assert by_call[2][1].sent_at > by_call[2][0].sent_at
    assert [c.outcome for c in log.calls] == ["delivered", "delivered", "failed_attempts"]
    assert [e.call for e in log.executions] == [0, 1]


def test_record_counts_refusals_and_proxy_queue():
    from sim.measures import record
    from sim.scenario import Scenario
    cond = compose("no-retry", proxy_cap=1, cancel="off")
    log = _tiny_run(cond, [0.0, 0.1, 11.0], [1000, 5, 5], deadline=5.0)
    rec = record(log, Scenario(deadline_s=5.0, delivery_horizon_s=20.0, max_retries=0), 1.0, {})
    assert rec["executions"]["dropped"] == 1 and rec["proxy_queue"]["max"] == 1
    cond = compose("no-control", engine_cap=1)
    log = _tiny_run(cond, [0.0, 0.1], [1000, 5], deadline=20.0, retries=1)
    rec = record(log, Scenario(deadline_s=20.0, delivery_horizon_s=20.0, max_retries=1), 1.0, {})
    # call 1 is refused twice by the engine while call 0 runs for 10 s
    assert rec["retries"]["refused_engine"] == 2 and rec["calls_failed"]["by_refusal"] == 1
    assert rec["retries"]["sent"] == 1


def test_cli_composes_a_condition_from_flags(tmp_path, capsys):
    import json

    from llmsim.cli import main
    out = tmp_path / "r.json"
    assert main(["run", "--condition", "cancel", "--coalesce", "--cancel", "deferred:5", "--budget", "0.1",
                 "--order", "lookup-first", "--proxy-cap", "100", "--queue", "lifo", "--engine-cap", "338",
                 "--pulse", "1.2", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["condition_settings"] == {"retries": "on", "cancellation": "deferred:5", "coalesce": True,
                                         "budget": 0.1, "order": "lookup-first", "proxy_cap": 100,
                                         "queue": "lifo", "engine_cap": 338}
    assert main(["conditions"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    listed = [ln.split()[0] for ln in lines if ln.split() and ln.split()[0] in CONDITIONS]
    assert listed == list(CONDITIONS) and any("deferred:10" in ln for ln in lines)


def _timers(horizon):
    from sim.clock import Clock, Timers
    env = Clock()
    seen = []
    timers = Timers(env, horizon=lambda: horizon)
    fire = lambda t, arg: seen.append((t, env.now, arg))      # noqa: E731
    entries = {t: timers.at(t, fire, f"t{t:g}") for t in (3.0, 1.0, 2.0, 12.0, 5.0)}
    return env, timers, seen, entries


def test_the_clock_runs_as_a_simpy_environment():
    """Clock.run against simpy.Environment.run: a number (run twice,
    resuming), an event (its value; one processed already), a failed event
    nobody defused, and an `until` event left untriggered."""
    import pytest
    import simpy

    from sim.clock import Clock

    def story(env):
        seen = []

        def proc():
            for k in range(6):
                yield env.timeout(1.5)
                seen.append((env.now, k))
            return "done"
        p = env.process(proc())
        out = [env.run(until=4.0), list(seen), env.now, env.run(until=6), list(seen), env.run(until=p), env.now]
        out.append(env.run(until=p))
        with pytest.raises(ValueError):
            env.run(until=env.now)
        bad = env.event()
        bad.fail(KeyError("x"))
        with pytest.raises(KeyError):
            env.run()
        never = env.event()
        with pytest.raises(RuntimeError):
            env.run(until=never)
        return out

    assert story(Clock()) == story(simpy.Environment())


def test_timers_fire_in_time_order_each_as_of_its_own_time():
    for horizon in (10.0, -float("inf")):
        env, timers, seen, entries = _timers(horizon)
        timers.cancel(entries[5.0])
        env.run()
        assert seen == [(1.0, 1.0, "t1"), (2.0, 2.0, "t2"), (3.0, 3.0, "t3"), (12.0, 12.0, "t12")]
        assert timers.next_time() == float("inf")


def test_timers_due_before_the_horizon_share_one_event():
    env, _, seen, _ = _timers(10.0)          # 1, 2, 3 and 5 in one batch; 12 after the horizon
    env.run()
    batched = env.events_scheduled
    env, _, seen_alone, _ = _timers(-float("inf"))
    env.run()
    assert seen == seen_alone and batched < env.events_scheduled == 5


def test_thinning_the_gauge_logs_keeps_the_1s_series():
    import numpy as np

    from sim.model import Run
    from sim.profile import load_profile
    from sim.scenario import PAPER
    from sim.workload import make_trace
    profile = load_profile("qwen2.5-7b")
    sc = PAPER.with_(hold_s=200.0)
    trace = make_trace(profile.capacity, sc, 0)
    logs, sizes = [], []
    for thin_at in (64, 10 ** 12):
        run = Run(profile, trace, CONDITIONS["proxy-cap"], sc, 0)
        run.thin_at = thin_at
        logs.append(run.run())
        sizes.append(len(run.engine.gauge_log))
    thin, full = logs
    assert sizes[0] < sizes[1]
    for name in ("t", "waiting", "running", "proxy_queue"):
        assert np.array_equal(getattr(thin.series, name), getattr(full.series, name)), name
    assert thin.series.proxy_queue.any() and thin.series.waiting.any()


def test_a_run_leaves_its_closed_attempts_to_reference_counting():
    """An attempt and its deadline timer make no reference cycle: with the
    cyclic collector off, the attempts of a run do not pile up."""
    import gc

    from sim.model import Run
    from sim.policy.proxy import Attempt
    from sim.profile import load_profile
    from sim.scenario import PAPER
    from sim.workload import make_trace
    profile = load_profile("qwen2.5-7b")
    sc = PAPER.with_(hold_s=200.0)
    trace = make_trace(profile.capacity, sc, 0)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        log = Run(profile, trace, CONDITIONS["cancel"], sc, 0).run()
        alive = sum(isinstance(o, Attempt) for o in gc.get_objects())
    finally:
        if was_enabled:
            gc.enable()
    assert len(log.attempts) > 1000 and alive < 0.05 * len(log.attempts)


def test_thin_log_keeps_the_last_entry_of_each_second():
    import numpy as np

    from sim.runlog import sample_log, thin_log
    log = [(0.0, 1), (0.5, 2), (1.0, 3), (1.2, 4), (1.7, 5), (3.0, 6), (3.5, 7)]
    ts = np.arange(0.0, 6.0)
    before = sample_log(log, ts)
    thin_log(log)
    assert log == [(0.0, 1), (1.0, 3), (1.7, 5), (3.0, 6), (3.5, 7)]
    assert np.array_equal(sample_log(log, ts), before)


def test_sample_columns_reads_each_column_as_sample_log_does():
    import numpy as np

    from sim.runlog import sample_columns, sample_log
    log = [(0.5, 1, 10), (1.0, 2, 20), (2.5, 3, 30)]
    ts = np.array([0.0, 0.5, 1.0, 2.0, 3.0])
    waiting, running = sample_columns(log, ts, (1, 2))
    assert waiting.tolist() == [0.0, 1.0, 2.0, 2.0, 3.0] and running.tolist() == [0.0, 10.0, 20.0, 20.0, 30.0]
    assert np.array_equal(waiting, sample_log(log, ts, 1)) and np.array_equal(running, sample_log(log, ts, 2))
    assert [c.tolist() for c in sample_columns([], ts, (1, 2))] == [[0.0] * 5] * 2


def test_a_long_chain_of_engine_refusals_runs_without_growing_the_stack():
    """Proxy cap and engine cap at the same 100 with cancellation: an aborted
    execution still counts in the engine until its step boundary, so the seat
    the proxy frees is refused and each refusal dispatches the next queued
    execution — a chain as long as the proxy queue, carried out from one loop."""
    from sim.profile import load_profile
    from sim.run import run_one
    rec = run_one(load_profile("qwen2.5-7b"), compose("no-control", proxy_cap=100, engine_cap=100, cancel="now"),
                  2.7, 0)
    assert rec["retries"]["refused_engine"] > 0
    assert rec["cohorts"]["hold"]["offered"] > 0
