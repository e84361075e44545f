"""A gateway layer (`sim.policy.gateway.Gateway`) on its own: each preset's
constants decide its upstream timeout and the status it answers it with,
whether it closes the upstream attempt or lets it run on, what it retries,
its connection limit and queue, and an inference gateway's shedding."""
from __future__ import annotations

import pytest

from sim.policy.gateway import Gateway
from sim.policy.layers import Leave, RunOn, Send, Timer, Upstream
from sim.policy.presets import PRESETS, preset
from sim.policy.proxy import Attempt, Complete, Refuse
from sim.policy.retry import envoy_retry_on


def _value(name, key):
    return PRESETS[name].settings[key].value


def _gateway(name, r=0.5, pods=None, priority=None, **overrides):
    return Gateway(preset("gateway", name, **overrides), lambda: r, pods=pods, priority=priority)


def _of(actions, kind):
    return [a for a in actions if type(a) is kind]


def _send(g, t=0.0, call=0, deadline=float("inf")):
    above = Attempt(call, 0, deadline)
    out = g.on_attempt(t, above, (100,), 1000)
    return above, out


def test_nginx_answers_its_read_timeout_with_504_closes_the_upstream_attempt_and_does_not_retry_a_post():
    g = _gateway("nginx")
    above, out = _send(g, 10.0)
    (send,), (timer,) = _of(out, Send), _of(out, Timer)
    up = send.attempt
    assert type(up) is Upstream and up.layer is g and up.above is above and up.call_id == 0
    assert timer.at == 10.0 + _value("nginx", "timeout_s") and timer.token is up
    out = g.on_timer(timer.at, up)
    assert _of(out, Leave) == [Leave(up)] and not _of(out, Send)       # passes the close on; no retry
    (refuse,) = _of(out, Refuse)
    assert refuse.attempt is above and refuse.status == _value("nginx", "timeout_status") == 504
    assert refuse.reason == "upstream_timeout" and not above.open
    assert g.active == 0 and g.counts["upstream_timeout"] == 1 and g.counts["retries"] == 0


def test_nginx_passes_a_refusal_up_unretried_and_a_response_up():
    g = _gateway("nginx")
    above, out = _send(g)
    up = _of(out, Send)[0].attempt
    out = g.on_refused(1.0, up, 503, None, "engine")
    assert out == [Refuse(above, 503, None, "engine")]
    above, out = _send(g, call=1)
    up = _of(out, Send)[0].attempt
    assert g.on_complete(2.0, up) == [Complete(above)] and g.active == 0 and not g.relays


def test_nginx_passes_a_clients_disconnect_on_and_haproxy_lets_the_request_run_on():
    assert _value("nginx", "passes_disconnect") and not _value("haproxy", "passes_disconnect")
    g = _gateway("nginx")
    above, out = _send(g)
    up = _of(out, Send)[0].attempt
    assert g.on_attempt_left(5.0, above) == [Leave(up)] and g.active == 0
    h = _gateway("haproxy", timeout_s=30.0)
    above, out = _send(h)
    up = _of(out, Send)[0].attempt
    assert h.on_attempt_left(5.0, above) == [RunOn(up)]
    assert h.active == 1                       # its connection stays open until the answer comes
    assert h.on_timer(30.0, up) == []          # nobody to answer, nothing more to close
    assert h.on_complete(40.0, up) == [] and h.active == 0 and h.counts["run_on"] == 1


def test_haproxy_lets_the_request_run_on_past_its_own_timeout_and_answers_504():
    h = _gateway("haproxy", timeout_s=30.0)
    assert _value("haproxy", "timeout_s") is None and not _of(_send(_gateway("haproxy"))[1], Timer)  # no default
    above, out = _send(h)
    up = _of(out, Send)[0].attempt
    out = h.on_timer(30.0, up)
    assert _of(out, RunOn) == [RunOn(up)] and not _of(out, Leave)
    assert _of(out, Refuse)[0].status == 504 and _of(out, Refuse)[0].attempt is above


def test_haproxy_retries_only_what_its_retry_on_names_after_its_turnaround():
    h = _gateway("haproxy")
    above, out = _send(h)
    up = _of(out, Send)[0].attempt
    assert _of(h.on_refused(1.0, up, 503), Refuse)[0].status == 503   # retry-on conn-failure only
    h = _gateway("haproxy", retry_on=["503"])
    above, out = _send(h)
    t = 0.0
    for n in range(_value("haproxy", "max_retries")):
        up = _of(out, Send)[0].attempt
        out = h.on_refused(t + 1.0, up, 503)
        (timer,) = out
        assert type(timer) is Timer and timer.at == t + 1.0 + _value("haproxy", "backoff_base_s")
        out = h.on_timer(timer.at, timer.token)
        assert up.number == n
        t = timer.at
    up = _of(out, Send)[0].attempt
    assert up.number == _value("haproxy", "max_retries")
    assert _of(h.on_refused(t + 1.0, up, 503), Refuse)[0].attempt is above
    assert h.counts["retries"] == _value("haproxy", "max_retries") and h.retrying == 0


def test_a_connection_limit_queues_then_refuses_503_on_a_full_queue_or_its_timeout():
    h = _gateway("haproxy", max_connections=1, max_queue=1, queue_timeout_s=5.0)
    a0, out0 = _send(h, 0.0, call=0)
    a1, out1 = _send(h, 1.0, call=1)
    assert _of(out0, Send) and not _of(out1, Send) and h.queued == 1
    (expiry,) = _of(out1, Timer)
    assert expiry.at == 6.0
    a2, out2 = _send(h, 2.0, call=2)
    assert out2 == [Refuse(a2, _value("haproxy", "queue_status"), None, "queue_full")]
    out = h.on_timer(6.0, expiry.token)
    assert out == [Refuse(a1, 503, None, "queue_timeout")] and h.queued == 0
    # a connection freed sends the first queued attempt on
    a3, out3 = _send(h, 7.0, call=3)
    out = h.on_complete(8.0, _of(out0, Send)[0].attempt)
    assert out[0] == Complete(a0) and _of(out, Send)[0].attempt.above is a3 and h.active == 1


def test_a_queued_attempt_whose_client_left_is_dropped_or_sent_on_per_the_queued_disconnect_setting():
    for passes in (True, False):
        h = _gateway("haproxy", max_connections=1, passes_disconnect_queued=passes)
        a0, out0 = _send(h, call=0)
        a1, _ = _send(h, call=1)
        assert h.on_attempt_left(1.0, a1) == []
        out = h.on_complete(2.0, _of(out0, Send)[0].attempt)
        if passes:
            assert out == [Complete(a0)]
        else:
            (send,) = _of(out, Send)
            assert send.attempt.above is a1 and _of(out, RunOn) == [RunOn(send.attempt)]


def test_envoys_route_timeout_covers_every_try_and_its_opt_in_retry_policy_backs_off_below_its_cap():
    e = _gateway("envoy")
    above, out = _send(e, 3.0)
    (timer,) = _of(out, Timer)
    assert timer.at == 3.0 + _value("envoy", "deadline_s")
    assert _of(e.on_timer(timer.at, timer.token), Refuse)[0].status == 504
    e = _gateway("envoy", max_retries=1, retry_on=list(envoy_retry_on("5xx")), r=0.999)
    above, out = _send(e)
    up = _of(out, Send)[0].attempt
    (retry,) = e.on_refused(1.0, up, 503)
    assert 1.0 < retry.at < 1.0 + _value("envoy", "backoff_base_s")      # (2^1 - 1) x base, drawn below it
    up = _of(e.on_timer(retry.at, retry.token), Send)[0].attempt
    assert _of(e.on_refused(2.0, up, 503), Refuse)[0].status == 503       # num_retries spent


def test_litellm_answers_its_timeout_with_408_and_retries_a_5xx_with_its_jittered_backoff():
    g = _gateway("litellm", r=0.0)
    above, out = _send(g)
    up = _of(out, Send)[0].attempt
    base = _value("litellm", "backoff_base_s")
    (retry,) = g.on_refused(1.0, up, 503)
    assert retry.at == pytest.approx(1.0 + base)
    up = _of(g.on_timer(retry.at, retry.token), Send)[0].attempt
    assert up.number == 1
    out = g.on_timer(retry.at + _value("litellm", "timeout_s"), up)
    assert _of(out, RunOn) == [RunOn(up)]         # no cancel_on_disconnect: the call runs on
    (retry,) = _of(out, Timer)                    # a timeout is retried too
    up = _of(g.on_timer(retry.at, retry.token), Send)[0].attempt
    out = g.on_timer(retry.at + 600.0, up)
    assert _of(out, Refuse)[0].status == _value("litellm", "timeout_status") == 408


def test_the_inference_gateway_sheds_a_sheddable_call_only_while_no_engine_has_capacity():
    saturated = [(_value("inference-gateway", "queue_depth_threshold") + 1, 0.1, 0.0)]
    roomy = [(0, 0.1, 0.0)]
    for pods, prio, shed in ((saturated, -1, True), (saturated, 0, False), (roomy, -1, False)):
        g = _gateway("inference-gateway", pods=lambda t, p=pods: p, priority=lambda call, p=prio: p)
        above, out = _send(g)
        if shed:
            assert out == [Refuse(above, _value("inference-gateway", "shed_status"), None, "shed")]
        else:
            assert _of(out, Send)
