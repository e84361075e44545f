"""The client side of a live run (`validate.live_run.LiveRun`): every call of
the trace sent at its planned time, whatever happened to earlier calls, and
what it saw kept in the run's call and attempt records.

The client is the simulator's client layer (`sim.policy.client`; with
traffic classes, one per class: `sim.classes.clients`, each request then
carrying its class's `priority` in the body, as vLLM reads it, and its class
in `X-Class`), its actions carried out on the asyncio clock
(`LiveClient.call`): each attempt is one streamed `/v1/completions` request
carrying `X-Call-Id` (the call's number) and `X-Attempt`, closed at the
attempt's deadline; a refusal with a `Retry-After` is answered with it (up
to its cap), any other with the usual wait; a broken attempt (a connection
error, an engine error passed through) as a refusal without one. With a
client layer's settings (`sdk`) it is the real OpenAI SDK instead
(`validate.sdk_client`; each call one `completions.create`, its retries the
SDK's, each attempt recorded by a transport around the SDK's own)."""
from __future__ import annotations

import asyncio

import aiohttp
import numpy as np

from sim.classes import call_classes, call_priorities, clients
from sim.conditions import Condition
from sim.policy.client import CallAttempt, CallState, Delivered
from sim.policy.layers import Send, Timer
from sim.runlog import AttemptRecord, CallRecord, refusal_outcome
from sim.scenario import Scenario
from sim.workload import Trace

from .loadgen import TextPrompts, TracePrompts, cut_at, request_body
from .sdk_client import AttemptLog, attempt_outcome, client as sdk_client, give_up_outcome, sdk_options


class LiveClient:
    """The calls of `trace` (to `model`) under `condition`, on the run's
    clock `now`; `open(front_url, gateway)` names where they go before the
    first is sent. `text_prompts`: the prompts as the tiny model's words
    (`loadgen.TextPrompts`), for an engine that loads its tokenizer."""

    def __init__(self, model: str, trace: Trace, condition: Condition, scenario: Scenario, seed: int, now,
                 text_prompts: bool = False):
        self.model, self.trace, self.now = model, trace, now
        self.prompts = (TextPrompts if text_prompts else TracePrompts)(trace.prompt_len, trace.shared_prefix, seed)
        rng = np.random.default_rng([seed, 1])            # the client's backoff draws, as in the simulator
        # with traffic classes each call's client is its class's, its requests carry the class's priority (the
        # body's `priority`, vLLM's) and its class (X-Class, for the proxy's shedding by class)
        self.client = clients(condition.client_config(scenario), condition, scenario, trace,
                              lambda a, b: float(rng.uniform(a, b)))
        self.priority = call_priorities(trace, scenario) if scenario.classes else None
        self.klass = call_classes(trace, scenario)
        n = len(trace)
        self.calls = [CallState(i, float(trace.arrival[i])) for i in range(n)]
        self.call_records = [CallRecord(i, float(trace.arrival[i])) for i in range(n)]
        self.attempts: list[AttemptRecord] = []
        self.errors: dict[str, int] = {}        # requests that broke, by kind
        self.client_layer: dict | None = None
        self.sdk_log: AttemptLog | None = None
        self.front_url = ""                     # where the calls go: the gateway, else the proxy
        self.gateway = False                    # a gateway stands between the clients and the proxy

    def use_sdk(self, client_layer: dict, retries: bool) -> dict:
        """The OpenAI SDK as the client, with a client layer's settings (no
        retries where the condition has none, as the simulator's stack:
        `Deployment.stack_for`); a layer the SDK cannot be refuses here,
        before any work. Returns the settings used."""
        if not retries:
            client_layer = dict(client_layer, max_retries=0)
        self.client_layer = client_layer
        sdk_options(client_layer)
        return client_layer

    def open(self, front_url: str, gateway: bool):
        """Send the calls to `front_url` (a gateway's when `gateway`); returns the SDK's client, if it is the client."""
        self.front_url, self.gateway = front_url, gateway
        if self.client_layer is None:
            return None
        self.sdk_log = AttemptLog(self.now, self._sdk_sent, gateway=gateway)
        self.attempts = self.sdk_log.attempts
        return sdk_client(self.client_layer, front_url + "/v1", self.sdk_log)

    # ------------------------------------------------------------- the reference client
    async def call(self, session: aiohttp.ClientSession, i: int) -> None:
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
            status, retry_after, reason = await cut_at(self._post(session, body, headers, rec),
                                                       att.deadline - self.now())
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
        rec.ended_at = t = self.now()
        if status == 200:
            rec.outcome = "complete"
            return t, self.client.on_complete(t, att)
        if reason is None:
            rec.outcome = "refused_gateway"
            return t, self.client.on_refused(t, att, status)
        rec.outcome = refusal_outcome(reason)
        return t, self.client.on_refused(t, att, status, retry_after, reason)

    async def _post(self, session: aiohttp.ClientSession, body: dict, headers: dict, rec: AttemptRecord) -> tuple:
        """The attempt's request and its answer read: a refusal (the proxy's or
        engine's, the gateway's own) or the stream to its [DONE]; (status,
        Retry-After, reason), the reason None for a gateway's own answer and a
        completion. The client is told by the caller, once the attempt is over
        (a task cut at its deadline and still running tells it nothing)."""
        async with session.post(self.front_url + "/v1/completions", json=body, headers=headers) as resp:
            rec.execution = int(resp.headers.get("X-Execution-Id", -1))
            rec.attached = resp.headers.get("X-Attached") == "1"
            if resp.status in (429, 503) or "X-Refused-Reason" in resp.headers:    # the proxy's refusal
                await resp.read()
                ra = resp.headers.get("Retry-After")
                return resp.status, float(ra) if ra is not None else None, resp.headers.get("X-Refused-Reason",
                                                                                            "engine")
            if resp.status != 200 and attempt_outcome(resp.status, resp.headers, self.gateway) \
                    == "refused_gateway":         # the gateway's own answer, as the simulator records it
                await resp.read()
                return resp.status, None, None
            if resp.status != 200:
                raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status,
                                                  message=(await resp.text())[:200])
            async for line in resp.content:
                if line.startswith(b"data: [DONE]"):
                    return 200, None, None
            raise aiohttp.ClientPayloadError("stream ended without [DONE]")

    # ------------------------------------------------------------- the OpenAI SDK
    async def call_sdk(self, sdk, i: int) -> None:
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
