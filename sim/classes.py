"""Traffic classes on the driver's side (docs/classes.md): each call's client
settings and engine priority follow its class (`Scenario.classes`, the
trace's `klass` column).

- `clients(default, condition, scenario, trace, uniform)`: the client layer of a run.
  Without classes it is the one `RetryingClient` of the condition, as ever;
  with classes, `ClassClients`, one `RetryingClient` per class (the class's
  deadline, retries, backoff and Retry-After cap; the condition's retries
  on/off still rule), chosen by the call's class. All of them draw their
  backoff waits from the same `uniform` stream. `default` is the reference
  client's `ClientConfig`, a client layer's effective settings (a preset,
  `sim.policy.preset_client`) or a tuple of them (client layers one inside
  another, `NestedClients`); for a layer a class's keys become the
  layer's, the innermost's of several (`class_layer_settings`).
- `call_priorities(trace, scenario)`: each call's priority, which its
  executions carry to the engine (`Request.priority`): the class's, 0
  without classes.
- `call_classes(trace, scenario)`: each call's class name, which its
  attempts carry to the proxy (`Attempt.klass`, for shedding by class);
  None without classes.
- `call_objectives(trace, scenario)`: each call's priority as an inference
  gateway reads it (the Inference Extension's InferenceObjective priority:
  below 0 is sheddable): -1 for a call of a class the verdict does not need
  to recover (`must_recover = false`: best-effort traffic), else 0.
"""
from __future__ import annotations

from .conditions import Condition
from .policy.client import CallState, ClientConfig, ClientLayer, NestedClients, RetryingClient
from .policy.layers import LayerContext, layer_kind
from .scenario import Scenario, TrafficClass
from .workload import Trace


class ClassClients(ClientLayer):
    """The client layer of a run with traffic classes: each call is decided
    for by its class's `RetryingClient` (`sim.policy.client.ClientLayer`)."""

    def __init__(self, by_class: list[RetryingClient], klass):
        self.by_class = by_class
        self.klass = klass                  # class index of each call

    def send(self, call: CallState, t: float) -> int:
        return self.by_class[self.klass[call.call_id]].send(call, t)

    def timed_out(self, call: CallState, t: float):
        return self.by_class[self.klass[call.call_id]].timed_out(call, t)

    def refused(self, call: CallState, t: float, status: int, retry_after: float | None = None):
        return self.by_class[self.klass[call.call_id]].refused(call, t, status, retry_after)

    def completed(self, call: CallState, t: float) -> None:
        self.by_class[self.klass[call.call_id]].completed(call, t)


# a class's client keys as a client layer's policy keys
LAYER_KEYS = {"deadline_s": "timeout_s", "max_retries": "max_retries", "backoff_min_s": "backoff_base_s",
              "backoff_max_s": "backoff_cap_s", "max_retry_after_s": "retry_after_cap_s"}


def class_layer_settings(settings: dict, klass: TrafficClass, condition: Condition) -> dict:
    """A client layer's effective settings for the calls of `klass`: the
    class's deadline as the layer's per-attempt timeout, its retries, its
    backoff range as the backoff's base and cap, its Retry-After cap (left
    unset, the class's deadline when it sets one, as for the reference
    client); retries stay off where the condition turns them off."""
    kw = {LAYER_KEYS[k]: getattr(klass, k) for k in LAYER_KEYS if getattr(klass, k) is not None}
    if klass.deadline_s is not None and klass.max_retry_after_s is None:
        kw["retry_after_cap_s"] = float(klass.deadline_s)
    if not condition.retries:
        kw.pop("max_retries", None)
    return dict(settings, **kw)


def clients(default: ClientConfig | dict | tuple, condition: Condition, scenario: Scenario, trace: Trace, uniform):
    """The run's client layer (module docstring): `default` (the stack's
    client) without classes, else one client per class."""
    if not isinstance(default, ClientConfig):
        layers = default if isinstance(default, tuple) else (default,)

        def client(inner: dict):            # the layers (registered kinds), the innermost with `inner` settings
            made = [layer_kind(s["kind"]).make(s, LayerContext(uniform)) for s in layers[:-1] + (inner,)]
            return made[0] if len(made) == 1 else NestedClients(made)
        if not scenario.classes or trace.klass is None:
            return client(layers[-1])
        return ClassClients([client(class_layer_settings(layers[-1], c, condition)) for c in scenario.classes],
                            trace.klass.tolist())
    if not scenario.classes or trace.klass is None:
        return RetryingClient(default, uniform)
    return ClassClients([RetryingClient(condition.client_config(c.client(scenario)), uniform)
                         for c in scenario.classes], trace.klass.tolist())


def call_priorities(trace: Trace, scenario: Scenario) -> list[int]:
    """Each call's engine priority: its class's, 0 without classes."""
    if not scenario.classes or trace.klass is None:
        return [0] * len(trace)
    prio = [c.priority for c in scenario.classes]
    return [prio[k] for k in trace.klass.tolist()]


def call_classes(trace: Trace, scenario: Scenario) -> list:
    """Each call's class name (None without classes)."""
    if not scenario.classes or trace.klass is None:
        return [None] * len(trace)
    names = [c.name for c in scenario.classes]
    return [names[k] for k in trace.klass.tolist()]
def call_objectives(trace: Trace, scenario: Scenario) -> list[int]:
    """Each call's priority as an inference gateway sheds by it (module docstring)."""
    if not scenario.classes or trace.klass is None:
        return [0] * len(trace)
    prio = [0 if c.must_recover else -1 for c in scenario.classes]
    return [prio[k] for k in trace.klass.tolist()]
