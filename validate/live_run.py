"""One scenario point run live: the trace replayed open-loop by the retrying
client of the policy core, through the live proxy (in this process), in front
of a real vLLM engine; what the client saw, the proxy's execution records and
the engine's `/metrics` sampled every second become a `sim.runlog.RunLog`, and
`sim.measures.record` turns it into the same result record as a simulated run.

The client is the simulator's client layer (`sim.policy.client`; with
traffic classes, one per class: `sim.classes.clients`, each request then
carrying its class's `priority` in the body, as vLLM reads it, and its class
in `X-Class`), its actions carried out on the asyncio clock
(`validate.live_client.LiveClient`): every call is its own task, sent at its planned
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

A lost engine ends the run: every second the sampler (`validate.live_log.Sampler`,
whose samples and the proxy's records make the log) asks `engine_lost()`
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

import aiohttp
from aiohttp import web

from sim import measures
from sim.conditions import Condition
from sim.runlog import RunLog
from sim.scenario import Scenario
from sim.workload import Trace

from .engine import free_port
from .live_client import LiveClient
from .live_log import COUNTERS as COUNTERS, Sampler, engine_counters, executions_at_end, join_subscriptions, series
from .proxy import LiveProxy
from .sdk_client import sdk_options, sdk_version

UNMEASURED = ["prompt_tokens.never_aborted", "prompt_tokens.aborted_body", "prompt_tokens.aborted_in_flight",
              "prompt_tokens.missed_by_counter", "retries.never_scheduled", "retries.median_abort_to_first_step_s",
              "retries.median_left_at_first_step_s", "engine.aborted_before_scheduled"]


class EngineLost(Exception):
    """The engine went away during a live run; the message says how."""


class LiveRun:
    """Replays `trace` under `condition` through a `LiveProxy` in front of
    the engine at `url` (serving `model`). `progress(dict)` is called about
    every `progress_every_s` with the run's state. Its parts: the client side
    (`client_side`, `validate.live_client.LiveClient`) and the sampler
    (`sampler`, `validate.live_log.Sampler`)."""

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
        # text_prompts: the prompts as the tiny model's words, for an engine with its tokenizer
        self.client_side = cs = LiveClient(model, trace, condition, scenario, seed, self.now, text_prompts)
        self.prompts, self.calls, self.call_records, self.errors = cs.prompts, cs.calls, cs.call_records, cs.errors
        self.proxy = LiveProxy(self.urls, condition, prompt_throughput, router=router, group=group)
        self.progress = progress
        self.progress_every_s = progress_every_s
        self.step_count = step_count                      # callable -> engine steps so far, or None
        self.engine_lost = engine_lost                    # callable -> reason the engine is gone, or None
        self.sampler = Sampler(self.urls, self.proxy, self.now, engine_lost,
                               self._report if progress is not None else None, progress_every_s)
        self.samples = self.sampler.samples
        self.t0 = 0.0
        self.t0_wall = 0.0
        self.proxy_url = ""
        # the OpenAI SDK as the client (a client layer's settings), and a
        # gateway between the clients and the proxy: gateway(proxy_url) -> a
        # started gateway (`.url`, `.stop()`, `.describe()`); with `group` (the
        # gateway's settings, its upstream group over the engines)
        # gateway([a sidecar's URL per engine])
        self.client_layer = client_layer
        if client_layer is not None:
            self.client_layer = cs.use_sdk(client_layer, bool(condition.retries))
        self.gateway_factory = gateway
        self.gateway = None
        self.front_url = ""                               # where the clients send: the gateway, else the proxy
        # tasks that run beside the client on the run's clock (fn(self) -> coroutine; an autoscaler's), and
        # which engines are up to be sampled (fn(r) -> bool; None: all): a replica not started is sampled as empty
        self.beside: list = []
        self.replica_up = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def attempts(self) -> list:
        """The attempts sent (`AttemptRecord`s: the client's, or those the SDK's transport saw)."""
        return self.client_side.attempts

    @property
    def sdk_log(self):
        """The SDK's attempts as its transport saw them (`validate.sdk_client.AttemptLog`; None without the SDK)."""
        return self.client_side.sdk_log

    @property
    def metrics_missed(self) -> int:
        """/metrics scrapes that did not answer (the series has a gap)."""
        return self.sampler.metrics_missed

    @property
    def metrics_silence_s(self) -> float:
        """The longest stretch of the run without an answered /metrics scrape."""
        return self.sampler.silence_s(self.now())

    @property
    def lost(self) -> str | None:
        """Why the engine was lost during the run (None: it was not)."""
        return self.sampler.lost

    def _report(self, t: float) -> None:
        self.progress(self.state(t))

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
        runner = await self._serve_proxy(port or free_port())
        self.front_url = self.gateway.url if self.gateway is not None and not self.proxy.below else self.proxy_url
        sdk = self.client_side.open(self.front_url, self.gateway is not None)
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        try:
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
                return await self._drive(session, sdk, until)
        finally:
            if sdk is not None:
                await sdk.close()
            await runner.cleanup()

    async def _serve_proxy(self, port: int) -> web.AppRunner:
        """The proxy served at `port` (behind a gateway's upstream group, also
        at a port per engine), and the gateway, if any, started in front of it."""
        runner = web.AppRunner(self.proxy.app(), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        if self.proxy.group is not None and not self.proxy.below:     # behind the group: a port per engine
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
        return runner

    async def _drive(self, session: aiohttp.ClientSession, sdk, until: float) -> float:
        """The run on one clock for client, proxy and samples: the calls sent,
        the sampler and the tasks beside them, until the calls are over, the
        engine is lost or `until`; returns when it ended."""
        self.t0 = time.monotonic()
        self.t0_wall = time.time()                # the gateway's logs are dated by the wall clock
        self.proxy._t0 = self.t0                  # one clock for client, proxy and samples
        sampler = asyncio.create_task(self.sampler.run(session, self.replica_up))
        beside = [asyncio.create_task(fn(self)) for fn in self.beside]
        tasks: list[asyncio.Task] = []
        driver = asyncio.create_task(self._send_calls(session, sdk, tasks, until))
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
        return end

    async def _send_calls(self, session: aiohttp.ClientSession, sdk, tasks: list, until: float) -> None:
        """Each call its own task (in `tasks`) at its planned time; then wait
        for them until `until`, and for the last sample."""
        cs = self.client_side
        for i, at in enumerate(self.trace.arrival):
            delay = float(at) - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(cs.call(session, i) if sdk is None else cs.call_sdk(sdk, i)))
        left = until - self.now()
        if tasks and left > 0:
            await asyncio.wait(tasks, timeout=left)
        await asyncio.sleep(max(0.0, math.ceil(self.now()) + 0.05 - self.now()))   # last sample

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
        engine (`LiveProxy.server_ports`), or, where the one proxy stands
        before the group (`LiveProxy.below`), in front of the engines, the
        proxy's executions sent to it (`LiveProxy.below_url`)."""
        if self.gateway_factory is None:
            return
        if self.proxy.below:
            self.gateway = self.gateway_factory(list(self.urls))
            self.proxy.below_url = self.gateway.url
        elif self.proxy.group is not None:
            self.gateway = self.gateway_factory([f"http://127.0.0.1:{p}" for p in self.proxy.server_ports])
        else:
            self.gateway = self.gateway_factory(f"http://127.0.0.1:{port}")

    # ---------------------------------------------------------------- log
    def _log(self, end: float, wall: float) -> RunLog:
        """The run's log (`validate.live_log` makes its parts)."""
        steps = self.step_count() if self.step_count is not None else None
        join_subscriptions(self.attempts, self.proxy.subscriptions)
        executions_at_end(self.proxy.executions, self.proxy.streams, end)
        return RunLog(calls=self.call_records, attempts=self.attempts, executions=list(self.proxy.executions),
                      series=series(self.samples, end), **engine_counters(self.samples, self.scenario, steps),
                      end_time=end, wall_s=wall, extra=self._extra())

    def _extra(self) -> dict:
        """What the run adds to its log: the requests that broke, by kind, the
        /metrics scrapes missed and the longest silence between answers; with
        the SDK, its version and the statuses its attempts got besides 200; the
        gateway's description."""
        out: dict = {"errors": dict(self.errors), "metrics_missed": self.metrics_missed,
                     "metrics_silence_s": round(self.metrics_silence_s, 3)}
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
