"""The policy core's decisions on hand-written event sequences."""
import sys

import pytest

from sim.policy import CallState, ClientConfig, Delivered, GivenUp, RetryingClient
from sim.policy.layers import Send, Timer
from sim.policy.proxy import Attempt, Cancel, Complete, Dispatch, Proxy, ProxyConfig, Refuse, Subscribe


def client(retries=3, wait=1.0):
    """The reference client whose uniform backoff draws `wait` (the backoff
    is drawn as min + (max - min) * uniform(0, 1); the config's range is
    [0, 4] so that the waits used here are exact)."""
    return RetryingClient(ClientConfig(max_retries=retries, backoff_min_s=0.0, backoff_max_s=4.0),
                          lambda a, b: a + (b - a) * (wait / 4.0))


def test_policy_core_imports_no_simpy():
    import subprocess
    code = "import sim.policy, sys; assert 'simpy' not in sys.modules, 'simpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_deadline_then_retry_after_backoff():
    c = client(wait=2.5)
    call = CallState(0, 10.0)
    (send,) = c.on_call(10.0, call)
    assert type(send) is Send and send.attempt.number == 0 and send.attempt.deadline == 130.0
    assert send.attempt.call is call and call.deadline == 130.0
    (retry,) = c.on_deadline(130.0, send.attempt)
    assert type(retry) is Timer and retry.at == 132.5 and retry.layer is c and retry.token is call
    (send,) = c.on_timer(132.5, call)
    assert send.attempt.number == 1 and send.attempt.deadline == 252.5


def _attempt(c, call, t):
    (send,) = c.on_call(t, call)
    return send.attempt


def test_call_fails_after_four_failed_attempts():
    c = client()
    call = CallState(0, 0.0)
    t = 0.0
    for n in range(4):
        att = _attempt(c, call, t)
        assert att.number == n
        out = c.on_deadline(t + 120, att)
        t = t + 121
    assert out == [GivenUp(call)]
    assert call.done and call.outcome == "failed_attempts" and call.attempts == 4


def test_retries_off_gives_up_after_first_attempt():
    c = client(retries=0)
    call = CallState(0, 0.0)
    assert c.on_deadline(120.0, _attempt(c, call, 0.0)) == [GivenUp(call)]


def test_refused_attempt_counts_and_429_waits_retry_after():
    c = client(wait=1.0)
    call = CallState(0, 0.0)
    assert c.on_refused(0.0, _attempt(c, call, 0.0), 429, retry_after=30.0)[0].at == 30.0
    assert c.on_refused(30.0, _attempt(c, call, 30.0), 503)[0].at == 31.0     # usual wait
    assert c.on_refused(31.0, _attempt(c, call, 31.0), 429, retry_after=121.0) == [GivenUp(call)]
    assert call.attempts == 3 and call.outcome == "failed_retry_after"


def test_complete_delivers():
    c = client()
    call = CallState(0, 0.0)
    assert c.on_complete(5.0, _attempt(c, call, 0.0)) == [Delivered(call)]
    assert call.done and call.outcome == "delivered"


@pytest.mark.parametrize("cancellation,expect_cancel", [("off", False), ("now", True)])
def test_last_subscriber_leaving(cancellation, expect_cancel):
    p = Proxy(ProxyConfig(cancellation=cancellation))
    a = Attempt(7, 0)
    acts = p.on_attempt(0.0, a)
    assert isinstance(acts[0], Subscribe) and isinstance(acts[1], Dispatch)
    ex = acts[1].execution
    p.on_dispatched(0.0, ex)
    out = p.on_attempt_left(120.0, a)
    if expect_cancel:
        assert out == [Cancel(ex)] and ex.state == "cancelled"
    else:
        assert out == [] and ex.orphaned and ex.live
        assert p.on_finished(200.0, ex) == []       # nobody left to deliver to


def test_retry_without_coalescing_creates_new_execution():
    p = Proxy(ProxyConfig(cancellation="off"))
    a0, a1 = Attempt(7, 0), Attempt(7, 1)
    e0 = p.on_attempt(0.0, a0)[1].execution
    p.on_attempt_left(120.0, a0)
    e1 = p.on_attempt(122.0, a1)[1].execution
    assert e0 is not e1 and e0.live and e1.live


def test_engine_refusal_refuses_subscribers_with_503():
    p = Proxy(ProxyConfig())
    a = Attempt(1, 0)
    ex = p.on_attempt(0.0, a)[1].execution
    assert p.on_engine_refused(0.0, ex) == [Refuse(a, 503, None, "engine")]


def test_completion_reaches_subscriber():
    p = Proxy(ProxyConfig())
    a = Attempt(1, 0)
    ex = p.on_attempt(0.0, a)[1].execution
    assert p.on_finished(5.0, ex) == [Complete(a)]


def test_bad_cancellation_is_refused():
    with pytest.raises(ValueError, match="cancellation must be one of"):
        ProxyConfig(cancellation="later")
