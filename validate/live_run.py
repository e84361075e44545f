"""One scenario point run live: the trace replayed open-loop by the retrying
client of the policy core, through the live proxy (in this process), in front
of a real vLLM engine; what the client saw, the proxy's execution records and
the engine's `/metrics` sampled every second become a `sim.runlog.RunLog`, and
`sim.measures.record` turns it into the same result record as a simulated run.

The client is the simulator's client layer (`sim.policy.client`; with
traffic classes, one per class: `sim.classes.clients`, each request then
carrying its class's `priority` in the body, as vLLM reads it, and its class
in `X-Class`), its actions carried out on the asyncio clock (`LiveRun._call`):
every call is its own task, sent at its planned
time whatever happened to earlier calls; each attempt is one streamed
`/v1/completions` request carrying `X-Call-Id` (the call's number) and
`X-Attempt`; the client closes the connection at the attempt's deadline; a
refusal with a `Retry-After` is answered with it (up to its cap), any other
with the usual wait. The proxy names
the execution an attempt subscribed to in `X-Execution-Id` / `X-Attached` (and,
for attempts that end before the response starts, in its `subscriptions`
table), and a refusal's reason in `X-Refused-Reason`, so attempts and
executions join as they do in the simulator.

What a live run cannot see, and the record says so under `unmeasured`: the
engine's per-request prompt work (so `prompt_tokens` holds only what the
counters give: `computed` = prefix-cache queries minus hits), when a request
was first scheduled (so the retry-timing medians and `never_scheduled`), and
requests aborted before being scheduled. `engine.steps` is the step recorder's
count when the engine was started by llmsim, else null.

A scenario's [[layer]] stack (`client_layer`, `gateway`): the client is then
the real OpenAI SDK (`validate.sdk_client`; each call one
`completions.create`, its retries the SDK's, each attempt recorded by a
transport around the SDK's own), and a real nginx or HAProxy
(`validate.gateway`) may stand between the clients and the proxy; the log's
`extra` names the SDK's version and options, the statuses its attempts got,
and the gateway with its config.

A lost engine ends the run: every second the sampler asks `engine_lost()`
(for an engine llmsim started: has its process exited?) and counts
`/metrics` failures; a reason from the one, or `LOST_AFTER_S` consecutive
failures of the other, stops the run, and `run()` raises `EngineLost` with the
reason. Every attempt's deadline is enforced by the client whatever the
engine or the proxy does (a stream that hangs is cut at the deadline).
"""
from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

import aiohttp
import numpy as np
from aiohttp import web

from sim import measures
from sim.classes import call_classes, call_priorities, clients
from sim.conditions import Condition
from sim.model import sum_counters
from sim.policy.client import CallAttempt, CallState, Delivered
from sim.policy.layers import Send, Timer
from sim.runlog import AttemptRecord, CallRecord, RunLog, Series, refusal_outcome
from sim.scenario import Scenario
from sim.workload import Trace

from .engine import free_port, parse_metrics
from .loadgen import TextPrompts, TracePrompts, request_body
from .proxy import LiveProxy
from .sdk_client import AttemptLog, attempt_outcome, client as sdk_client, give_up_outcome, sdk_options, sdk_version

# engine counter -> record key (`counters`); preemptions for `engine`
COUNTERS = {"vllm:prompt_tokens_total": "prompt_tokens_total",
            "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
            "vllm:num_preemptions_total": "preemptions"}
UNMEASURED = ["prompt_tokens.never_aborted", "prompt_tokens.aborted_body", "prompt_tokens.aborted_in_flight",
              "prompt_tokens.missed_by_counter", "retries.never_scheduled", "retries.median_abort_to_first_step_s",
              "retries.median_left_at_first_step_s", "engine.aborted_before_scheduled"]


LOST_AFTER_S = 30          # consecutive seconds without an answer from /metrics


class EngineLost(Exception):
    """The engine went away during a live run; the message says how."""


@dataclass
class Sample:
    t: float
    waiting: float
    running: float
    proxy_queue: int
    counters: dict
    replicas: list | None = None       # a fleet's: per engine (waiting, running, proxy queue, counters)


class LiveRun:
    """Replays `trace` under `condition` through a `LiveProxy` in front of
    the engine at `url` (serving `model`). `progress(dict)` is called about
    every `progress_every_s` with the run's state."""

    def __init__(self, url: str | list[str], model: str, trace: Trace, condition: Condition, scenario: Scenario,
                 seed: int = 0, prompt_throughput: float | None = None, progress=None,
                 progress_every_s: float = 10.0, step_count=None, engine_lost=None, router=None,
                 client_layer: dict | None = None, gateway=None, group: dict | None = None,
                 text_prompts: bool = False):
        self.urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self.url = self.urls[0]
        self.model = model
        self.trace = trace
        self.condition = condition
        self.scenario = scenario
        self.seed = seed
        # text_prompts: the same prompts as the tiny model's words, for an engine with its tokenizer
        self.prompts = (TextPrompts if text_prompts else TracePrompts)(trace.prompt_len, trace.shared_prefix, seed)
        rng = np.random.default_rng([seed, 1])            # the client's backoff draws, as in the simulator
        # with traffic classes each call's client is its class's, its requests carry the class's priority (the
        # body's `priority`, vLLM's) and its class (X-Class, for the proxy's shedding by class)
        self.client = clients(condition.client_config(scenario), condition, scenario, trace,
                              lambda a, b: float(rng.uniform(a, b)))
        self.priority = call_priorities(trace, scenario) if scenario.classes else None
        self.klass = call_classes(trace, scenario)
        self.proxy = LiveProxy(self.urls, condition, prompt_throughput, router=router, group=group)
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.step_count = step_count                      # callable -> engine steps so far, or None
        n = len(trace)
        self.calls = [CallState(i, float(trace.arrival[i])) for i in range(n)]
        self.call_records = [CallRecord(i, float(trace.arrival[i])) for i in range(n)]
        self.attempts: list[AttemptRecord] = []
        self.samples: list[Sample] = []
        self.t0 = 0.0
        self.t0_wall = 0.0
        self.proxy_url = ""
        self.errors: dict[str, int] = {}        # requests that broke, by kind
        self.metrics_missed = 0                  # /metrics scrapes that did not answer (the series has a gap)
        self.engine_lost = engine_lost                    # callable -> reason the engine is gone, or None
        self.lost: str | None = None
        # the OpenAI SDK as the client (a client layer's settings), and a
        # gateway between the clients and the proxy: gateway(proxy_url) -> a
        # started gateway (`.url`, `.stop()`, `.describe()`); with `group` (the
        # gateway's settings, its upstream group over the engines)
        # gateway([a sidecar's URL per engine])
        self.client_layer = client_layer
        self.sdk_log: AttemptLog | None = None
        if client_layer is not None:
            if not condition.retries:                     # as the simulator's stack (Deployment.stack_for)
                client_layer = dict(client_layer, max_retries=0)
            self.client_layer = client_layer
            sdk_options(client_layer)                     # a layer the SDK cannot be refuses before any work
        self.gateway_factory = gateway
        self.gateway = None
        self.front_url = ""                               # where the clients send: the gateway, else the proxy
        # tasks that run beside the client on the run's clock (fn(self) -> coroutine; an autoscaler's), and
        # which engines are up to be sampled (fn(r) -> bool; None: all): a replica not started is sampled as empty
        self.beside: list = []
        self.replica_up = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ------------------------------------------------------------- client
    async def _attempt(self, session: aiohttp.ClientSession, att: CallAttempt) -> tuple:
        """Send the client's attempt `att`; returns when it ended and the client's actions on its answer."""
        i, t = att.call_id, self.now()
        rec = AttemptRecord(call=i, number=att.number, sent_at=t)
        self.attempts.append(rec)
        self.call_records[i].attempts = att.call.attempts
        body = request_body(self.model, self.prompts[i], self.trace.max_tokens[i])
        headers = {"X-Call-Id": str(i), "X-Attempt": str(att.number)}
        if self.priority is not None:
            body["priority"] = self.priority[i]
            headers["X-Class"] = self.klass[i]
        try:
            async with asyncio.timeout(max(0.0, att.deadline - self.now())):
                async with session.post(self.front_url + "/v1/completions", json=body, headers=headers) as resp:
                    rec.execution = int(resp.headers.get("X-Execution-Id", -1))
                    rec.attached = resp.headers.get("X-Attached") == "1"
                    if resp.status in (429, 503):
                        await resp.read()
                        reason = resp.headers.get("X-Refused-Reason", "engine")
                        rec.ended_at = self.now()
                        rec.outcome = refusal_outcome(reason)
                        ra = resp.headers.get("Retry-After")
                        return rec.ended_at, self.client.on_refused(rec.ended_at, att, resp.status,
                                                                    float(ra) if ra is not None else None, reason)
                    if resp.status != 200 and attempt_outcome(resp.status, resp.headers, self.gateway is not None) \
                            == "refused_gateway":         # the gateway's own answer, as the simulator records it
                        await resp.read()
                        rec.ended_at = self.now()
                        rec.outcome = "refused_gateway"
                        return rec.ended_at, self.client.on_refused(rec.ended_at, att, resp.status)
                    if resp.status != 200:
                        raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                          message=(await resp.text())[:200])
                    complete = False
                    async for line in resp.content:
                        if line.startswith(b"data: [DONE]"):
                            complete = True
                            break
                    if not complete:
                        raise aiohttp.ClientPayloadError("stream ended without [DONE]")
                    rec.ended_at = self.now()
                    rec.outcome = "complete"
                    return rec.ended_at, self.client.on_complete(rec.ended_at, att)
        except TimeoutError:
            rec.ended_at = self.now()
            rec.outcome = "timeout"
            return rec.ended_at, self.client.on_deadline(rec.ended_at, att)
        except (aiohttp.ClientError, ValueError) as e:
            # a broken attempt (connection error, engine error passed through):
            # the client treats it as a refusal without Retry-After
            key = type(e).__name__
            self.errors[key] = self.errors.get(key, 0) + 1
            rec.ended_at = self.now()
            rec.outcome = "error"
            return rec.ended_at, self.client.on_refused(rec.ended_at, att, 503)

    async def _call(self, session: aiohttp.ClientSession, i: int) -> None:
        """Call i through the client layer: its actions carried out on the
        asyncio clock (an attempt's `Send` is one request, a retry's `Timer`
        a sleep) until the call's end."""
        crec = self.call_records[i]
        t = self.now()
        actions = self.client.on_call(t, self.calls[i])
        while True:
            (a,) = actions                  # the client answers each event with one action
            if type(a) is Send:
                t, actions = await self._attempt(session, a.attempt)
            elif type(a) is Timer:
                await asyncio.sleep(max(0.0, a.at - self.now()))
                t = self.now()
                actions = a.layer.on_timer(t, a.token)
            else:                           # the call's end: Delivered or GivenUp
                if type(a) is Delivered:
                    crec.delivered_at = t
                crec.outcome = a.call.outcome
                return

    async def _call_sdk(self, sdk, i: int) -> None:
        """Call i through the OpenAI SDK: one `completions.create`, its
        retries the SDK's own."""
        import openai  # optional: the real SDK as the live client
        crec = self.call_records[i]
        try:
            # the token ids go in extra_body, sent as given: the SDK's parameter transform
            # walks a `prompt` list id by id (about 0.27 s of CPU for 3,600 ids on a 2-core
            # machine), which would starve the engine and the proxy sharing the cores
            await sdk.completions.create(
                model=self.model, prompt="", max_tokens=int(self.trace.max_tokens[i]), temperature=0.0,
                extra_body={"prompt": self.prompts[i], "ignore_eos": True}, extra_headers={"X-Call-Id": str(i)})
            crec.delivered_at, crec.outcome = self.now(), "delivered"
        except openai.OpenAIError as e:
            crec.outcome = give_up_outcome(e, self.client_layer.get("retry_after_cap_s"))
            key = "sdk:" + type(e).__name__
            self.errors[key] = self.errors.get(key, 0) + 1
        finally:
            crec.attempts = self.calls[i].attempts
            t = self.now()
            for a in self.sdk_log.attempts:
                if a.call == i and a.ended_at != a.ended_at:
                    a.ended_at = t
                    a.outcome = a.outcome or "error"

    def _sdk_sent(self, call: int, number: int) -> None:
        self.calls[call].attempts += 1

    # ------------------------------------------------------------ sampler
    async def _sample(self, session: aiohttp.ClientSession) -> None:
        """Sample every second; returns only when the engine is lost."""
        k = 0
        last_progress = -math.inf
        failing = 0
        while True:
            await asyncio.sleep(max(0.0, k - self.now()))
            t = self.now()
            reason = self.engine_lost() if self.engine_lost is not None else None
            if reason is None and failing >= LOST_AFTER_S:
                reason = f"the engine's /metrics did not answer for {LOST_AFTER_S} s"
            if reason is not None:
                self.lost = f"{reason} at t={t:.0f} s of the run"
                return
            failing += 1
            try:
                per = []
                up = self.replica_up
                for r, url in enumerate(self.urls):
                    if up is not None and not up(r):
                        per.append((0.0, 0.0, self.proxy.cluster.queued_at(r), {}))
                        continue
                    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        m = parse_metrics(await resp.text())
                    q = self.proxy.cluster.queued_at(r)
                    per.append((m.get("vllm:num_requests_waiting", 0.0), m.get("vllm:num_requests_running", 0.0), q,
                                {v: m[c] for c, v in COUNTERS.items() if c in m}))
                self.samples.append(Sample(t, sum(p[0] for p in per), sum(p[1] for p in per), self.proxy.proxy.queued,
                                           sum_counters(p[3] for p in per), per if len(per) > 1 else None))
                failing = 0
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.metrics_missed += 1
            if self.progress is not None and t - last_progress >= self.progress_every_s:
                last_progress = t
                self.progress(self.state(t))
            k += 1

    def state(self, t: float) -> dict:
        s = self.samples[-1] if self.samples else None
        return {"t": t, "sent": sum(c.attempts > 0 for c in self.calls), "calls": len(self.calls),
                "delivered": sum(c.outcome == "delivered" for c in self.call_records),
                "failed": sum(c.outcome.startswith("failed") for c in self.call_records),
                "attempts": len(self.attempts), "executions": len(self.proxy.executions),
                "waiting": s.waiting if s else None, "running": s.running if s else None,
                "proxy_queue": self.proxy.proxy.queued}

    # ---------------------------------------------------------------- run
    async def _run(self, until: float, port: int | None = None) -> float:
        runner = web.AppRunner(self.proxy.app(), handler_cancellation=True)
        await runner.setup()
        port = port or free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        if self.proxy.group is not None:          # behind a gateway's upstream group: a port per engine
            self.proxy.server_ports = {free_port(): r for r in range(len(self.urls))}
            for p in self.proxy.server_ports:
                await web.TCPSite(runner, "127.0.0.1", p).start()
        # the gateway starts once the proxy listens (its first health checks find it), in a thread: the
        # proxy answers them meanwhile
        try:
            await asyncio.to_thread(self.start_gateway, port)
        except BaseException:
            await runner.cleanup()
            raise
        self.proxy_url = f"http://127.0.0.1:{port}"
        self.front_url = self.gateway.url if self.gateway is not None else self.proxy_url
        sdk = None
        if self.client_layer is not None:
            self.sdk_log = AttemptLog(self.now, self._sdk_sent, gateway=self.gateway is not None)
            self.attempts = self.sdk_log.attempts
            sdk = sdk_client(self.client_layer, self.front_url + "/v1", self.sdk_log)
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        tasks: list[asyncio.Task] = []
        try:
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                self.t0 = time.monotonic()
                self.t0_wall = time.time()                # the gateway's logs are dated by the wall clock
                self.proxy._t0 = self.t0                  # one clock for client, proxy and samples
                sampler = asyncio.create_task(self._sample(session))
                beside = [asyncio.create_task(fn(self)) for fn in self.beside]

                async def drive():
                    for i, at in enumerate(self.trace.arrival):
                        delay = float(at) - self.now()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        tasks.append(asyncio.create_task(
                            self._call(session, i) if sdk is None else self._call_sdk(sdk, i)))
                    left = until - self.now()
                    if tasks and left > 0:
                        await asyncio.wait(tasks, timeout=left)
                    await asyncio.sleep(max(0.0, math.ceil(self.now()) + 0.05 - self.now()))   # last sample
                driver = asyncio.create_task(drive())
                try:
                    await asyncio.wait([driver, sampler, *beside], return_when=asyncio.FIRST_COMPLETED)
                    for t in (driver, *beside):
                        if t.done():
                            t.result()
                finally:
                    end = self.now()
                    for t in [driver, sampler, *beside, *tasks]:
                        t.cancel()
                    await asyncio.gather(driver, sampler, *beside, *tasks, return_exceptions=True)
        finally:
            if sdk is not None:
                await sdk.close()
            await runner.cleanup()
        return end

    def run(self, until: float | None = None) -> RunLog:
        """Run to the end (every call delivered or given up) or `until` s
        (default: last planned arrival + the scenario's delivery horizon)."""
        if until is None:
            last = float(self.trace.arrival[-1]) if len(self.trace) else 0.0
            until = last + self.scenario.delivery_horizon_s
        w0 = time.monotonic()
        port = free_port()
        try:
            end = asyncio.run(self._run(until, port))
        finally:
            if self.gateway is not None:
                self.gateway.stop()
        if self.lost is not None:
            raise EngineLost(self.lost)
        return self._log(end, time.monotonic() - w0)

    def start_gateway(self, port: int) -> None:
        """Start the gateway (where there is one) in front of the proxy at
        `port`, or with an upstream group in front of the proxy's port per
        engine (`LiveProxy.server_ports`)."""
        if self.gateway_factory is None:
            return
        if self.proxy.group is not None:
            self.gateway = self.gateway_factory([f"http://127.0.0.1:{p}" for p in self.proxy.server_ports])
        else:
            self.gateway = self.gateway_factory(f"http://127.0.0.1:{port}")

    # ---------------------------------------------------------------- log
    def _counters_at(self, t: float) -> dict | None:
        before = [s for s in self.samples if s.t <= t + 0.5]
        return dict(before[-1].counters) if before else None

    def _log(self, end: float, wall: float) -> RunLog:
        ts = np.arange(0.0, math.floor(end) + 1.0)
        st = np.array([s.t for s in self.samples], dtype=float)

        def at(col):
            v = np.array([getattr(s, col) for s in self.samples], dtype=float)
            if not len(v):
                return np.zeros(len(ts), dtype=np.int64)
            idx = np.clip(np.searchsorted(st, ts + 0.5, side="right") - 1, 0, len(v) - 1)
            return np.rint(v[idx]).astype(np.int64)
        series = Series(t=ts, waiting=at("waiting"), running=at("running"), proxy_queue=at("proxy_queue"))
        last = dict(self.samples[-1].counters) if self.samples else {}
        sc = self.scenario
        counters_at = {t: c for t in (sc.pulse_end, sc.hold_end) if (c := self._counters_at(t)) is not None}
        counters = {k: int(v) for k, v in last.items() if k != "preemptions"}
        steps = self.step_count() if self.step_count is not None else None
        engine = {"steps": steps, "preemptions": int(last["preemptions"]) if "preemptions" in last else None,
                  "aborted_before_scheduled": None}
        subs = self.proxy.subscriptions
        for a in self.attempts:                 # attempts that ended before the response headers came
            if a.execution < 0 and (sub := subs.get((str(a.call), a.number))) is not None:
                a.execution, a.attached = sub
        nan = float("nan")
        for r in self.proxy.executions:
            # what the run's own end did (closing the attempts still open) is not part of the run
            if r.orphaned_at > end:
                r.orphaned_at = nan
            if r.finished_at > end:
                r.fate, r.finished_at = "", nan
            if r.cancel_requested_at > end:
                r.cancel_requested_at = nan
            if not r.fate:                      # still live at the end: the tokens streamed so far
                st_ = self.proxy.streams.get(r.id)
                if st_ is not None:
                    r.tokens_generated = st_.tokens
        return RunLog(calls=self.call_records, attempts=self.attempts, executions=list(self.proxy.executions),
                      series=series, counters=counters, counters_at=counters_at, engine=engine,
                      end_time=end, wall_s=wall, extra=self._extra())

    def _extra(self) -> dict:
        """What the run adds to its log: the requests that broke, by kind, and
        the /metrics scrapes missed; with the SDK, its version and the statuses
        its attempts got besides 200; the gateway's description."""
        out: dict = {"errors": dict(self.errors), "metrics_missed": self.metrics_missed}
        if self.sdk_log is not None:
            out["client"] = {"software": "openai-python", "version": sdk_version(),
                             "options": sdk_options(self.client_layer), "statuses": dict(self.sdk_log.statuses),
                             "errors": dict(self.sdk_log.errors),
                             "attempts_observed_at": "the SDK's httpx2 transport, in the client's process"}
        if self.gateway is not None:
            out["gateway"] = self.gateway.describe()
        if self.gateway is not None and self.proxy.group is not None:     # as the simulator's extra.layers
            g = self.gateway.group_record(self.proxy.group, self.t0_wall, self.scenario.pulse_end)
            out["layers"] = [{"kind": "gateway", "preset": self.proxy.group.get("preset"),
                              "no_live_upstream": g["answered_alone"], "marked_down": g["marked_down"],
                              "upstream_group": g}]
        return out


def live_record(log: RunLog, scenario: Scenario, capacity: float, inputs: dict) -> dict:
    """The result record of a live run: `sim.measures.record`, with what a live
    run cannot see set to null and listed under `unmeasured`."""
    rec = measures.record(log, scenario, capacity, inputs)
    c = log.counters
    q, h = c.get("prefix_cache_queries_total"), c.get("prefix_cache_hits_total")
    rec["prompt_tokens"] = {"computed": (q - h) if q is not None and h is not None else None,
                            "never_aborted": None, "aborted_body": None, "aborted_in_flight": None,
                            "missed_by_counter": None}
    for k in ("never_scheduled", "median_abort_to_first_step_s", "median_left_at_first_step_s",
              "never_scheduled_share", "scheduled_created"):
        rec["retries"][k] = None
    rec["unmeasured"] = list(UNMEASURED)
    rec["source"] = "live"
    return json.loads(json.dumps(rec))
