"""The stack of layers: a condition and a router config name the layers in
order; the two placements of the proxy bind to a cluster as one proxy and a
placement of executions; one interpreter carries actions out in the order a
nested call would; one driver runs a cluster of one or of many."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sim.conditions import compose
from sim.model import Run
from sim.policy.proxy import Attempt, Cancel, Complete, Dispatch, Drop, EngineView, Execution, Refuse, Subscribe, Wake
from sim.policy.router import RouterConfig
from sim.policy.stack import Interpreter, ProxyBeforeRouter, SidecarPerReplica, Stack
from sim.profile import load_profile
from sim.scenario import SCENARIOS
from sim.workload import make_trace

TINY = SCENARIOS["cpu-tiny"].scenario
PROFILE = load_profile("vllm-cpu-tiny")


def kinds(stack: Stack) -> list[str]:
    return [k for k, _ in stack.layers]


def test_a_stack_names_its_layers_in_order_and_the_placement_orders_proxy_and_router():
    cond = compose("cancel", coalesce=True)
    before = Stack.from_config(cond, RouterConfig("round-robin", 1, "deployment"), TINY)
    sidecar = Stack.from_config(cond, RouterConfig("round-robin", 1, "replica"), TINY)
    assert kinds(before) == ["client", "proxy", "router"] and before.proxy_before_router
    assert kinds(sidecar) == ["client", "router", "proxy"] and not sidecar.proxy_before_router
    for s in (before, sidecar):
        assert s.config("proxy") == cond.proxy
        assert s.config("client") == cond.client_config(TINY)
    assert Stack.from_config(cond).config("router") == RouterConfig()     # one engine: the default router
    assert Stack.from_config(cond).config("client") is None               # no scenario: no client settings


def _bind(placement: str, n: int, cond=None, retries: int = 1):
    cond = cond or compose("no-control")
    views = []

    def view(group, g, t):
        views.append((group, g))
        return EngineView(0.0, None)
    stack = Stack.from_config(cond, RouterConfig("round-robin", retries, placement))
    cl = stack.bind(n, view, lambda grp: 10.0 * len(grp))
    return cl, views


def test_the_proxy_before_the_router_places_executions_when_dispatched_and_reroutes_on_503():
    cl, _ = _bind("deployment", 3)
    assert isinstance(cl, ProxyBeforeRouter) and cl.proxy is cl.proxies[0] and cl.groups == ((0, 1, 2),)
    assert cl.proxy.prompt_throughput == pytest.approx(30.0)
    att = Attempt(7, 0, deadline=100.0)
    acts = cl.proxy.on_attempt(0.0, att, (16,), 8)
    ex = next(a.execution for a in acts if isinstance(a, Dispatch))
    assert cl.created(ex) is None
    first = cl.place(ex)
    tried = [first]
    second = cl.reroute(ex.call_id, tried)                 # one retry allowed
    assert second is not None and second != first and tried == [first, second]
    assert cl.reroute(ex.call_id, tried) is None            # retries spent
    assert cl.rerouted == 1 and cl.landed() is None


def test_sidecars_place_attempts_and_pass_no_503_on_from_the_engine():
    cl, views = _bind("replica", 2, compose("no-control", queue="deadline", proxy_cap=1))
    assert isinstance(cl, SidecarPerReplica) and cl.groups == ((0,), (1,)) and len(cl.proxies) == 2
    assert [p.prompt_throughput for p in cl.proxies] == [10.0, 10.0]
    placed = []
    for call in range(4):
        acts = cl.proxy.on_attempt(0.0, Attempt(call, 0, deadline=100.0), (16,), 8)
        ex = next(a.execution for a in acts if isinstance(a, Subscribe))
        placed.append(cl.created(ex))
        assert cl.place(ex) == placed[-1]
        assert cl.reroute(ex.call_id, [placed[-1]]) is None
    assert placed == [0, 1, 0, 1] and cl.landed() == placed
    # a sidecar reads its own engine: the view of its group, by its index
    assert set(views) <= {((0,), 0), ((1,), 1)} and views
    assert cl.queued_at(0) == cl.proxies[0].queued == 1    # the cap holds the second call for replica 0


class Recorder(Interpreter):
    """An interpreter whose handlers log what they carry out, each adding
    one to its proxy's queue; a Dispatch of execution id 1 produces two more
    actions (as an engine refusal does)."""

    def __init__(self):
        self.seen = []
        self.proxy = SimpleNamespace(queued=0)
        super().__init__()

    def _note(self, what):
        self.seen.append(what)
        self.proxy.queued += 1

    def _subscribe(self, t, a): self._note(("subscribe", a.attempt.number))
    def _cancel(self, t, a): self._note(("cancel", a.execution.id))
    def _refuse(self, t, a): self._note(("refuse", a.attempt.number))
    def _complete(self, t, a): self._note(("complete", a.attempt.number))
    def _drop(self, t, a): self._note(("drop", a.execution.id))
    def _wake_at(self, t, a): self._note(("wake", a.at))

    def _dispatch(self, t, ex):
        self._note(("dispatch", ex.id))
        if ex.id == 1:
            self._do(t, [Refuse(att(5), 503), Dispatch(execution(2))])


def att(n):
    return Attempt(0, n)


def execution(i):
    return Execution(i, 0, None, 0.0)


def test_the_interpreter_runs_a_handlers_own_actions_before_the_rest_of_the_list():
    r = Recorder()
    r._do(1.0, [Subscribe(att(0), execution(0)), Dispatch(execution(1)), Cancel(execution(3)),
                Complete(att(1)), Drop(execution(4)), Wake(9.0, execution(4))])
    assert r.seen == [("subscribe", 0), ("dispatch", 1),
                      ("refuse", 5), ("dispatch", 2),          # the handler's own list first
                      ("cancel", 3), ("complete", 1), ("drop", 4), ("wake", 9.0)]
    # the queue is logged as each list ends: the handler's own (after 4 actions), then the outer one's rest
    assert r.proxy_queue_log == [(0.0, 0), (1.0, 4), (1.0, 8)]
    r._do(2.0, [])
    assert r.proxy_queue_log[-1] == (1.0, 8)                   # no change, no entry
    r.proxy.queued = 3
    r._do(3.0, [])
    assert r.proxy_queue_log[-1] == (3.0, 3)


@pytest.mark.parametrize("placement", ("deployment", "replica"))
def test_one_driver_runs_a_cluster_of_one_or_many(placement):
    trace = make_trace(2.0, TINY, 0)
    cond = compose("cancel")
    one = Run(PROFILE, trace, cond, TINY, 0)
    assert one.n == 1 and one.engine is one.engines[0]
    three = Run([PROFILE] * 3, trace, cond, TINY, 0, router=RouterConfig("round-robin", 0, placement))
    assert three.n == 3 and three.engine is None and three.cluster.placement == placement
    log1, log3 = one.run(), three.run()
    assert len(log1.calls) == len(log3.calls) == len(trace)
    # the cluster's counters are its engines' summed, and every engine took requests
    per = [e.scheduler.counters for e in three.engines]
    assert all(p["prompt_tokens_total"] > 0 for p in per)
    for k, v in log3.counters.items():
        assert v == sum(p.get(k, 0) for p in per)
    with pytest.raises(ValueError):
        Run([], trace, cond, TINY, 0)


def test_a_stack_given_to_the_run_names_its_layers_instead_of_the_router_config():
    trace = make_trace(2.0, TINY, 0)
    cond = compose("cancel")
    sidecars = Stack.from_config(cond, RouterConfig("call-affinity", 0, "replica"), TINY)
    run = Run([PROFILE] * 2, trace, compose("no-control"), TINY, 0, stack=sidecars)
    assert run.cluster.placement == "replica" and run.router.config.policy == "call-affinity"
    assert all(p.config == cond.proxy for p in run.cluster.proxies)
    with pytest.raises(ValueError, match="client"):
        Stack((("proxy", cond.proxy), ("client", None), ("router", RouterConfig())))
    with pytest.raises(ValueError):
        Stack((("client", None), ("proxy", cond.proxy)))


def test_a_long_chain_of_single_dispatches_does_not_grow_the_stack():
    # an engine's refusal of an orphaned execution answers with the next queued one's Dispatch alone; a
    # queue of thousands such is one loop of `_do`, not a recursion per execution
    class Chain(Interpreter):
        proxy = SimpleNamespace(queued=0)
        _subscribe = _cancel = _drop = _wake_at = lambda self, t, a: None

        def __init__(self):
            super().__init__()
            self.seen = []

        def _dispatch(self, t, ex):
            self.seen.append(ex)
            if ex < 5000:
                self._do(t, [Dispatch(ex + 1)])

    chain = Chain()
    chain._do(0.0, [Dispatch(0)])
    assert chain.seen == list(range(5001))
