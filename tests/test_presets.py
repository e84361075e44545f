"""Each preset's behaviour on the policy object, from the constants its cited
source holds (first backoffs with a fixed random source, what is retried and
what not, a Retry-After above the cap, a disconnect passed on or not), the
attempts a stack multiplies, and the loader refusing bad settings by key."""
import math

import pytest

from sim.policy.presets import PRESETS, citations, keys_of, policies, preset
from sim.policy.retry import (
    CONNECT_ERROR,
    STATUS,
    TIMEOUT,
    Failure,
    GiveUp,
    Refuse,
    Retrier,
    RetryAt,
    backoff_wait,
    envoy_retry_on,
    haproxy_retry_on,
    nginx_next_upstream,
)
from sim.policy.stackinfo import stack_info

# the constants as the cited sources hold them (docs/presets.md)
OPENAI_INITIAL_RETRY_DELAY, OPENAI_MAX_RETRY_DELAY, OPENAI_MAX_RETRY_AFTER = 0.5, 8.0, 120.0   # 3.57.0
OPENAI_1_MAX_RETRY_AFTER = 60.0                                                               # 1.109.1
LITELLM_INITIAL, LITELLM_MAX, LITELLM_JITTER, LITELLM_RA_CAP = 0.5, 8.0, 0.75, 60.0           # 1.110.2
NGINX_READ_TIMEOUT = 60.0                                                                     # 1.22.1
ENVOY_BASE, ENVOY_ROUTE_TIMEOUT = 0.025, 15.0


def layer(kind, name, r=0.0, **kw):
    settings = preset(kind, name, **kw)
    retry, gateway = policies(settings)
    return Retrier(retry, lambda: r, servers=gateway.servers_for_retries if gateway else None), gateway


def waits(retrier, failure_kind=TIMEOUT, status=None, headers=None, sent=True, n=10):
    """The waits a layer takes on a run of identical failures until it gives up."""
    call, t, out = retrier.start(0.0), 0.0, []
    while True:
        retrier.send(call, t)
        d = retrier.on_failure(call, Failure(failure_kind, t + 1.0, status, headers, sent))
        if isinstance(d, GiveUp):
            return out, d
        out.append(d.wait)
        t = d.at
        if len(out) > n:
            return out, None


def first(retrier, kind, status=None, headers=None, sent=True):
    call = retrier.start(0.0)
    retrier.send(call, 0.0)
    return retrier.on_failure(call, Failure(kind, 1.0, status, headers, sent))


# ---- every preset ------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_and_cites_every_value(name):
    p = PRESETS[name]
    settings = preset(p.kind, name)
    assert settings["version"] and settings["kind"] == p.kind
    assert set(p.settings) <= set(keys_of(p.kind))
    assert all(src.strip() for src in citations(name).values())


# ---- openai-python --------------------------------------------------------------------------

@pytest.mark.parametrize("r", [0.0, 0.5, 1.0])
def test_openai_first_backoffs(r):
    got, end = waits(layer("client", "openai-python", r)[0])
    expect = [min(OPENAI_INITIAL_RETRY_DELAY * 2 ** n, OPENAI_MAX_RETRY_DELAY) * (1 - 0.25 * r) for n in range(2)]
    assert got == pytest.approx(expect) and end == GiveUp("attempts")


def test_openai_retries_these_and_not_those():
    c, _ = layer("client", "openai-python")
    for status in (408, 409, 429, 500, 502, 503, 504):
        assert isinstance(first(c, STATUS, status), RetryAt), status
    for status in (400, 401, 403, 404, 422):
        assert first(c, STATUS, status) == GiveUp("not_retryable"), status
    assert isinstance(first(c, TIMEOUT), RetryAt) and isinstance(first(c, CONNECT_ERROR, sent=False), RetryAt)
    assert first(c, STATUS, 503, {"x-should-retry": "false"}) == GiveUp("should_retry_false")


def test_openai_retry_after_up_to_its_cap_then_gives_up():
    c, _ = layer("client", "openai-python")
    at_cap = first(c, STATUS, 429, {"retry-after": str(int(OPENAI_MAX_RETRY_AFTER))})
    assert at_cap.wait == OPENAI_MAX_RETRY_AFTER and at_cap.source == "retry_after"
    assert first(c, STATUS, 429, {"retry-after": str(int(OPENAI_MAX_RETRY_AFTER) + 1)}) == GiveUp("retry_after")
    assert first(c, STATUS, 429, {"retry-after-ms": "2500"}).wait == pytest.approx(2.5)


def test_openai_1x_used_the_backoff_above_its_60s_cap():
    c, _ = layer("client", "openai-python-1")
    above = first(c, STATUS, 429, {"retry-after": str(int(OPENAI_1_MAX_RETRY_AFTER) + 30)})
    assert isinstance(above, RetryAt) and above.source == "backoff" and above.wait == OPENAI_INITIAL_RETRY_DELAY
    assert first(c, STATUS, 429, {"retry-after": "60"}).wait == OPENAI_1_MAX_RETRY_AFTER


def test_openai_default_timeout_bounds_one_attempt_and_a_scenario_overrides_it():
    c, _ = layer("client", "openai-python")
    call = c.start(5.0)
    assert c.send(call, 5.0) == 605.0
    c60, _ = layer("client", "openai-python", timeout_s=60)
    assert c60.send(c60.start(0.0), 0.0) == 60.0


# ---- LangChain --------------------------------------------------------------------------------

def test_chat_openai_has_no_timeout_and_openai_retries():
    c, _ = layer("client", "langchain-openai")
    assert c.send(c.start(0.0), 0.0) == math.inf
    assert c.policy.max_attempts == 3


@pytest.mark.parametrize("r", [0.0, 0.5])
def test_with_retry_waits_are_tenacity_exponential_plus_up_to_a_second(r):
    c, _ = layer("client", "langchain-with-retry", r)
    got, end = waits(c)
    assert got == pytest.approx([1.0 + r, 2.0 + r]) and end == GiveUp("attempts")
    assert isinstance(first(c, STATUS, 400), RetryAt)            # every exception is retried
    assert first(c, STATUS, 429, {"retry-after": "30"}).source == "backoff"


def test_with_retry_around_chat_openai_makes_nine_attempts():
    info = stack_info([preset("client", "langchain-with-retry"), preset("client", "langchain-openai")])
    assert info.engine_attempts == 3 * 3
    assert info.longest_s == math.inf                            # no timeout anywhere


# ---- LiteLLM --------------------------------------------------------------------------------------

@pytest.mark.parametrize("r", [0.0, 1.0])
def test_litellm_backoff_adds_its_jitter_after_the_cap(r):
    g, _ = layer("gateway", "litellm", r)
    got, _ = waits(g, TIMEOUT)
    assert got == pytest.approx([LITELLM_INITIAL + LITELLM_JITTER * r, 2 * LITELLM_INITIAL + LITELLM_JITTER * r])
    long, _ = layer("gateway", "litellm", r, max_retries=8)
    assert waits(long, TIMEOUT)[0][-1] == pytest.approx(LITELLM_MAX + LITELLM_JITTER * r)


def test_litellm_retry_after_above_60s_falls_back_to_the_backoff():
    g, _ = layer("gateway", "litellm", 1.0)
    assert first(g, STATUS, 429, {"retry-after": "30"}).wait == pytest.approx(30 + LITELLM_JITTER)
    above = first(g, STATUS, 429, {"retry-after": str(int(LITELLM_RA_CAP) + 1)})
    assert above.source == "backoff" and above.wait == pytest.approx(LITELLM_INITIAL + LITELLM_JITTER)


def test_litellm_proxy_lets_an_abandoned_call_run_unless_told_to_cancel():
    _, gw = layer("gateway", "litellm")
    assert gw.on_client_disconnect(queued=False) == "run_on"
    _, cancelling = layer("gateway", "litellm", passes_disconnect=True)
    assert cancelling.on_client_disconnect(queued=False) == "cancel"
    assert not gw.marks_down(4) and gw.marks_down(5)             # the minute's failure share from 5 requests on


def test_litellm_reads_whole_seconds_only():
    g, _ = layer("gateway", "litellm", 0.0)
    assert first(g, STATUS, 429, {"retry-after": "1.5"}).source == "backoff"      # int("1.5") fails
    assert first(g, STATUS, 429, {"retry-after-ms": "1500"}).source == "backoff"  # no retry-after-ms
    assert first(g, STATUS, 429, {"retry-after": "2"}).wait == 2.0


# ---- nginx ------------------------------------------------------------------------------------------

def test_nginx_answers_its_read_timeout_with_504_and_does_not_resend_a_post():
    g, gw = layer("gateway", "nginx")
    assert g.send(g.start(0.0), 0.0) == NGINX_READ_TIMEOUT
    assert gw.on_upstream_timeout() == Refuse(504, "upstream_timeout")
    assert first(g, TIMEOUT, sent=True) == GiveUp("non_idempotent")
    assert first(g, STATUS, 502) == GiveUp("not_retryable")


def test_nginx_passes_a_failed_connection_to_the_next_server_at_once():
    one, _ = layer("gateway", "nginx")
    assert first(one, CONNECT_ERROR, sent=False) == GiveUp("no_other_server")
    two, _ = layer("gateway", "nginx", upstream_servers=2)
    d = first(two, CONNECT_ERROR, sent=False)
    assert isinstance(d, RetryAt) and d.wait == 0.0


def test_nginx_passes_the_disconnect_on():
    _, gw = layer("gateway", "nginx")
    assert gw.on_client_disconnect(queued=False) == "cancel"
    _, ignoring = layer("gateway", "nginx", passes_disconnect=False)
    assert ignoring.on_client_disconnect(queued=False) == "run_on"


# ---- HAProxy ----------------------------------------------------------------------------------------

def test_haproxy_retries_a_failed_connection_three_times_after_a_second():
    g, _ = layer("gateway", "haproxy")
    got, end = waits(g, CONNECT_ERROR, sent=False)
    assert got == [1.0, 1.0, 1.0] and end == GiveUp("attempts")
    assert first(g, STATUS, 503) == GiveUp("not_retryable")
    assert first(g, TIMEOUT) == GiveUp("not_retryable")


def test_haproxy_serves_abandoned_requests_and_queues_with_503():
    _, gw = layer("gateway", "haproxy", max_connections=4, queue_timeout_s=30)
    assert gw.on_client_disconnect(queued=False) == "run_on"
    assert gw.on_client_disconnect(queued=True) == "run_on"
    assert gw.on_queue_timeout() == Refuse(503, "queue_timeout")
    _, aborting = layer("gateway", "haproxy", passes_disconnect=True, passes_disconnect_queued=True)
    assert aborting.on_client_disconnect(queued=True) == "cancel"


# ---- Envoy --------------------------------------------------------------------------------------------

def test_envoy_does_not_retry_without_a_policy_and_its_route_timeout_covers_the_call():
    g, gw = layer("gateway", "envoy")
    assert first(g, STATUS, 503) == GiveUp("not_retryable")
    assert g.send(g.start(3.0), 3.0) == 3.0 + ENVOY_ROUTE_TIMEOUT
    assert gw.max_connections == 1024


def test_envoy_retry_policy_backoff_and_its_retry_circuit_breaker():
    g, _ = layer("gateway", "envoy", 0.5, max_retries=1, retry_on=list(envoy_retry_on("5xx")))
    d = first(g, STATUS, 503)
    assert d.wait == pytest.approx(ENVOY_BASE * 0.5)
    call = g.start(0.0)
    g.send(call, 0.0)
    assert g.on_failure(call, Failure(STATUS, 1.0, 503), active_retries=3) == GiveUp("throttled")
    b, _ = layer("gateway", "envoy", max_retries=1, retry_on=["5xx"], throttle="budget")
    call = b.start(0.0)
    b.send(call, 0.0)
    assert isinstance(b.on_failure(call, Failure(STATUS, 1.0, 503), active_requests=100, active_retries=19),
                      RetryAt)


# ---- inference gateway -----------------------------------------------------------------------------------

def test_inference_gateway_sheds_only_sheddable_requests_of_a_saturated_pool():
    _, gw = layer("gateway", "inference-gateway")
    saturated = [(gw.queue_depth_threshold + 1, 0.1, 0.0)]
    roomy = [(gw.queue_depth_threshold, gw.kv_cache_threshold, 0.0)]
    assert gw.sheds(-1, saturated) == Refuse(429, "shed")
    assert gw.sheds(0, saturated) is None
    assert gw.sheds(-1, roomy) is None


# ---- stacks ------------------------------------------------------------------------------------------------

def test_sdk_retries_multiply_by_nginx_tries():
    sdk = preset("client", "openai-python", timeout_s=60)
    plain = stack_info([sdk, preset("gateway", "nginx")])
    assert plain.engine_attempts == sdk["max_retries"] + 1          # nginx never resends a sent POST
    resending = preset("gateway", "nginx", upstream_servers=3, max_tries=2, retry_sent_non_idempotent=True)
    info = stack_info([sdk, resending])
    assert info.engine_attempts == (sdk["max_retries"] + 1) * resending["max_tries"]
    assert info.sent_attempts == (sdk["max_retries"] + 1, (sdk["max_retries"] + 1) * resending["max_tries"])


def test_the_longest_a_call_is_retried_and_who_lets_it_run_on():
    sdk = preset("client", "openai-python", timeout_s=60)
    info = stack_info([sdk, preset("gateway", "nginx")])
    # each attempt lasts at most nginx's read timeout; each wait at most the Retry-After cap
    expect = (sdk["max_retries"] + 1) * NGINX_READ_TIMEOUT + sdk["max_retries"] * OPENAI_MAX_RETRY_AFTER
    assert info.longest_s == pytest.approx(expect)
    assert info.runs_on == ()
    lite = stack_info([preset("client", "openai-python"), preset("gateway", "litellm")])
    assert lite.runs_on == ("litellm",) and lite.engine_attempts == 3 * 3
    hap = stack_info([preset("client", "openai-python"), preset("gateway", "haproxy", max_connections=8)])
    assert hap.layers[1].runs_on == ("upstream", "queued")
    assert hap.engine_attempts == 3                                  # HAProxy resends only unsent requests
    assert hap.layers[1].span_s == math.inf                          # no queue timeout, no server timeout
    sdk_default = preset("client", "openai-python")                  # ... but the SDK gives each attempt up
    assert hap.longest_s == pytest.approx((sdk_default["max_retries"] + 1) * sdk_default["timeout_s"]
                                          + sdk_default["max_retries"] * OPENAI_MAX_RETRY_AFTER)


def test_gateway_retry_lines_as_the_software_writes_them():
    on, non_idempotent = nginx_next_upstream("error timeout http_503 non_idempotent")
    resending = preset("gateway", "nginx", upstream_servers=2, retry_on=list(on),
                       retry_sent_non_idempotent=non_idempotent)
    sdk = preset("client", "openai-python")
    assert stack_info([sdk, resending]).engine_attempts == (sdk["max_retries"] + 1) * resending["upstream_servers"]
    assert nginx_next_upstream("off") == ((), False)
    hap = preset("gateway", "haproxy", retry_on=list(haproxy_retry_on("all-retryable-errors")))
    assert stack_info([sdk, hap]).engine_attempts == (sdk["max_retries"] + 1) * (hap["max_retries"] + 1)
    assert haproxy_retry_on("conn-failure 503") == ("connect_error", "503")
    with pytest.raises(ValueError, match="^retry_on:"):
        haproxy_retry_on("sometimes")


# ---- the loader --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,name,kw,key", [
    ("client", "openai-pythn", {}, "preset"),
    ("client", "nginx", {}, "preset"),
    ("client", "openai-python", {"timeout": 60}, "timeout"),
    ("client", "openai-python", {"max_connections": 4}, "max_connections"),
    ("client", "openai-python", {"timeout_s": -1}, "timeout_s"),
    ("client", "openai-python", {"backoff_cap_s": 0.1}, "backoff_cap_s"),
    ("gateway", "haproxy", {"queue_timeout_s": -3}, "queue_timeout_s"),
    ("gateway", "envoy", {"retry_on": ["5xx", "sometimes"]}, "retry_on"),
    ("engine", "openai-python", {}, "kind"),
])
def test_bad_layer_settings_are_refused_in_one_line_naming_the_key(kind, name, kw, key):
    with pytest.raises(ValueError) as e:
        preset(kind, name, **kw)
    msg = str(e.value)
    assert msg.startswith(f"{key}:") and "\n" not in msg


def test_overrides_from_toml_lists_become_tuples():
    s = preset("gateway", "envoy", retry_on=["5xx"], max_retries=1)
    assert s["retry_on"] == ("5xx",)
    assert policies(s)[0].retries_on(STATUS, 503)


def test_the_real_openai_sdk_agrees_on_backoffs_and_on_what_it_retries(monkeypatch):
    """The real openai-python (a test dependency): its own
    _calculate_retry_timeout and _should_retry agree with the preset."""
    import httpx2
    import openai
    from openai import _base_client
    from openai._models import FinalRequestOptions
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1:9/v1")
    c, _ = layer("client", "openai-python", 0.4)
    monkeypatch.setattr(_base_client, "random", lambda: 0.4)
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    for retries_taken in range(client.max_retries):
        real = client._calculate_retry_timeout(client.max_retries - retries_taken, options, None)
        assert backoff_wait(c.policy, retries_taken, lambda: 0.4) == pytest.approx(real)
    cases = [(503, {}), (429, {"retry-after": "30"}), (429, {"retry-after": "121"}), (400, {}),
             (409, {}), (500, {"x-should-retry": "false"}), (418, {"x-should-retry": "true"})]
    for status, headers in cases:
        real = client._should_retry(httpx2.Response(status, headers=headers))
        assert isinstance(first(c, STATUS, status, headers), RetryAt) == real, (status, headers)


def test_the_real_tenacity_wait_agrees_with_with_retry(monkeypatch):
    """The real tenacity (a test dependency; langchain-core's retry library):
    the wait with_retry() builds agrees with the preset."""
    import random as stdlib_random

    import tenacity
    monkeypatch.setattr(stdlib_random, "uniform", lambda a, b: a + (b - a) * 0.3)
    wait = tenacity.wait_exponential_jitter()                 # RunnableRetry's, with no parameters
    c, _ = layer("client", "langchain-with-retry", 0.3)
    for attempt_number in (1, 2, 3, 10):
        state = type("State", (), {"attempt_number": attempt_number})()
        assert backoff_wait(c.policy, attempt_number - 1, lambda: 0.3) == pytest.approx(wait(state))


def test_docs_cite_every_preset_value():
    """docs/presets.md has a section per preset with its version and every
    value's source, as the presets hold them."""
    from pathlib import Path
    text = (Path(__file__).resolve().parent.parent / "docs" / "presets.md").read_text()
    for name, p in PRESETS.items():
        start = text.index(f"Preset `{name}`, kind `{p.kind}`")
        end = text.find("\n## ", start)
        section = text[start:end if end > 0 else len(text)]
        assert p.version in section, name
        for key, cited in p.settings.items():
            row = next((line for line in section.splitlines() if line.startswith(f"| `{key}` |")), "")
            assert cited.source.replace("|", "\\|") in row, (name, key)
