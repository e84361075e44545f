"""A new kind of layer is its module, its schema rows, its tests and its
docs page: a kind registered here, in the test file (`sim.policy.layers.register`),
with its key as one more schema row, is read from a scenario's [[layer]]
table and runs through `Deployment.run` and `sim.model.Run` with no edit
anywhere else."""
from __future__ import annotations

import numpy as np
import pytest

from sim.deployment import from_document
from sim.model import Run
from sim.policy.layers import LayerKind, Leave, Send, Timer, Upstream, kinds, layer_kind, register
from sim.policy.proxy import Complete, Refuse
from sim.schema import NUMBER, SCHEMA, Key, ScenarioError
from test_preset_client import TINY


class Hold:
    """A test layer: holds each attempt from above `hold_s` before sending
    it on, passes answers up and disconnects down."""

    def __init__(self, hold_s: float):
        self.hold_s = hold_s
        self.sent: dict = {}            # attempt from above -> its upstream attempt
        self.counts = {"upstream_attempts": 0}

    def on_attempt(self, t, attempt, params=(), prompt_len=0):
        return [Timer(t + self.hold_s, self, attempt)]

    def on_timer(self, t, attempt):
        if not attempt.open:
            return []
        up = self.sent[attempt] = Upstream(attempt.call_id, attempt.number, attempt.deadline, self, attempt)
        self.counts["upstream_attempts"] += 1
        return [Send(up)]

    def on_attempt_left(self, t, attempt):
        attempt.open = False
        up = self.sent.pop(attempt, None)
        return [Leave(up)] if up is not None else []

    def _answer(self, up, answer):
        if self.sent.get(up.above) is not up:
            return []
        del self.sent[up.above]
        up.above.open = False
        return [answer]

    def on_complete(self, t, up):
        return self._answer(up, Complete(up.above))

    def on_refused(self, t, up, status, retry_after=None, reason=""):
        return self._answer(up, Refuse(up.above, status, retry_after, reason))

    def upstream_of(self, attempt):
        return self.sent.get(attempt)


def _settings(preset, overrides):
    if preset is not None:
        raise ValueError("preset: a hold layer takes none")
    return {"kind": "hold", "hold_s": float(overrides.get("hold_s", 0.0))}


register(LayerKind("hold", _settings, lambda settings, context: Hold(settings["hold_s"])))
SCHEMA_WITH_HOLD = SCHEMA.with_rows(Key("layer", "hold_s", NUMBER, "a hold layer: seconds it holds an attempt",
                                        lo=0))


def _dep(table):
    return from_document({**TINY, "layer": [table]}, "hold.toml", schema=SCHEMA_WITH_HOLD)


def test_a_layer_kind_registered_by_its_module_runs_through_run():
    assert "hold" in kinds() and layer_kind("hold").make is not None
    dep = _dep({"kind": "hold", "hold_s": 0.5})
    cond = dep.condition_for()
    run = Run(dep.profile, dep.trace(0), cond, dep.scenario, 0, stack=dep.stack_for(cond))
    log = run.run()
    (hold,) = run.layers
    assert type(hold) is Hold and hold.counts["upstream_attempts"] == len(log.executions) > 0
    # each execution was made 0.5 s after the client's attempt it serves was sent
    row_of = {int(e): i for i, e in enumerate(log.attempts.execution) if e >= 0 and not log.attempts.attached[i]}
    created = log.executions.column("created_at")
    sent = np.array([log.attempts.sent_at[row_of[i]] for i in range(len(created))])
    assert np.allclose(created - sent, 0.5)
    rec = dep.run(0)
    assert rec["extra"]["layers"] == [{"kind": "hold", "preset": None, "upstream_attempts": len(log.executions)}]


@pytest.mark.parametrize("table, message", [
    ({"kind": "hold", "hold_s": -1}, r"layer\[0\]\.hold_s must be non-negative"),
    ({"kind": "hold", "preset": "nginx"}, r"layer\[0\]\.preset a hold layer takes none"),
    ({"kind": "nope"}, r"layer\[0\]\.kind unknown layer kind 'nope'"),
])
def test_a_bad_table_of_a_registered_kind_ends_in_one_line(table, message):
    with pytest.raises(ScenarioError, match=r"^hold\.toml: " + message):
        _dep(table)
