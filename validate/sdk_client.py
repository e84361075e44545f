"""The OpenAI Python SDK as a live run's client: every call is one
`openai.AsyncOpenAI.completions.create` (non-streaming, a token-id prompt,
`max_tokens` with `ignore_eos`), so the SDK's own retries, timeouts and
backoff decide what happens to it; nothing of its retry logic is copied here.

The client is built from a client [[layer]]'s effective settings
(`sim.policy.presets.preset`): `timeout_s` is `AsyncOpenAI(timeout=...)`
(the preset's 600 s default leaves the SDK's own `DEFAULT_TIMEOUT`, 600 s
with a 5 s connect timeout; another value is a plain number, as a user
writes it; None is no timeout) and `max_retries` is
`AsyncOpenAI(max_retries=...)`. Every other key must keep the preset's
value: the SDK has no such setting, and `sdk_options` refuses a changed one
in one line naming the key.

The attempts the SDK makes are observed in the client's own process, by a
transport wrapped around the SDK's httpx2 transport (the one point every
request it sends passes through, retries included): each request is one
attempt, numbered by the SDK's own `x-stainless-retry-count` header, which
the transport copies into `X-Attempt` for the live proxy; the response's
status and the proxy's `X-Execution-Id` / `X-Attached` / `X-Refused-Reason`
headers, a timeout or connection error raised below it, and the end of the
body give the attempt's outcome and end. The SDK sends the call's
`X-Call-Id` with every attempt (`extra_headers`)."""
from __future__ import annotations

from sim.policy.presets import changed_keys, preset
from sim.runlog import AttemptRecord, refusal_outcome

SDK_PRESETS = ("openai-python", "langchain-openai")
SDK_KEYS = ("timeout_s", "max_retries")


def sdk_options(settings: dict) -> dict:
    """AsyncOpenAI's keyword arguments for a client layer's effective
    settings. ValueError (one line, naming the key) for a preset that is not
    the SDK's or a key the SDK has no setting for."""
    name = settings.get("preset")
    if name not in SDK_PRESETS:
        raise ValueError(f"preset: a live run's client is the OpenAI Python SDK (presets {', '.join(SDK_PRESETS)}); "
                         f"{name!r} has no live client")
    changed = changed_keys("client", settings, SDK_KEYS)
    if changed:
        k, kept = changed[0]
        raise ValueError(f"{k}: the OpenAI Python SDK has no setting for it (it keeps {kept!r}); a live "
                         f"run's SDK takes {' and '.join(SDK_KEYS)} only")
    out: dict = {"max_retries": int(settings["max_retries"])}
    t = settings.get("timeout_s")
    if t != preset("client", "openai-python")["timeout_s"]:
        out["timeout"] = None if t is None else float(t)
    return out


# a gateway's own answers (nginx, HAProxy): its upstream timeout, no upstream to send to, its queue
GATEWAY_STATUSES = (502, 503, 504)


def attempt_outcome(status: int, headers, gateway: bool = False) -> str:
    """An attempt's outcome from a response that is not a 200: the live
    proxy's refusals by their reason (`X-Refused-Reason`); with a gateway in
    the stack, a 502 / 503 / 504 without one is the gateway's own answer
    (`refused_gateway`, as the simulator records it); anything else (an
    engine error passed on) is an error."""
    reason = headers.get("X-Refused-Reason")
    if reason is not None:          # the live proxy's refusal (a gateway's answer below it among them)
        return refusal_outcome(reason)
    if gateway and status in GATEWAY_STATUSES:
        return "refused_gateway"
    return "error"


class AttemptLog:
    """The attempts of a live run's calls as the SDK sends them: `now()` is
    the run's clock, `on_send(call, number)` is told of each attempt (the
    run's call state); `gateway`: a gateway stands between the client and
    the proxy. Records go to `attempts`; statuses other than 200 are counted
    in `statuses`."""

    def __init__(self, now, on_send=None, gateway: bool = False):
        self.now = now
        self.on_send = on_send
        self.gateway = gateway              # a gateway stands below the client
        self.attempts: list[AttemptRecord] = []
        self.statuses: dict[str, int] = {}
        self.errors: dict[str, int] = {}

    def sent(self, headers) -> AttemptRecord:
        call = int(headers["X-Call-Id"])
        number = int(headers.get("x-stainless-retry-count", "0"))
        rec = AttemptRecord(call=call, number=number, sent_at=self.now())
        self.attempts.append(rec)
        if self.on_send is not None:
            self.on_send(call, number)
        return rec

    def answered(self, rec: AttemptRecord, status: int, headers) -> None:
        rec.execution = int(headers.get("X-Execution-Id", -1))
        rec.attached = headers.get("X-Attached") == "1"
        if status != 200:
            self.statuses[str(status)] = self.statuses.get(str(status), 0) + 1
            rec.outcome = attempt_outcome(status, headers, self.gateway)

    def ended(self, rec: AttemptRecord, error: BaseException | None = None, timeout: bool = False) -> None:
        if rec.ended_at == rec.ended_at:
            return
        rec.ended_at = self.now()
        if error is not None:
            rec.outcome = "timeout" if timeout else "error"
            if not timeout:
                key = type(error).__name__
                self.errors[key] = self.errors.get(key, 0) + 1
        elif not rec.outcome:
            rec.outcome = "complete"


def client(settings: dict, base_url: str, log: AttemptLog):
    """An `openai.AsyncOpenAI` for `base_url` (…/v1) configured from the
    layer's settings, its requests passing through a transport that
    records each attempt in `log`. The openai package is an optional
    dependency (`pip install llmsim[sdk]`)."""
    import httpx2  # optional: the OpenAI SDK's transport
    import openai  # optional: the real SDK as the live client
    from openai._constants import DEFAULT_CONNECTION_LIMITS  # optional: the SDK's own pool limits

    class _Watched(httpx2.AsyncByteStream):
        def __init__(self, inner, rec):
            self.inner, self.rec = inner, rec

        async def __aiter__(self):
            try:
                async for chunk in self.inner:
                    yield chunk
            except httpx2.TimeoutException as e:
                log.ended(self.rec, e, timeout=True)
                raise
            except Exception as e:
                log.ended(self.rec, e)
                raise
            log.ended(self.rec)

        async def aclose(self):
            await self.inner.aclose()

    class _Attempts(httpx2.AsyncBaseTransport):
        """The SDK's transport with each request recorded as an attempt."""

        def __init__(self):
            self.inner = httpx2.AsyncHTTPTransport(limits=DEFAULT_CONNECTION_LIMITS)

        async def handle_async_request(self, request):
            rec = log.sent(request.headers)
            request.headers["X-Attempt"] = str(rec.number)
            try:
                resp = await self.inner.handle_async_request(request)
            except httpx2.TimeoutException as e:
                log.ended(rec, e, timeout=True)
                raise
            except BaseException as e:
                log.ended(rec, e)
                raise
            log.answered(rec, resp.status_code, resp.headers)
            resp.stream = _Watched(resp.stream, rec)
            return resp

        async def aclose(self):
            await self.inner.aclose()

    opts = sdk_options(settings)
    return openai.AsyncOpenAI(base_url=base_url, api_key="llmsim", http_client=openai.DefaultAsyncHttpxClient(
        transport=_Attempts()), **opts)


def give_up_outcome(error: BaseException, retry_after_cap_s: float | None) -> str:
    """A call's outcome when the SDK raised: `failed_retry_after` where its
    last answer was a 429 whose Retry-After exceeds the SDK's cap (it gives
    up on those), else `failed_attempts`."""
    resp = getattr(error, "response", None)
    if resp is not None and getattr(resp, "status_code", None) == 429 and retry_after_cap_s is not None:
        try:
            ra = float(resp.headers.get("retry-after", "nan"))
        except ValueError:
            ra = float("nan")
        if ra > retry_after_cap_s:
            return "failed_retry_after"
    return "failed_attempts"


def sdk_version() -> str:
    import openai  # optional: the real SDK as the live client
    return openai.__version__
