"""Client layers one inside another (`sim.policy.client.NestedClients`): an
application's retry loop around an SDK's, each outer attempt one call through
the inner layer; on hand-written event sequences, and in a run of a scenario
with two client [[layer]]s."""
from __future__ import annotations

import pytest

from sim.deployment import from_document
from sim.policy.client import CallState, NestedClients, RetryingClient
from sim.policy.retry import RetryPolicy
from sim.schema import ScenarioError
from test_preset_client import TINY


def layer(**kw) -> RetryingClient:
    """A client layer retrying every failure after a fixed wait."""
    base = dict(retry_on=("timeout", "4xx", "5xx"), backoff="fixed", retry_after=True,
                retry_after_formats=("seconds",))
    return RetryingClient(RetryPolicy(**(base | kw)), lambda a, b: a)


def test_inner_retries_run_inside_one_outer_attempt_and_a_give_up_fails_it():
    outer = layer(timeout_s=1000.0, max_retries=1, backoff_base_s=10.0)
    inner = layer(timeout_s=100.0, max_retries=2, backoff_base_s=1.0)
    c, call = NestedClients([outer, inner]), CallState(0, 0.0)
    t = 0.0
    for n in range(3):                              # the inner layer's three attempts
        assert c.send(call, t) == n and call.deadline == t + 100.0
        d = c.timed_out(call, t + 100.0)
        t = t + 100.0
        if n < 2:
            assert d.at == t + 1.0
            t += 1.0
    assert d.at == t + 10.0                     # the inner call gave up: the outer attempt failed, retried
    t += 10.0
    assert c.send(call, t) == 3 and call.deadline == t + 100.0     # a new inner call
    for n in range(3):
        d = c.refused(call, t, 503)
        if n < 2:
            t += 1.0
            assert d.at == t
            c.send(call, t)
    assert d is None and call.done and call.outcome == "failed_attempts"
    assert call.attempts == 6 and not c.states


def test_an_outer_timeout_gives_up_the_inner_attempt_and_its_retries():
    outer = layer(timeout_s=150.0, max_retries=1, backoff_base_s=5.0)
    inner = layer(timeout_s=100.0, max_retries=5, backoff_base_s=60.0)
    c, call = NestedClients([outer, inner]), CallState(0, 0.0)
    c.send(call, 0.0)
    assert call.deadline == 100.0                   # the inner attempt's timeout comes first
    # the inner retry would be due at 160, after the outer attempt's 150: the outer times out at 150
    assert c.timed_out(call, 100.0).at == 155.0
    assert c.send(call, 155.0) == 1 and call.deadline == 255.0     # the outer's second attempt, a fresh inner call
    d = c.refused(call, 200.0, 429, 30.0)        # inner: Retry-After 30 s -> 230, before the outer's 305
    assert d.at == 230.0
    assert c.send(call, 230.0) == 2 and call.deadline == 155.0 + 150.0   # the outer's deadline is now the earliest
    d = c.timed_out(call, 305.0)                  # the outer's: no retry left there
    assert d is None and call.done and call.outcome == "failed_attempts" and call.attempts == 3


def test_a_delivered_response_ends_every_layer():
    c, call = NestedClients([layer(timeout_s=50.0), layer(timeout_s=10.0)]), CallState(0, 0.0)
    c.send(call, 0.0)
    assert c.completed(call, 3.0) is None and call.outcome == "delivered" and not c.states


def test_one_layer_is_not_nested():
    with pytest.raises(ValueError, match="two client layers"):
        NestedClients([layer()])


def test_a_run_of_two_client_layers_multiplies_their_attempts():
    one = from_document({**TINY, "layer": [{"preset": "openai-python", "timeout_s": 2.0, "max_retries": 1}]},
                        "one.toml").run(0)
    two = from_document({**TINY, "layer": [{"preset": "langchain-with-retry", "max_retries": 1},
                                           {"preset": "openai-python", "timeout_s": 2.0, "max_retries": 1}]},
                        "two.toml").run(0)
    a1, a2 = one["attempts"], two["attempts"]
    assert a1["first"] == a2["first"]
    # at most 2 attempts a call through one layer, at most 4 through the two
    assert a1["retries"] <= a1["first"] and a2["retries"] <= 3 * a2["first"]
    assert a2["retries"] > a1["retries"]


def test_client_layers_stand_above_the_others():
    dep = from_document({**TINY, "layer": [{"preset": "nginx"}, {"preset": "openai-python"}]}, "bad.toml")
    with pytest.raises(ScenarioError, match="client layers first"):
        dep.run(0)
