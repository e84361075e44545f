"""A layer's retry policy and its gateway pieces, as real software ships them
(docs/presets.md cites each value): a per-attempt timeout and a total deadline
as separate settings, a retry-on set, a backoff family, Retry-After handling,
a server's "do not retry" signal, retry throttling (a token bucket in gRPC's
manner, a budget in Envoy's), whether a request already sent upstream may be
retried, and for a gateway its upstream timeout (504), connection limits with
a queue (503), whether it passes a client's disconnect on, and an inference
gateway's shedding of sheddable requests.

Clock-free like the rest of `sim.policy`: every input carries its timestamp,
randomness comes from an injected `random()` returning a float in [0, 1)."""
from __future__ import annotations

import calendar
import email.utils
import math
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Callable, Mapping

# the failures a layer can see for one upstream attempt
TIMEOUT = "timeout"                 # this layer's per-attempt timeout struck
CONNECT_ERROR = "connect_error"     # the connection failed (refused, reset before a response)
STATUS = "status"                   # an HTTP status came back

BACKOFFS = ("none", "fixed", "uniform", "exponential", "envoy")
JITTERS = ("none", "full", "equal", "multiplicative", "additive")
ABOVE_CAP = ("give_up", "clamp", "backoff")
RETRY_AFTER_FORMATS = ("ms", "seconds", "seconds_int", "date")    # seconds_int: whole seconds only
THROTTLES = ("none", "token_bucket", "budget", "concurrency")
MAX_EXPONENT = 1000                 # openai-python caps the retry count in pow() the same way


def statuses(spec) -> frozenset:
    """The statuses of a retry-on list: ints, "429", or a class such as "5xx"."""
    out = set()
    for item in spec:
        s = str(item).strip().lower()
        if s in (TIMEOUT, CONNECT_ERROR):
            continue
        if len(s) == 3 and s.endswith("xx") and s[0].isdigit():
            base = int(s[0]) * 100
            out.update(range(base, base + 100))
        elif s.isdigit() and 100 <= int(s) <= 599:
            out.add(int(s))
        else:
            raise ValueError(f"retry_on: unknown condition {item!r} (use timeout, connect_error, a status or 5xx)")
    return frozenset(out)


# Envoy's retry_on conditions (router filter, x-envoy-retry-on) in this module's terms
ENVOY_RETRY_ON = {
    "5xx": ("5xx", TIMEOUT, CONNECT_ERROR),         # any 5xx, or no response at all
    "gateway-error": ("502", "503", "504", TIMEOUT),  # a per-try timeout is answered 504 inside Envoy
    "reset": (TIMEOUT, CONNECT_ERROR),
    "connect-failure": (CONNECT_ERROR,),
    "refused-stream": (CONNECT_ERROR,),
    "retriable-4xx": ("409",),
}


# HAProxy's retry-on keywords (configuration.txt, 2.6) in this module's terms
HAPROXY_RETRY_ON = {
    "none": (),
    "conn-failure": (CONNECT_ERROR,),
    "empty-response": (CONNECT_ERROR,),     # the connection closed with nothing received
    "response-timeout": (TIMEOUT,),
    "all-retryable-errors": (CONNECT_ERROR, TIMEOUT, "500", "502", "503", "504"),
}
HAPROXY_STATUSES = ("401", "403", "404", "408", "425", "500", "501", "502", "503", "504")

# nginx's proxy_next_upstream conditions (ngx_http_proxy_module, 1.22)
NGINX_NEXT_UPSTREAM = {"error": (CONNECT_ERROR,), "timeout": (TIMEOUT,), "invalid_header": (CONNECT_ERROR,),
                       **{f"http_{c}": (str(c),) for c in (500, 502, 503, 504, 403, 404, 429)}}


def haproxy_retry_on(spec: str) -> tuple:
    """A HAProxy retry-on line ("conn-failure 503 504") as a retry-on list."""
    out = []
    for word in spec.split():
        got = HAPROXY_RETRY_ON.get(word) or ((word,) if word in HAPROXY_STATUSES else None)
        if got is None and word != "none":
            raise ValueError(f"retry_on: HAProxy keyword {word!r} is not modelled")
        out.extend(c for c in got or () if c not in out)
    return tuple(out)


def nginx_next_upstream(spec: str) -> tuple:
    """An nginx proxy_next_upstream line as (retry-on list,
    retry_sent_non_idempotent): "off" retries nothing, "non_idempotent"
    lets a POST already sent go to the next server."""
    words = spec.split()
    if "off" in words:
        return (), False
    out = []
    for word in words:
        if word == "non_idempotent":
            continue
        if word not in NGINX_NEXT_UPSTREAM:
            raise ValueError(f"retry_on: proxy_next_upstream {word!r} is not modelled")
        out.extend(c for c in NGINX_NEXT_UPSTREAM[word] if c not in out)
    return tuple(out), "non_idempotent" in words


def envoy_retry_on(spec: str) -> tuple:
    """An Envoy retry_on string ("5xx,reset") as a retry-on list."""
    out = []
    for cond in (c.strip() for c in spec.split(",") if c.strip()):
        if cond not in ENVOY_RETRY_ON:
            raise ValueError(f"retry_on: Envoy condition {cond!r} is not modelled (known: {', '.join(ENVOY_RETRY_ON)})")
        out.extend(c for c in ENVOY_RETRY_ON[cond] if c not in out)
    return tuple(out)


def _bad(key: str, why: str):
    raise ValueError(f"{key}: {why}")


def _nonneg(key: str, v, allow_none: bool = True):
    if v is None:
        if not allow_none:
            _bad(key, "must be set")
        return
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
        _bad(key, f"must be a number, got {v!r}")
    if v < 0:
        _bad(key, f"must not be negative, got {v}")


def _count(key: str, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        _bad(key, f"must be a whole number >= 0, got {v!r}")


def _choice(key: str, v, allowed):
    if v not in allowed:
        _bad(key, f"must be one of {', '.join(allowed)}, got {v!r}")


@dataclass(frozen=True)
class RetryPolicy:
    """One layer's retry settings. A `None` time is "no limit"."""
    timeout_s: float | None = None          # per-attempt timeout (an attempt given up)
    deadline_s: float | None = None         # the call given up, across its retries, from its first attempt
    max_retries: int | None = 0             # R: up to R+1 attempts; None = no count of its own
    max_tries: int = 0                      # attempts in all, the first included; 0 = no limit (nginx's tries)
    tries_timeout_s: float | None = None    # no retry once this long after the first attempt (nginx)
    retry_on: tuple = ()                    # "timeout", "connect_error", statuses, "5xx"
    retry_sent_non_idempotent: bool = True  # may a POST already sent upstream be retried
    backoff: str = "none"
    backoff_base_s: float = 0.0             # exponential: first wait; fixed: the wait; uniform: the low end
    backoff_factor: float = 2.0
    backoff_cap_s: float | None = None      # exponential: the cap; uniform: the high end
    jitter: str = "none"
    jitter_amount: float = 0.0              # multiplicative: fraction taken off; additive: seconds added
    cap_bounds_jitter: bool = True          # the cap applies to the jittered wait (else added after it)
    retry_after: bool = False               # honour Retry-After
    retry_after_formats: tuple = ("ms", "seconds", "date")
    retry_after_cap_s: float | None = None  # longest Retry-After honoured
    retry_after_above_cap: str = "backoff"
    retry_after_jitter: bool = False        # add the backoff's additive jitter to a Retry-After wait
    should_retry_header: bool = False       # obey x-should-retry: true / false
    throttle: str = "none"
    bucket_max_tokens: float = 10.0         # gRPC retryThrottling maxTokens
    bucket_token_ratio: float = 0.1         # gRPC retryThrottling tokenRatio
    budget_percent: float = 20.0            # Envoy retry_budget.budget_percent
    min_retry_concurrency: int = 3          # Envoy retry_budget.min_retry_concurrency
    max_concurrent_retries: int = 3         # Envoy circuit breaker max_retries

    def __post_init__(self):
        for k in ("timeout_s", "deadline_s", "tries_timeout_s", "backoff_cap_s", "retry_after_cap_s"):
            _nonneg(k, getattr(self, k))
        for k in ("timeout_s", "deadline_s", "tries_timeout_s"):
            if getattr(self, k) == 0:
                _bad(k, "must be positive (leave it unset for no limit)")
        for k in ("backoff_base_s", "jitter_amount", "bucket_token_ratio"):
            _nonneg(k, getattr(self, k), allow_none=False)
        if self.max_retries is not None:
            _count("max_retries", self.max_retries)
        _count("max_tries", self.max_tries)
        _count("min_retry_concurrency", self.min_retry_concurrency)
        _count("max_concurrent_retries", self.max_concurrent_retries)
        _choice("backoff", self.backoff, BACKOFFS)
        _choice("jitter", self.jitter, JITTERS)
        _choice("retry_after_above_cap", self.retry_after_above_cap, ABOVE_CAP)
        _choice("throttle", self.throttle, THROTTLES)
        for f in self.retry_after_formats:
            _choice("retry_after_formats", f, RETRY_AFTER_FORMATS)
        if isinstance(self.retry_on, (str, bytes)):
            _bad("retry_on", "must be a list of conditions")
        statuses(self.retry_on)
        _nonneg("backoff_factor", self.backoff_factor, allow_none=False)
        if self.backoff in ("exponential", "envoy") and self.backoff_factor < 1:
            _bad("backoff_factor", f"must be >= 1, got {self.backoff_factor}")
        if self.backoff in ("exponential", "envoy", "uniform") and self.backoff_cap_s is None:
            _bad("backoff_cap_s", f"must be set for backoff {self.backoff!r}")
        if self.backoff_cap_s is not None and self.backoff_cap_s < self.backoff_base_s:
            _bad("backoff_cap_s", f"{self.backoff_cap_s} is below backoff_base_s {self.backoff_base_s}")
        if self.jitter == "multiplicative" and self.jitter_amount > 1:
            _bad("jitter_amount", f"a multiplicative jitter takes off at most the whole wait, got {self.jitter_amount}")
        if not 0 < self.bucket_max_tokens <= 1000:
            _bad("bucket_max_tokens", f"must be in (0, 1000] as gRPC's maxTokens, got {self.bucket_max_tokens}")
        if self.throttle == "token_bucket" and self.bucket_token_ratio <= 0:
            _bad("bucket_token_ratio", "must be positive")
        if not 0 <= self.budget_percent <= 100:
            _bad("budget_percent", f"must be in [0, 100], got {self.budget_percent}")

    @cached_property
    def retry_statuses(self) -> frozenset:
        return statuses(self.retry_on)

    def retries_on(self, kind: str, status: int | None = None) -> bool:
        """Whether this failure is in the retry-on set."""
        if kind in (TIMEOUT, CONNECT_ERROR):
            return kind in self.retry_on
        return status is not None and status in self.retry_statuses

    @property
    def max_attempts(self) -> float:
        """The most attempts one call can make through this layer (inf: no limit)."""
        n = math.inf if self.max_retries is None else self.max_retries + 1
        return min(n, self.max_tries) if self.max_tries else n

    def backoff_ceiling(self, n: int) -> float:
        """The longest backoff before retry n (0 = the first retry)."""
        return backoff_wait(self, n, lambda: 1.0, ceiling=True)

    def longest_wait(self, n: int) -> float:
        """The longest wait before retry n, a honoured Retry-After included."""
        w = self.backoff_ceiling(n)
        if self.retry_after:
            ra = self.retry_after_cap_s if self.retry_after_cap_s is not None else math.inf
            if self.retry_after_jitter and self.jitter == "additive":
                ra += self.jitter_amount
            w = max(w, ra)
        return w


def backoff_wait(p: RetryPolicy, n: int, random: Callable[[], float], ceiling: bool = False) -> float:
    """The wait before retry n (0 = the first retry) for the policy's backoff
    family. `ceiling` returns the top of the jitter's range instead of a draw."""
    n = min(max(n, 0), MAX_EXPONENT)
    cap = p.backoff_cap_s
    if p.backoff == "none":
        return 0.0
    if p.backoff == "fixed":
        return p.backoff_base_s
    if p.backoff == "uniform":
        return cap if ceiling else p.backoff_base_s + (cap - p.backoff_base_s) * random()
    if p.backoff == "envoy":
        # router's JitteredExponentialBackOffStrategy: a draw in [0, (2^N - 1) * base), N = 1, 2, ...
        try:
            top = min((p.backoff_factor ** (n + 1) - 1) * p.backoff_base_s, cap)
        except OverflowError:
            top = cap
        return top if ceiling else top * random()
    try:
        raw = p.backoff_base_s * p.backoff_factor ** n
    except OverflowError:
        raw = math.inf
    c = min(raw, cap)
    r = 1.0 if ceiling else random()
    if p.jitter == "none":
        return c
    if p.jitter == "full":
        return c * r
    if p.jitter == "equal":
        return c / 2 + c / 2 * r
    if p.jitter == "multiplicative":          # openai-python: sleep * (1 - 0.25 * random())
        return c if ceiling else c * (1 - p.jitter_amount * r)
    # additive: tenacity's min(wait + U(0, jitter), max), or litellm's min(wait, max) + jitter
    if p.cap_bounds_jitter:
        return min(raw + p.jitter_amount * r, cap)
    return c + p.jitter_amount * r


def _http_date(value: str) -> float | None:
    """Seconds since the epoch of an HTTP date, or None; clock-free."""
    t = email.utils.parsedate_tz(value)
    if t is None:
        return None
    try:
        return float(calendar.timegm(t[:6] + (0, 0, 0)) - (t[9] or 0))
    except (OverflowError, ValueError, TypeError):
        return None


def parse_retry_after(headers: Mapping[str, str] | None, formats=("ms", "seconds", "date"),
                      response_epoch: float | None = None) -> float | None:
    """The wait a response asks for, in seconds, or None if it asks for none
    that these formats read. `retry-after-ms` (milliseconds) is preferred,
    then `retry-after` as seconds (`seconds_int`: whole seconds only, as
    LiteLLM's int() and Envoy's SECONDS read it), then as an HTTP date, taken relative to the
    response's own `date` header or else to `response_epoch` (the response's
    time in seconds since the epoch); a date with neither is ignored."""
    if not headers:
        return None
    h = {k.lower(): v for k, v in headers.items()}
    if "ms" in formats and h.get("retry-after-ms") is not None:
        try:
            return float(h["retry-after-ms"]) / 1000.0
        except ValueError:
            pass
    value = h.get("retry-after")
    if value is None:
        return None
    if "seconds" in formats:
        try:
            return float(value)
        except ValueError:
            pass
    if "seconds_int" in formats:
        try:
            return float(int(value))
        except ValueError:
            pass
    if "date" in formats:
        at = _http_date(value)
        if at is None:
            return None
        ref = _http_date(h["date"]) if h.get("date") else None
        if ref is None:
            ref = response_epoch
        if ref is None:
            return None
        return at - ref
    return None


class TokenBucket:
    """gRPC's retry throttling (gRFC A6): the bucket starts full at
    max_tokens; each failed attempt takes 1 token, each success gives back
    token_ratio (never above max_tokens); retries are allowed only while the
    count is above max_tokens / 2."""
    __slots__ = ("max_tokens", "token_ratio", "tokens")

    def __init__(self, max_tokens: float, token_ratio: float):
        if not 0 < max_tokens <= 1000:
            raise ValueError(f"bucket_max_tokens: must be in (0, 1000], got {max_tokens}")
        if token_ratio <= 0:
            raise ValueError(f"bucket_token_ratio: must be positive, got {token_ratio}")
        self.max_tokens = float(max_tokens)
        self.token_ratio = float(token_ratio)
        self.tokens = float(max_tokens)

    def on_failure(self):
        self.tokens = max(0.0, self.tokens - 1.0)

    def on_success(self):
        self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def allows_retry(self) -> bool:
        return self.tokens > self.max_tokens / 2


def envoy_retry_limit(active_requests: int, pending_requests: int, budget_percent: float,
                      min_retry_concurrency: int) -> int:
    """Envoy's retry budget: concurrent retries allowed, budget_percent of the
    active and pending requests, never below min_retry_concurrency."""
    return max(int((active_requests + pending_requests) * budget_percent / 100.0), min_retry_concurrency)


@dataclass(slots=True)
class Failure:
    """What one upstream attempt ended with, at time `at`."""
    kind: str                               # TIMEOUT, CONNECT_ERROR or STATUS
    at: float
    status: int | None = None
    headers: Mapping[str, str] | None = None
    sent: bool | None = None                # the request had reached the upstream (default: all but a
                                            # connection error)
    response_epoch: float | None = None     # for a Retry-After date without a `date` header
    retry_after_s: float | None = None      # a `retry-after: <seconds>` header already read (the simulator's
                                            # layers pass the wait they answer with so)


@dataclass(slots=True)
class RetryAt:
    at: float
    wait: float = 0.0
    source: str = "backoff"                 # "backoff" or "retry_after"


@dataclass(slots=True)
class GiveUp:
    reason: str     # not_retryable, should_retry_false, retry_after, non_idempotent, attempts,
                    # no_other_server, tries, tries_timeout, throttled, deadline


class CallRetries:
    """One call's retries at one layer."""
    __slots__ = ("started_at", "attempts", "retries", "done")

    def __init__(self, started_at: float):
        self.started_at = started_at
        self.attempts = 0           # attempts sent so far
        self.retries = 0            # retries scheduled so far
        self.done = False


class Retrier:
    """The decisions of a RetryPolicy for every call of one layer. The token
    bucket (if any) is shared by the layer's calls, as gRPC's is per server."""

    def __init__(self, policy: RetryPolicy, random: Callable[[], float], servers: int | None = None):
        self.policy = p = policy
        self.random = random
        self.servers = servers      # a gateway that retries only on another server (nginx) has this many
        self.bucket = (TokenBucket(policy.bucket_max_tokens, policy.bucket_token_ratio)
                       if policy.throttle == "token_bucket" else None)
        # the policy read once: a decision is on every failed attempt of a run
        self._statuses = p.retry_statuses
        self._retry_after = p.retry_after
        self._ra_seconds = "seconds" in p.retry_after_formats
        self._special = (servers is not None or p.max_tries > 0 or p.tries_timeout_s is not None
                         or self.bucket is not None or p.throttle != "none" or p.should_retry_header
                         or not p.retry_sent_non_idempotent)
        self.attempt_timeout = math.inf if p.timeout_s is None else p.timeout_s   # an attempt's, from its send

    def start(self, t: float) -> CallRetries:
        return CallRetries(t)

    def send(self, call: CallRetries, t: float) -> float:
        """An attempt goes out at t; returns when this layer gives it up
        (its per-attempt timeout or the call's deadline; inf for neither)."""
        call.attempts += 1
        deadline = self.policy.deadline_s
        if deadline is None:
            return t + self.attempt_timeout
        return min(t + self.attempt_timeout, call.started_at + deadline)

    def on_success(self, call: CallRetries, t: float):
        call.done = True
        if self.bucket is not None:
            self.bucket.on_success()

    def retry_limit(self, active_requests: int, pending_requests: int = 0) -> int | None:
        """Concurrent retries this layer allows now (None: no such limit)."""
        p = self.policy
        if p.throttle == "budget":
            return envoy_retry_limit(active_requests, pending_requests, p.budget_percent, p.min_retry_concurrency)
        if p.throttle == "concurrency":
            return p.max_concurrent_retries
        return None

    def retry_after_of(self, f: Failure) -> float | None:
        """The wait a failure's response asks for that this layer reads (None: none)."""
        p = self.policy
        if f.retry_after_s is not None and self._ra_seconds:
            ra = f.retry_after_s
        else:
            headers = f.headers if f.retry_after_s is None else {"retry-after": repr(float(f.retry_after_s))}
            ra = parse_retry_after(headers, p.retry_after_formats, f.response_epoch)
        if ra is not None and (math.isnan(ra) or (math.isinf(ra) and p.retry_after_cap_s is None)):
            ra = None                   # an infinite wait is above any cap (Python's float() reads "inf")
        return ra

    def on_failure(self, call: CallRetries, f: Failure, active_requests: int = 0,
                   pending_requests: int = 0, active_retries: int = 0):
        """The open attempt failed: RetryAt or GiveUp (the call done). The
        counts are the layer's now, for a budget or a concurrency limit on
        retries."""
        p = self.policy
        if self.bucket is not None:
            self.bucket.on_failure()
        exhausted = p.max_retries is not None and call.retries >= p.max_retries
        ra = None
        over_cap = False
        if f.kind == STATUS:
            retryable = f.status in self._statuses
            if self._retry_after:
                ra = f.retry_after_s        # read as retry_after_of would: it is on every refusal of a run
                if ra is None or not self._ra_seconds or ra != ra or (ra == math.inf and p.retry_after_cap_s is None):
                    ra = self.retry_after_of(f)
                over_cap = ra is not None and p.retry_after_cap_s is not None and ra > p.retry_after_cap_s
                if over_cap and p.retry_after_above_cap == "give_up" and not exhausted:
                    return _give_up(call, "retry_after")    # openai-python asks `remaining_retries > 0` first
        else:
            retryable = f.kind in p.retry_on
        if self._special:               # the checks of the policies that have them, in their order
            reason = self._checks(call, f, retryable, exhausted, active_requests, pending_requests, active_retries)
        else:
            reason = "not_retryable" if not retryable else "attempts" if exhausted else None
        if reason is not None:
            return _give_up(call, reason)
        if ra is not None and ra > 0 and not over_cap:
            wait, source = ra, "retry_after"
        elif over_cap and p.retry_after_above_cap == "clamp":
            wait, source = p.retry_after_cap_s, "retry_after"
        elif p.backoff == "uniform":    # backoff_wait's uniform line inlined: a call less on every retry of the
            wait, source = p.backoff_base_s + (p.backoff_cap_s - p.backoff_base_s) * self.random(), "backoff"
        else:                           # reference client (a few thousand instructions, callgrind)
            wait, source = backoff_wait(p, call.retries, self.random), "backoff"
        if source == "retry_after" and p.retry_after_jitter and p.jitter == "additive":
            wait += p.jitter_amount * self.random()
        if p.deadline_s is not None and f.at + wait >= call.started_at + p.deadline_s:
            return _give_up(call, "deadline")
        call.retries += 1
        return RetryAt(f.at + wait, wait, source)

    def _checks(self, call, f, retryable, exhausted, active_requests, pending_requests, active_retries) -> str | None:
        """Why the call is given up now (None: it may be retried), for a
        policy with a throttle, limits on tries, the server's x-should-retry
        or no retry of a request sent."""
        p = self.policy
        if f.kind == STATUS and p.should_retry_header and f.headers:
            said = {k.lower(): v for k, v in f.headers.items()}.get("x-should-retry")
            if said == "true":
                retryable = True
            elif said == "false":
                return "should_retry_false"
        if not retryable:
            return "not_retryable"
        if not p.retry_sent_non_idempotent and (f.sent if f.sent is not None else f.kind != CONNECT_ERROR):
            return "non_idempotent"
        if exhausted:
            return "attempts"
        if self.servers is not None and call.attempts >= self.servers:
            return "no_other_server"
        if p.max_tries and call.attempts >= p.max_tries:
            return "tries"
        if p.tries_timeout_s is not None and f.at - call.started_at >= p.tries_timeout_s:
            return "tries_timeout"
        if self.bucket is not None and not self.bucket.allows_retry():
            return "throttled"
        limit = self.retry_limit(active_requests, pending_requests)
        if limit is not None and active_retries >= limit:
            return "throttled"
        return None


def _give_up(call: CallRetries, reason: str) -> GiveUp:
    call.done = True
    return GIVE_UPS[reason]


# the decisions to give up, made once: no allocation when a call is given up (nothing changes them)
GIVE_UPS = {r: GiveUp(r) for r in ("not_retryable", "should_retry_false", "retry_after", "non_idempotent", "attempts",
                                   "no_other_server", "tries", "tries_timeout", "throttled", "deadline")}


# ---- a gateway's own pieces ------------------------------------------------

SHED_MODES = ("off", "sheddable")
# an upstream group's balancing, passive-health rule, retry server and HAProxy's on-error (sim.policy.upstream)
BALANCES = ("round-robin", "least-conn", "hash", "random", "least-request")
HEALTH_RULES = ("nginx", "haproxy", "envoy", "litellm")
RETRY_SERVERS = ("other", "same", "any")
ON_ERRORS = ("fastinter", "fail-check", "sudden-death", "mark-down")


@dataclass(frozen=True)
class SaturationRule:
    """The Gateway API Inference Extension's saturation detector (EPP, v1.0):
    the pool is saturated when no pod has good capacity, a pod having it when
    its metrics are fresh, its waiting queue is at most queue_depth_threshold
    and its KV cache use at most kv_cache_threshold."""
    queue_depth_threshold: int = 5
    kv_cache_threshold: float = 0.8
    metrics_staleness_s: float = 0.2

    def __post_init__(self):
        if isinstance(self.queue_depth_threshold, bool) or not isinstance(self.queue_depth_threshold, int) \
                or self.queue_depth_threshold <= 0:
            _bad("queue_depth_threshold", f"must be a whole number > 0, got {self.queue_depth_threshold!r}")
        if not 0 < self.kv_cache_threshold < 1:
            _bad("kv_cache_threshold", f"must be in (0, 1), got {self.kv_cache_threshold}")
        _nonneg("metrics_staleness_s", self.metrics_staleness_s, allow_none=False)

    def pod_has_capacity(self, waiting: int, kv_cache_usage: float, metrics_age_s: float = 0.0) -> bool:
        return (metrics_age_s <= self.metrics_staleness_s and waiting <= self.queue_depth_threshold
                and kv_cache_usage <= self.kv_cache_threshold)

    def saturated(self, pods) -> bool:
        """pods: (waiting, kv_cache_usage, metrics_age_s) per pod; no pod is saturated."""
        return not any(self.pod_has_capacity(*pod) for pod in pods)


@dataclass(slots=True)
class Admit:
    action: str                 # "dispatch" or "queue"


@dataclass(slots=True)
class Refuse:
    status: int
    reason: str                 # "queue_full", "queue_timeout", "shed", "upstream_timeout"


@dataclass(frozen=True)
class GatewayPolicy:
    """What a gateway does besides retrying: its upstream (read) timeout is
    RetryPolicy.timeout_s, answered with timeout_status once it gives up;
    max_connections concurrent upstream requests, the rest queued (at most
    max_queue, for at most queue_timeout_s) and refused with queue_status;
    whether a client's disconnect is passed on for a request at the upstream
    and for one still queued; shedding of sheddable requests (priority < 0)
    when the pool is saturated."""
    timeout_status: int = 504
    # where the answer below streams (the one proxy's executions below it: `Upstream.answering`), whether the
    # timeout bounds the silences between reads (else the whole answer), and whether a stream it cuts (its
    # status and header already sent: never retried) counts toward the server's passive health
    timeout_between_reads: bool = False
    cut_counts_as_failure: bool = True
    passes_disconnect: bool = True
    passes_disconnect_queued: bool = True
    max_connections: int | None = None
    max_queue: int | None = None
    queue_timeout_s: float | None = None
    queue_status: int = 503
    upstream_servers: int = 1
    next_server_only: bool = False          # a retry goes to another server (nginx), so at most one per server
    fails_to_mark_down: int | None = None   # failures that take a server out (passive health), None: never
    down_for_s: float = 0.0                 # for this long
    # an upstream group (upstream_servers > 1 over a fleet's replicas: sim.policy.upstream)
    balance: str = "round-robin"            # how the gateway spreads requests over its servers
    health: str = "nginx"                   # whose passive-health rule (fails_to_mark_down None: off)
    retry_server: str = "other"             # a retry's server: another one, the same, or a fresh pick
    no_live_status: int = 502               # the gateway's own answer when no server is left
    connect_error_status: int = 502         # its answer to a connection error it does not retry
    check_interval_s: float = 2.0           # HAProxy: inter (its active checks); Envoy: the outlier sweep
    rise: int = 2                           # HAProxy: good checks that bring a server back
    fall: int = 3                           # HAProxy: failed checks that take it out
    on_error: str = "fail-check"            # HAProxy: what error_limit consecutive errors do
    max_ejection_percent: float = 10.0      # Envoy: at most this share of the hosts ejected
    panic_threshold_percent: float = 50.0   # Envoy: below this share healthy, route to every host
    max_down_for_s: float | None = None     # Envoy: the longest ejection (base x ejections, capped)
    failure_rate: float = 0.5               # LiteLLM: a minute's failure share that cools a deployment
    shed: str = "off"
    shed_status: int = 429
    queue_depth_threshold: int = 5
    kv_cache_threshold: float = 0.8
    metrics_staleness_s: float = 0.2

    def __post_init__(self):
        for k in ("max_connections", "max_queue"):
            v = getattr(self, k)
            if v is not None:
                _count(k, v)
        _nonneg("queue_timeout_s", self.queue_timeout_s)
        _nonneg("down_for_s", self.down_for_s, allow_none=False)
        if self.fails_to_mark_down is not None:
            _count("fails_to_mark_down", self.fails_to_mark_down)
        if isinstance(self.upstream_servers, bool) or not isinstance(self.upstream_servers, int) \
                or self.upstream_servers < 1:
            _bad("upstream_servers", f"must be a whole number >= 1, got {self.upstream_servers!r}")
        _choice("balance", self.balance, BALANCES)
        _choice("health", self.health, HEALTH_RULES)
        _choice("retry_server", self.retry_server, RETRY_SERVERS)
        _choice("on_error", self.on_error, ON_ERRORS)
        _nonneg("check_interval_s", self.check_interval_s, allow_none=False)
        if not self.check_interval_s > 0:
            _bad("check_interval_s", f"must be positive, got {self.check_interval_s}")
        _nonneg("max_down_for_s", self.max_down_for_s)
        for k in ("rise", "fall"):
            _count(k, getattr(self, k))
            if getattr(self, k) < 1:
                _bad(k, f"must be at least 1, got {getattr(self, k)}")
        for k in ("max_ejection_percent", "panic_threshold_percent"):
            v = getattr(self, k)
            _nonneg(k, v, allow_none=False)
            if v > 100:
                _bad(k, f"must be in [0, 100], got {v}")
        if not 0 <= self.failure_rate <= 1:
            _bad("failure_rate", f"must be in [0, 1], got {self.failure_rate}")
        _choice("shed", self.shed, SHED_MODES)
        for k in ("timeout_status", "queue_status", "shed_status", "no_live_status", "connect_error_status"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or not 100 <= v <= 599:
                _bad(k, f"must be an HTTP status, got {v!r}")
        self.saturation         # validates the thresholds

    @property
    def saturation(self) -> SaturationRule:
        return SaturationRule(self.queue_depth_threshold, self.kv_cache_threshold, self.metrics_staleness_s)

    def admit(self, active: int, queued: int):
        """An attempt arrives with `active` upstream requests and `queued` waiting."""
        if self.max_connections is None or active < self.max_connections:
            return Admit("dispatch")
        if self.max_queue is None or queued < self.max_queue:
            return Admit("queue")
        return Refuse(self.queue_status, "queue_full")

    def queue_expires_at(self, queued_at: float) -> float:
        return math.inf if self.queue_timeout_s is None else queued_at + self.queue_timeout_s

    @property
    def servers_for_retries(self) -> int | None:
        """The server count that bounds this gateway's attempts, if it does."""
        return self.upstream_servers if self.next_server_only else None

    def marks_down(self, recent_fails: int) -> bool:
        """Whether a server with this many recent failures is taken out for down_for_s."""
        return self.fails_to_mark_down is not None and recent_fails >= self.fails_to_mark_down

    def on_queue_timeout(self) -> Refuse:
        return Refuse(self.queue_status, "queue_timeout")

    def on_upstream_timeout(self) -> Refuse:
        return Refuse(self.timeout_status, "upstream_timeout")

    def on_client_disconnect(self, queued: bool) -> str:
        """"cancel" (the upstream attempt is closed or the queued one dropped)
        or "run_on" (it goes on with nobody listening)."""
        passes = self.passes_disconnect_queued if queued else self.passes_disconnect
        return "cancel" if passes else "run_on"

    def sheds(self, priority: int, pods) -> Refuse | None:
        """The inference gateway's admission: a sheddable request (priority
        below 0) is refused while the pool is saturated; others pass."""
        if self.shed == "sheddable" and priority < 0 and self.saturation.saturated(pods):
            return Refuse(self.shed_status, "shed")
        return None


RETRY_KEYS = tuple(f.name for f in fields(RetryPolicy))
GATEWAY_KEYS = tuple(f.name for f in fields(GatewayPolicy))
