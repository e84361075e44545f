"""The retry policy and the gateway pieces on their own: backoff families,
Retry-After parsing and its cap, the "do not retry" header, non-idempotent
requests, the token bucket and the retry budget arithmetic, gateway queues,
disconnects and shedding, and bad settings refused with the key named."""
import calendar
import math

import pytest
from hypothesis import given, settings, strategies as st

from sim.policy.retry import (
    CONNECT_ERROR,
    STATUS,
    TIMEOUT,
    Admit,
    Failure,
    GatewayPolicy,
    GiveUp,
    Refuse,
    Retrier,
    RetryAt,
    RetryPolicy,
    SaturationRule,
    TokenBucket,
    backoff_wait,
    envoy_retry_limit,
    envoy_retry_on,
    parse_retry_after,
    statuses,
)


def fixed(r):
    return lambda: r


def exp_policy(**kw):
    base = dict(max_retries=5, retry_on=("timeout", "connect_error", "429", "5xx"), backoff="exponential",
                backoff_base_s=0.5, backoff_factor=2.0, backoff_cap_s=8.0)
    base.update(kw)
    return RetryPolicy(**base)


# ---- backoff families ---------------------------------------------------------------

def test_exponential_without_jitter_doubles_up_to_the_cap():
    p = exp_policy()
    waits = [backoff_wait(p, n, fixed(0.5)) for n in range(6)]
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0]
    assert waits[4] == waits[5] == p.backoff_cap_s


def test_full_jitter_draws_below_the_capped_wait():
    p = exp_policy(jitter="full")
    assert backoff_wait(p, 2, fixed(0.0)) == 0.0
    assert backoff_wait(p, 2, fixed(0.5)) == pytest.approx(1.0)
    assert backoff_wait(p, 9, fixed(0.5)) == pytest.approx(4.0)     # half of the 8 s cap


def test_equal_jitter_keeps_half_the_wait():
    p = exp_policy(jitter="equal")
    assert backoff_wait(p, 3, fixed(0.0)) == pytest.approx(2.0)
    assert backoff_wait(p, 3, fixed(0.999)) == pytest.approx(4.0, rel=1e-3)


def test_multiplicative_jitter_takes_off_up_to_its_fraction():
    p = exp_policy(jitter="multiplicative", jitter_amount=0.25)
    assert backoff_wait(p, 1, fixed(0.0)) == pytest.approx(1.0)
    assert backoff_wait(p, 1, fixed(1.0)) == pytest.approx(0.75)


def test_additive_jitter_inside_or_outside_the_cap():
    inside = exp_policy(jitter="additive", jitter_amount=0.75, cap_bounds_jitter=True)
    outside = exp_policy(jitter="additive", jitter_amount=0.75, cap_bounds_jitter=False)
    assert backoff_wait(inside, 10, fixed(1.0)) == pytest.approx(8.0)
    assert backoff_wait(outside, 10, fixed(1.0)) == pytest.approx(8.75)
    assert backoff_wait(inside, 0, fixed(1.0)) == pytest.approx(1.25)


def test_uniform_and_fixed_backoffs():
    u = RetryPolicy(backoff="uniform", backoff_base_s=0.25, backoff_cap_s=3.0)
    assert backoff_wait(u, 0, fixed(0.0)) == 0.25
    assert backoff_wait(u, 7, fixed(1.0)) == pytest.approx(3.0)
    f = RetryPolicy(backoff="fixed", backoff_base_s=1.0)
    assert {backoff_wait(f, n, fixed(0.3)) for n in range(4)} == {1.0}


def test_envoy_backoff_ceilings_are_2n_minus_1_bases():
    p = RetryPolicy(backoff="envoy", backoff_base_s=0.025, backoff_cap_s=0.25)
    assert [p.backoff_ceiling(n) for n in range(4)] == pytest.approx([0.025, 0.075, 0.175, 0.25])
    assert backoff_wait(p, 1, fixed(0.5)) == pytest.approx(0.0375)


def test_a_huge_retry_count_stays_at_the_cap():
    p = exp_policy(jitter="none")
    assert backoff_wait(p, 10 ** 6, fixed(0.0)) == p.backoff_cap_s


@settings(max_examples=200, deadline=None)
@given(family=st.sampled_from(["uniform", "exponential", "envoy", "fixed"]),
       jitter=st.sampled_from(["none", "full", "equal", "multiplicative", "additive"]),
       base=st.floats(0, 10), extra=st.floats(0, 100), factor=st.floats(1, 4),
       amount=st.floats(0, 1), n=st.integers(0, 2000), r=st.floats(0, 1, exclude_max=True))
def test_backoff_is_always_within_zero_and_the_cap(family, jitter, base, extra, factor, amount, n, r):
    p = RetryPolicy(backoff=family, backoff_base_s=base, backoff_cap_s=base + extra, backoff_factor=factor,
                    jitter=jitter, jitter_amount=amount)
    w = backoff_wait(p, n, fixed(r))
    assert 0 <= w <= p.backoff_cap_s + 1e-9
    assert w <= p.backoff_ceiling(n) + 1e-9


# ---- Retry-After ----------------------------------------------------------------------

def test_retry_after_ms_is_preferred_then_seconds_then_a_date():
    assert parse_retry_after({"Retry-After-Ms": "1500", "Retry-After": "9"}) == pytest.approx(1.5)
    assert parse_retry_after({"retry-after": "2.5"}) == pytest.approx(2.5)
    assert parse_retry_after({"retry-after": "9"}, formats=("ms",)) is None


def test_a_retry_after_date_is_taken_relative_to_the_response():
    h = {"retry-after": "Wed, 21 Oct 2015 07:28:30 GMT", "date": "Wed, 21 Oct 2015 07:28:00 GMT"}
    assert parse_retry_after(h) == pytest.approx(30.0)
    no_date = {"retry-after": "Wed, 21 Oct 2015 07:28:30 GMT"}
    assert parse_retry_after(no_date) is None               # no clock to compare with
    epoch = calendar.timegm((2015, 10, 21, 7, 28, 0))       # the response's time, 07:28:00 GMT
    assert parse_retry_after(no_date, response_epoch=epoch) == pytest.approx(30.0)
    assert parse_retry_after({"retry-after": "soon"}) is None


def _retry_after_policy(above):
    return exp_policy(retry_after=True, retry_after_cap_s=60.0, retry_after_above_cap=above)


@pytest.mark.parametrize("above,expect", [("give_up", GiveUp), ("clamp", RetryAt), ("backoff", RetryAt)])
def test_a_retry_after_above_the_cap(above, expect):
    r = Retrier(_retry_after_policy(above), fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    d = r.on_failure(call, Failure(STATUS, 1.0, 429, {"retry-after": "600"}))
    assert isinstance(d, expect)
    if above == "clamp":
        assert d.wait == 60.0 and d.source == "retry_after"
    elif above == "backoff":
        assert d.wait == 0.5 and d.source == "backoff"


def test_a_retry_after_within_the_cap_is_the_wait_and_zero_falls_back():
    r = Retrier(_retry_after_policy("give_up"), fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    d = r.on_failure(call, Failure(STATUS, 4.0, 503, {"retry-after": "30"}))
    assert (d.at, d.source) == (34.0, "retry_after")
    r.send(call, d.at)
    d = r.on_failure(call, Failure(STATUS, 40.0, 503, {"retry-after": "0"}))
    assert d.source == "backoff"


# ---- what is retried ------------------------------------------------------------------

def test_retry_on_sets():
    p = RetryPolicy(retry_on=("connect_error", "408", "5xx"))
    assert p.retries_on(CONNECT_ERROR) and not p.retries_on(TIMEOUT)
    assert p.retries_on(STATUS, 408) and p.retries_on(STATUS, 599) and not p.retries_on(STATUS, 429)
    assert statuses(["4xx"]) == frozenset(range(400, 500))
    assert envoy_retry_on("gateway-error") == ("502", "503", "504", "timeout")


def test_should_retry_header_overrides_the_status():
    p = exp_policy(should_retry_header=True)
    r = Retrier(p, fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    assert r.on_failure(call, Failure(STATUS, 1.0, 503, {"x-should-retry": "false"})) == GiveUp("should_retry_false")
    call = r.start(0.0)
    r.send(call, 0.0)
    assert isinstance(r.on_failure(call, Failure(STATUS, 1.0, 400, {"x-should-retry": "true"})), RetryAt)
    deaf = Retrier(exp_policy(should_retry_header=False), fixed(0.0))
    call = deaf.start(0.0)
    deaf.send(call, 0.0)
    assert isinstance(deaf.on_failure(call, Failure(STATUS, 1.0, 503, {"x-should-retry": "false"})), RetryAt)


def test_a_sent_post_is_not_resent_by_a_non_idempotent_policy():
    r = Retrier(exp_policy(retry_sent_non_idempotent=False), fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    assert r.on_failure(call, Failure(TIMEOUT, 60.0, sent=True)) == GiveUp("non_idempotent")
    call = r.start(0.0)
    r.send(call, 0.0)
    assert isinstance(r.on_failure(call, Failure(CONNECT_ERROR, 0.1, sent=False)), RetryAt)
    call = r.start(0.0)
    r.send(call, 0.0)
    assert isinstance(r.on_failure(call, Failure(CONNECT_ERROR, 0.1)), RetryAt)    # a refused connection sent nothing
    call = r.start(0.0)
    r.send(call, 0.0)
    assert r.on_failure(call, Failure(CONNECT_ERROR, 0.1, sent=True)) == GiveUp("non_idempotent")  # reset after


def test_max_retries_max_tries_and_servers_bound_the_attempts():
    for policy, servers, attempts in ((exp_policy(max_retries=2), None, 3),
                                      (exp_policy(max_retries=None, max_tries=4), None, 4),
                                      (exp_policy(max_retries=None), 2, 2)):
        r = Retrier(policy, fixed(0.0), servers=servers)
        call, t, sent = r.start(0.0), 0.0, 0
        while True:
            r.send(call, t)
            sent += 1
            d = r.on_failure(call, Failure(CONNECT_ERROR, t, sent=False))
            if isinstance(d, GiveUp):
                break
            t = d.at
        assert sent == attempts


def test_the_deadline_spans_the_retries_and_the_timeout_one_attempt():
    p = exp_policy(timeout_s=10.0, deadline_s=25.0)
    r = Retrier(p, fixed(0.0))
    call = r.start(100.0)
    assert r.send(call, 100.0) == 110.0
    d = r.on_failure(call, Failure(TIMEOUT, 110.0))
    assert r.send(call, d.at) == 120.5
    d = r.on_failure(call, Failure(TIMEOUT, 120.5))
    assert r.send(call, d.at) == 125.0          # the deadline comes first
    assert r.on_failure(call, Failure(TIMEOUT, 125.0)) == GiveUp("deadline")


def test_tries_timeout_stops_retries_after_it():
    r = Retrier(exp_policy(tries_timeout_s=5.0, backoff="none", backoff_cap_s=None), fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    assert isinstance(r.on_failure(call, Failure(CONNECT_ERROR, 4.0, sent=False)), RetryAt)
    r.send(call, 4.0)
    assert r.on_failure(call, Failure(CONNECT_ERROR, 5.0, sent=False)) == GiveUp("tries_timeout")


# ---- throttling -----------------------------------------------------------------------

def test_token_bucket_arithmetic():
    b = TokenBucket(10, 0.1)
    for _ in range(5):
        b.on_failure()
    assert b.tokens == 5.0 and not b.allows_retry()     # 5 is not above 10 / 2
    b.on_success()
    assert b.tokens == pytest.approx(5.1) and b.allows_retry()
    for _ in range(100):
        b.on_success()
    assert b.tokens == 10.0


@settings(max_examples=200, deadline=None)
@given(max_tokens=st.floats(0.5, 1000), ratio=st.floats(0.001, 5), events=st.lists(st.booleans(), max_size=300))
def test_a_bucket_never_exceeds_max_tokens_nor_goes_below_zero(max_tokens, ratio, events):
    b = TokenBucket(max_tokens, ratio)
    for ok in events:
        b.on_success() if ok else b.on_failure()
        assert 0 <= b.tokens <= b.max_tokens
        assert b.allows_retry() == (b.tokens > b.max_tokens / 2)


def test_a_bucket_throttles_a_layers_retries():
    r = Retrier(exp_policy(throttle="token_bucket", bucket_max_tokens=4, bucket_token_ratio=0.5), fixed(0.0))
    outcomes = []
    for _ in range(4):
        call = r.start(0.0)
        r.send(call, 0.0)
        outcomes.append(r.on_failure(call, Failure(CONNECT_ERROR, 0.0, sent=False)))
    assert isinstance(outcomes[0], RetryAt)                  # 3 tokens left, above 2
    assert outcomes[1] == GiveUp("throttled")                # 2 left: not above 2


def test_envoy_budget_arithmetic():
    assert envoy_retry_limit(100, 0, 25.0, 3) == 25
    assert envoy_retry_limit(80, 20, 20.0, 3) == 20
    assert envoy_retry_limit(5, 0, 20.0, 3) == 3             # never below min_retry_concurrency
    r = Retrier(exp_policy(throttle="budget", budget_percent=20.0, min_retry_concurrency=3), fixed(0.0))
    call = r.start(0.0)
    r.send(call, 0.0)
    assert r.on_failure(call, Failure(CONNECT_ERROR, 0.0, sent=False), active_requests=50,
                        active_retries=10) == GiveUp("throttled")
    call = r.start(0.0)
    r.send(call, 0.0)
    assert isinstance(r.on_failure(call, Failure(CONNECT_ERROR, 0.0, sent=False), active_requests=50,
                                   active_retries=9), RetryAt)


# ---- gateway pieces ---------------------------------------------------------------------

def test_connection_limit_queue_and_queue_timeout():
    g = GatewayPolicy(max_connections=2, max_queue=1, queue_timeout_s=5.0)
    assert g.admit(1, 0) == Admit("dispatch")
    assert g.admit(2, 0) == Admit("queue")
    assert g.admit(2, 1) == Refuse(503, "queue_full")
    assert g.queue_expires_at(10.0) == 15.0 and g.on_queue_timeout() == Refuse(503, "queue_timeout")
    assert GatewayPolicy().admit(10 ** 6, 0) == Admit("dispatch")
    assert GatewayPolicy().queue_expires_at(1.0) == math.inf


def test_upstream_timeout_and_disconnects():
    g = GatewayPolicy(timeout_status=504, passes_disconnect=False, passes_disconnect_queued=True)
    assert g.on_upstream_timeout() == Refuse(504, "upstream_timeout")
    assert g.on_client_disconnect(queued=False) == "run_on"
    assert g.on_client_disconnect(queued=True) == "cancel"


def test_saturation_rule_and_shedding():
    rule = SaturationRule(queue_depth_threshold=5, kv_cache_threshold=0.8, metrics_staleness_s=0.2)
    assert not rule.saturated([(5, 0.8, 0.0)])               # at the thresholds: still capacity
    assert rule.saturated([(6, 0.1, 0.0), (0, 0.9, 0.0)])
    assert rule.saturated([(0, 0.0, 1.0)])                   # stale metrics count for nothing
    assert rule.saturated([])
    g = GatewayPolicy(shed="sheddable", shed_status=429)
    busy = [(9, 0.95, 0.0)]
    assert g.sheds(-1, busy) == Refuse(429, "shed")
    assert g.sheds(0, busy) is None and g.sheds(-1, [(0, 0.1, 0.0)]) is None
    assert GatewayPolicy().sheds(-1, busy) is None


# ---- bad settings -----------------------------------------------------------------------

@pytest.mark.parametrize("kw,key", [
    (dict(timeout_s=-1), "timeout_s"),
    (dict(deadline_s=0), "deadline_s"),
    (dict(max_retries=-1), "max_retries"),
    (dict(backoff="exponential", backoff_base_s=2.0, backoff_cap_s=1.0), "backoff_cap_s"),
    (dict(backoff="exponential", backoff_base_s=1.0), "backoff_cap_s"),
    (dict(backoff="sometimes"), "backoff"),
    (dict(jitter="multiplicative", jitter_amount=2.0), "jitter_amount"),
    (dict(retry_on=("429", "teapot")), "retry_on"),
    (dict(retry_on="5xx"), "retry_on"),
    (dict(retry_on=("99",)), "retry_on"),
    (dict(retry_after_above_cap="wait"), "retry_after_above_cap"),
    (dict(bucket_max_tokens=2000), "bucket_max_tokens"),
    (dict(budget_percent=120), "budget_percent"),
])
def test_bad_retry_settings_name_the_key(kw, key):
    with pytest.raises(ValueError) as e:
        RetryPolicy(**kw)
    assert str(e.value).startswith(f"{key}:") and "\n" not in str(e.value)


@pytest.mark.parametrize("kw,key", [
    (dict(queue_timeout_s=-5), "queue_timeout_s"),
    (dict(max_connections=-1), "max_connections"),
    (dict(upstream_servers=0), "upstream_servers"),
    (dict(kv_cache_threshold=1.5), "kv_cache_threshold"),
    (dict(shed="always"), "shed"),
    (dict(timeout_status=42), "timeout_status"),
])
def test_bad_gateway_settings_name_the_key(kw, key):
    with pytest.raises(ValueError) as e:
        GatewayPolicy(**kw)
    assert str(e.value).startswith(f"{key}:")
