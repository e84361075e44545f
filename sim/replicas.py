"""The cluster of engines of a run (`sim.model.Run`): one engine per profile
under the stack's proxies and router (`sim.policy.stack.Cluster`), what the
policies read of the engines (their views), an execution's dispatch, abort
and end, the counter snapshots and the thinning of the gauge logs."""
from __future__ import annotations

from functools import partial
from typing import Sequence

from .clock import INF
from .conditions import Condition
from .engine.core import EngineConfig, EngineCore
from .engine.request import Request
from .policy.proxy import Cancel, EngineView, PromptRate, Proxy, Refuse
from .policy.router import ReplicaView
from .profile import Profile
from .runlog import thin_log
from .scenario import Scenario


def never() -> float:
    """A time that never comes: the next abort where no proxy cancels an execution."""
    return INF


def prompt_throughput(profile: Profile, scenario: Scenario) -> float:
    """The profile's prompt throughput (tokens/s): capacity x computed prompt
    tokens per call (the proxy's estimate before it has any history)."""
    return profile.capacity * max(1.0, scenario.prompt_mean - scenario.shared_prefix)


def engine_config(profile: Profile, condition: Condition, max_batched_tokens: int | None = None,
                  scenario: Scenario | None = None) -> EngineConfig:
    """The engine of `profile` (its frontend time too) with the condition's engine cap and the
    scenario's engine faults (stalls, a KV block leak on abort), if any."""
    faults = {}
    if scenario is not None and scenario.stalls:
        faults["stalls"] = scenario.stalls
    if scenario is not None and scenario.leak_blocks_on_abort:
        faults["leak_blocks_on_abort"] = True
    return EngineConfig(profile.scheduler_config(max_batched_tokens), profile.depth, condition.engine_cap,
                        frontend_s=profile.frontend_s, **faults)


def sum_counters(dicts) -> dict:
    """Key-wise sum of counter dicts (keys in first-seen order)."""
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out[k] + v if k in out else v
    return out


class Replicas:
    """The engines of `profiles` (replica i runs the i-th) under `stack`
    bound over them (`cluster`, its `router` and `proxy`). The engines are
    made by `make` (`engines`: filled in place). `executions` (the run's
    execution records), `calls` (`sim.calls.Calls`: each call's prefix and
    priority) and `do` (the run's interpreter) are the run's, set by it."""

    def __init__(self, env, profiles: Sequence[Profile], stack, scenario: Scenario, proxy_queue_log: list):
        self.env, self.profiles, self.n = env, list(profiles), len(profiles)
        self.engines: list[EngineCore] = []
        # each proxy's prompt-throughput estimate: computed prompt tokens of
        # the executions that got their first token over the last 60 s on the
        # replicas it feeds; before any, the profiles' (capacity x computed
        # prompt tokens per call); kept only where the proxy reads its view
        # (`Proxy.estimate_wait`)
        self.cluster = cl = stack.bind(
            self.n, self.engine_view_of,
            lambda grp: sum(prompt_throughput(self.profiles[r], scenario) for r in grp),
            replica_view=self.replica_view, outstanding=self.outstanding_of, kv_usage=self.kv_usage_of)
        self.router, self.proxy = cl.router, cl.proxy
        self.prompt_rates = [PromptRate(60.0) for _ in cl.groups]
        self.exec_replica = cl.execution_replica
        self.queue_logs = [[(0.0, 0)] for _ in range(self.n)]    # each replica's own proxy queue (sidecars')
        self.proxy_queue_log = proxy_queue_log
        self.requests: dict[int, Request] = {}
        self.counters_at: dict[float, dict] = {}
        self.counters_at_r: list[dict] = [{} for _ in range(self.n)]     # each engine's
        self.thin_at = 0      # thin the gauge logs beyond this many entries (0: never; the run sets it)
        # Proxy.on_dispatched does nothing: called only where a proxy overrides it
        self.report_dispatch = type(self.proxy).on_dispatched is not Proxy.on_dispatched
        self.executions = self.calls = self.do = None
        self.group_gateway = None       # a gateway's upstream group below the one proxy (`below_proxy`)

    def make(self, condition: Condition, scenario: Scenario, max_batched_tokens: int | None, fast_forward: bool,
             on_finished, next_input: list, never_aborts: bool, reads_view: bool) -> None:
        """Make the engines: each calls `on_finished(req, t)` as a request
        ends and `next_input[r]()` for its next input time; where a proxy
        reads its view (`reads_view`), each first token feeds the prompt
        throughput of the proxy before it."""
        group_of = self.cluster.group_of
        first_token = [partial(self.on_first_token_of, self.prompt_rates[group_of[r]]) if reads_view else None
                       for r in range(self.n)]
        if self.group_gateway is not None:      # the gateway below the proxy hears each stream's first token
            first_token = [partial(self.first_token_below, f) for f in first_token]
        self.engines.extend(
            EngineCore(self.env, engine_config(p, condition, max_batched_tokens, scenario), p.step_time,
                       on_finished=on_finished, on_first_token=first_token[r], next_input_time=next_input[r],
                       fast_forward=fast_forward, next_abort_time=never if never_aborts else None)
            for r, p in enumerate(self.profiles))

    # ------------------------------------------------------------ views
    def pods(self, t: float) -> list:
        """What a layer above the proxy reads of each engine: (waiting, KV cache usage, metrics age 0)."""
        return [(e.num_in_engine() - len(e.scheduler.running), e.scheduler.block_pool.usage(), 0.0)
                for e in self.engines]

    def replica_view(self, r: int) -> ReplicaView:
        return ReplicaView(self.outstanding_of(r), self.kv_usage_of(r))

    def outstanding_of(self, r: int) -> int:
        """Requests replica r holds: in its engine, and in its own proxy queue."""
        return self.engines[r].num_in_engine() + self.cluster.queued_at(r)

    def kv_usage_of(self, r: int) -> float:
        return self.engines[r].scheduler.block_pool.usage()

    def up(self, r: int) -> bool:
        """Replica r takes requests now (the router's mask: an autoscaled
        fleet's replica ready, not off, starting or draining)."""
        ready = self.router.ready
        return ready is None or ready[r]

    def empty(self, r: int) -> bool:
        """Replica r holds no request (in its engine or its own proxy queue)."""
        return self.engines[r].num_in_engine() == 0 and self.cluster.queued_at(r) == 0

    def engine_view_of(self, group: tuple, g: int, t: float) -> EngineView:
        """What the g-th proxy knows of the engines it feeds (`group`): the
        uncomputed prompt tokens of the executions waiting or running in
        them (or on their way in), their recent prompt throughput, the
        requests waiting in them and their mean KV cache usage."""
        es = [self.engines[r] for r in group]
        return EngineView(float(sum(e.uncomputed_prompt_tokens() for e in es)), self.prompt_rates[g].rate(t),
                          float(sum(e.num_in_engine() - len(e.scheduler.running) for e in es)),
                          sum(e.scheduler.block_pool.usage() for e in es) / len(es))

    @staticmethod
    def on_first_token_of(rate: PromptRate, req: Request, t: float) -> None:
        """An engine's first token of `req`: the prompt throughput of the
        proxy that feeds it."""
        rec = req.record
        rate.add(t, rec.prompt_computed if rec is not None else req.num_prompt_tokens)

    # ------------------------------------------------------------ executions
    def dispatch(self, t: float, ex) -> None:
        """Send an execution to the engine the cluster places it on; an
        engine's refusal (503) sends it on to the next replica the cluster
        names, if any, else it is refused."""
        ex_id, i = ex.id, ex.call_id
        erec = self.executions[ex_id]
        erec.dispatched_at = t
        calls = self.calls
        req = Request(ex_id, i, erec.prompt_len, erec.max_tokens, calls.prefix_len[i], record=erec,
                      prefix_group=calls.prefix_group[i], priority=calls.call_priority[i],
                      prompt_id=calls.prompt_id[i])
        reps, cl = self.exec_replica, self.cluster
        r = cl.place(ex)
        tried = None
        while r is not None:
            reps[ex_id] = r
            if self.engines[r].add_request(req, t):
                erec.accepted = True
                self.requests[ex_id] = req
                if self.report_dispatch:
                    self.proxy.on_dispatched(t, ex)
                return
            if tried is None:
                tried = [r]
            r = cl.reroute(i, tried)
        erec.fate, erec.finished_at = "refused", t
        self.do(t, self.proxy.on_engine_refused(t, ex))

    def cancel(self, t: float, a: Cancel) -> None:
        self.executions[a.execution.id].cancel_requested_at = t
        self.engines[self.exec_replica[a.execution.id]].abort_request(self.requests.pop(a.execution.id), t)

    def cancel_on(self, t: float, r: int) -> None:
        """Cancel the requests on replica r: each aborted in its engine and
        its execution refused (503) to its attempts; a proxy queue held for
        r alone dispatches its next ones to r, cancelled in turn."""
        reps = self.exec_replica
        while True:
            mine = [i for i in self.requests if reps[i] == r]
            if not mine:
                return
            for i in mine:
                req = self.requests.pop(i)
                self.executions[i].cancel_requested_at = t
                self.engines[r].abort_request(req, t)
                ex = self.proxy.executions.get(i)
                if ex is not None:
                    self.do(t, self.proxy.on_engine_refused(t, ex))

    def on_finished(self, req: Request, t: float) -> None:
        self.requests.pop(req.request_id, None)
        ex = self.proxy.executions.get(req.request_id)
        if ex is not None:
            self.do(t, self.proxy.on_finished(t, ex))

    # ------------------------------------------------- below a gateway's upstream group
    # (`Stack.group_below_proxy`: the one proxy's executions go to the gateway, `group_gateway`, whose
    # upstream attempts reach their servers' engines here; `below_proxy` sets this up)
    def below_proxy(self, gateway) -> None:
        """Route the engines' answers to `gateway`, the upstream group below the one proxy."""
        self.group_gateway = gateway
        self.upstream_requests: dict = {}       # the gateway's upstream attempt -> its request in an engine
        self.request_upstream: dict = {}        # and back
        self.on_finished = self.on_finished_below
        self.cancel_on = self.cancel_on_below

    def engine_attempt(self, t: float, up, params: tuple, prompt_len: int) -> list:
        """The gateway's upstream attempt reaches its server's engine: the
        execution it carries runs there (an execution the gateway tries again
        runs again, on the server it picks; its record is the last try's);
        the engine's 503 (its cap) is the gateway's to hear."""
        ex = up.above.of
        erec = self.executions[ex.id]
        if erec.dispatched_at != erec.dispatched_at:        # NaN: its first try
            erec.dispatched_at = t
        calls, i, r = self.calls, ex.call_id, up.server
        req = Request(ex.id, i, erec.prompt_len, erec.max_tokens, calls.prefix_len[i], record=erec,
                      prefix_group=calls.prefix_group[i], priority=calls.call_priority[i],
                      prompt_id=calls.prompt_id[i])
        self.exec_replica[ex.id] = r
        if not self.engines[r].add_request(req, t):
            return [Refuse(up, 503, None, "engine")]
        erec.accepted = True
        up.execution = ex
        up.answering = True             # vLLM sends a stream's status and header as it takes the request
        self.upstream_requests[up] = req
        self.request_upstream[req] = up
        return []

    def engine_left(self, t: float, up) -> list:
        """The gateway closed its upstream attempt: the engine aborts the
        request (vLLM aborts a request whose client disconnected)."""
        req = self.upstream_requests.pop(up, None)
        if req is not None:
            del self.request_upstream[req]
            self.executions[req.request_id].cancel_requested_at = t
            self.engines[up.server].abort_request(req, t)
        return []

    def first_token_below(self, also, req: Request, t: float) -> None:
        """An engine's first token of a request: its upstream attempt streams (then `also(req, t)`, if any)."""
        up = self.request_upstream.get(req)
        if up is not None:
            up.streaming = True
        if also is not None:
            also(req, t)

    def on_finished_below(self, req: Request, t: float) -> None:
        """An engine streamed a request's last token: the gateway's upstream attempt is complete."""
        up = self.request_upstream.pop(req, None)
        if up is not None:
            del self.upstream_requests[up]
            self.do(t, self.group_gateway.on_complete(t, up))

    def cancel_on_below(self, t: float, r: int) -> None:
        """Cancel the requests on replica r: each aborted in its engine and
        its upstream attempt refused (503) to the gateway."""
        for up in [u for u in self.upstream_requests if u.server == r]:
            req = self.upstream_requests.pop(up, None)
            if req is None:
                continue
            del self.request_upstream[req]
            self.executions[req.request_id].cancel_requested_at = t
            self.engines[r].abort_request(req, t)
            self.do(t, self.group_gateway.on_refused(t, up, 503, None, "engine"))

    def log_replica_queues(self, t: float) -> None:
        """Log each replica's own proxy queue length where it changed."""
        for p, log in zip(self.cluster.proxies, self.queue_logs):
            if p.queued != log[-1][1]:
                log.append((t, p.queued))

    # ------------------------------------------------------------ logs
    def snapshot(self, t: float, _arg=None) -> None:
        """Each engine's counters at t, and their sum."""
        for r, e in enumerate(self.engines):
            self.counters_at_r[r][t] = dict(e.scheduler.counters)
        self.counters_at[t] = sum_counters(c[t] for c in self.counters_at_r)

    def gauge_logs(self) -> list[list]:
        """The engines' gauge logs."""
        return [e.gauge_log for e in self.engines]

    def log_entries(self) -> int:
        return sum(map(len, self.gauge_logs())) + len(self.proxy_queue_log)

    def thin(self) -> None:
        """Thin the gauge logs to what the 1 s series needs (see `thin_log`),
        once they hold more than `thin_at` entries."""
        if not self.thin_at or self.log_entries() <= self.thin_at:
            return
        for log in self.gauge_logs():
            thin_log(log)
        thin_log(self.proxy_queue_log)
        self.thin_at = max(self.thin_at, 2 * self.log_entries())
