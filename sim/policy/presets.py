"""Presets: a layer's settings as a named piece of real software ships them,
each value read from that software's source or reference documentation at a
stated version and cited next to it (docs/presets.md prints them all). A
scenario names a preset and overrides keys:

    preset("client", "openai-python", timeout_s=60)

returns the layer's effective settings as a plain dict; `policies()` turns
such a dict into the RetryPolicy (and, for a gateway, the GatewayPolicy) the
layer runs. A citation that says "not verified" marks a value read from
documentation or a docstring where the source that applies it was not read."""
from __future__ import annotations

import math
from dataclasses import dataclass

from .retry import GATEWAY_KEYS, RETRY_KEYS, GatewayPolicy, RetryPolicy

KINDS = ("client", "gateway")
META = ("kind", "preset", "version")


@dataclass(frozen=True)
class Cited:
    value: object
    source: str


@dataclass(frozen=True)
class Preset:
    kind: str
    software: str
    version: str
    settings: dict          # key -> Cited
    notes: tuple = ()


def _c(value, source):
    return Cited(value, source)


_OPENAI_RETRY_ON = ("timeout", "connect_error", "408", "409", "429", "5xx")

# ---- openai-python 3.57.0 (what `pip download openai` fetched) ---------------
OPENAI = Preset("client", "openai-python", "3.57.0", {
    "timeout_s": _c(600.0, "openai/_constants.py DEFAULT_TIMEOUT = httpx2.Timeout(timeout=600, connect=5.0): "
                           "a read timeout (between bytes); a non-streaming reply sends nothing before it is "
                           "done, so it bounds the attempt"),
    "deadline_s": _c(None, "_base_client.py SyncAPIClient.request / AsyncAPIClient.request: "
                           "`for retries_taken in range(max_retries + 1)`, no time budget across attempts"),
    "max_retries": _c(2, "openai/_constants.py DEFAULT_MAX_RETRIES = 2"),
    "retry_on": _c(_OPENAI_RETRY_ON, "_base_client.py request(): timeout_exceptions() and request_exceptions() "
                                     "retried; BaseClient._should_retry: 408, 409, 429, >= 500"),
    "retry_sent_non_idempotent": _c(True, "_base_client.py request(): every method is retried; a POST carries an "
                                          "idempotency key reused across its retries (_idempotency_key)"),
    "backoff": _c("exponential", "_base_client.py BaseClient._calculate_retry_timeout: "
                                 "min(INITIAL_RETRY_DELAY * pow(2.0, nb_retries), MAX_RETRY_DELAY)"),
    "backoff_base_s": _c(0.5, "openai/_constants.py INITIAL_RETRY_DELAY = 0.5"),
    "backoff_factor": _c(2.0, "_base_client.py _calculate_retry_timeout: pow(2.0, nb_retries)"),
    "backoff_cap_s": _c(8.0, "openai/_constants.py MAX_RETRY_DELAY = 8.0"),
    "jitter": _c("multiplicative", "_base_client.py _calculate_retry_timeout: jitter = 1 - 0.25 * random()"),
    "jitter_amount": _c(0.25, "_base_client.py _calculate_retry_timeout: 1 - 0.25 * random()"),
    "cap_bounds_jitter": _c(True, "_base_client.py _calculate_retry_timeout: the jitter multiplies the capped wait"),
    "retry_after": _c(True, "_base_client.py _calculate_retry_timeout: a Retry-After in (0, MAX_RETRY_AFTER_DELAY] "
                            "is the wait"),
    "retry_after_formats": _c(("ms", "seconds", "date"), "_base_client.py BaseClient._parse_retry_after_header: "
                              "retry-after-ms, then retry-after as seconds, then as an HTTP date"),
    "retry_after_cap_s": _c(120.0, "openai/_constants.py MAX_RETRY_AFTER_DELAY = 2 * 60"),
    "retry_after_above_cap": _c("give_up", "_base_client.py BaseClient._should_retry: \"Not retrying because "
                                           "`Retry-After` ... exceeds the maximum\""),
    "retry_after_jitter": _c(False, "_base_client.py _calculate_retry_timeout returns the Retry-After as is"),
    "should_retry_header": _c(True, "_base_client.py BaseClient._should_retry: x-should-retry true / false obeyed"),
    "throttle": _c("none", "_base_client.py: no retry throttling"),
}, notes=(
    "Changed from 1.x (1.109.1): a Retry-After above the cap gave no give-up there; _calculate_retry_timeout "
    "ignored it (`0 < retry_after <= 60`) and used the backoff, and the cap was 60 s, not 120 s. "
    "The transport is httpx2 (1.x: httpx); DEFAULT_TIMEOUT, DEFAULT_MAX_RETRIES, INITIAL_RETRY_DELAY, "
    "MAX_RETRY_DELAY, the jitter and the retried statuses are unchanged.",
))

# ---- openai-python 1.109.1, the last 1.x ------------------------------------
OPENAI_1 = Preset("client", "openai-python", "1.109.1", {
    **{k: _c(c.value, "as in 3.57.0, read in 1.109.1: " + c.source) for k, c in OPENAI.settings.items()},
    "retry_after": _c(True, "openai 1.109.1 _base_client.py _calculate_retry_timeout: a Retry-After in "
                            "(0, 60] is the wait"),
    "retry_after_cap_s": _c(60.0, "openai 1.109.1 _base_client.py _calculate_retry_timeout: "
                                  "`0 < retry_after <= 60`"),
    "retry_after_above_cap": _c("backoff", "openai 1.109.1 _base_client.py: _should_retry has no Retry-After "
                                           "check; _calculate_retry_timeout falls back to the backoff"),
    "timeout_s": _c(600.0, "openai 1.109.1 _constants.py DEFAULT_TIMEOUT = httpx.Timeout(timeout=600, connect=5.0)"),
}, notes=("The 1.x line for comparison; every other value as in 3.57.0, read from 1.109.1's _constants.py and "
          "_base_client.py.",))

# ---- langchain-openai 1.8.1 (ChatOpenAI) ------------------------------------
LANGCHAIN = Preset("client", "langchain-openai", "1.8.1 (on openai-python 3.57.0)", {
    **{k: _c(c.value, "openai-python 3.57.0 " + c.source) for k, c in OPENAI.settings.items()},
    "timeout_s": _c(None, "langchain_openai/chat_models/base.py ChatOpenAI.request_timeout = Field(default=None, "
                          "alias=\"timeout\") passed as \"timeout\" to openai.OpenAI; openai's "
                          "SyncAPIClient.__init__ takes an explicit None as given (is_given(None)): no timeout"),
    "max_retries": _c(2, "langchain_openai/chat_models/base.py ChatOpenAI.max_retries = None is not passed "
                         "(`if self.max_retries is not None`), so openai's DEFAULT_MAX_RETRIES = 2 applies"),
}, notes=(
    "ChatOpenAI retries through the openai-python client it builds; every retry value is openai-python 3.57.0's "
    "(langchain-openai 1.8.1 requires openai>=2.45.0).",
    "stream_chunk_timeout (120 s, LANGCHAIN_OPENAI_STREAM_CHUNK_TIMEOUT_S) applies to async streaming only.",
))

# ---- langchain-core 1.8.4 Runnable.with_retry() (tenacity 9.2.1) --------------
WITH_RETRY = Preset("client", "langchain-core Runnable.with_retry()", "langchain-core 1.8.4, tenacity 9.2.1", {
    "timeout_s": _c(None, "langchain_core/runnables/retry.py RunnableRetry: no timeout of its own"),
    "deadline_s": _c(None, "RunnableRetry._kwargs_retrying: stop is stop_after_attempt only"),
    "max_retries": _c(2, "langchain_core/runnables/base.py Runnable.with_retry(stop_after_attempt=3): "
                         "3 attempts in all"),
    "retry_on": _c(("timeout", "connect_error", "4xx", "5xx"),
                   "Runnable.with_retry(retry_if_exception_type=(Exception,)): every exception, so every status "
                   "openai-python raises for (>= 400)"),
    "retry_sent_non_idempotent": _c(True, "RunnableRetry re-invokes the runnable whatever it sent"),
    "backoff": _c("exponential", "RunnableRetry._kwargs_retrying: tenacity.wait_exponential_jitter()"),
    "backoff_base_s": _c(1.0, "tenacity/wait.py wait_exponential_jitter(initial=1, multiplier=1): "
                              "multiplier * exp_base ** (attempt_number - 1)"),
    "backoff_factor": _c(2.0, "tenacity/wait.py wait_exponential_jitter(exp_base=2)"),
    "backoff_cap_s": _c(math.inf, "tenacity/wait.py wait_exponential_jitter(max=_utils.MAX_WAIT = sys.maxsize / 2)"),
    "jitter": _c("additive", "tenacity/wait.py wait_exponential_jitter.__call__: + random.uniform(0, self.jitter)"),
    "jitter_amount": _c(1.0, "tenacity/wait.py wait_exponential_jitter(jitter=1)"),
    "cap_bounds_jitter": _c(True, "tenacity/wait.py: max(max(0, self.min), min(result, self.max))"),
    "retry_after": _c(False, "tenacity's waits read no response headers"),
    "retry_after_formats": _c((), "no Retry-After read"),
    "retry_after_cap_s": _c(None, "no Retry-After read"),
    "retry_after_above_cap": _c("backoff", "no Retry-After read"),
    "retry_after_jitter": _c(False, "no Retry-After read"),
    "should_retry_header": _c(False, "no response headers read"),
    "throttle": _c("none", "no retry throttling"),
}, notes=(
    "A layer of its own above ChatOpenAI: `ChatOpenAI().with_retry()` makes 3 attempts of a call that itself "
    "makes up to 3 (openai-python's 2 retries).",
))

# ---- LiteLLM 1.110.2: the proxy, whose Router retries -------------------------
_LITELLM_CD = "router_utils/cooldown_handlers.py (the Python router; its version not pinned)"
LITELLM = Preset("gateway", "litellm (proxy, Router)", "1.110.2", {
    "timeout_s": _c(600.0, "router_rust/invoke/endpoints.py default_litellm_params: \"timeout\" is the Router's "
                           "explicit timeout (None by default); litellm_core_utils/completion_timeout.py "
                           "CompletionTimeout.resolve: 600 when nothing was configured "
                           "(constants.py COMPLETION_HTTP_FALLBACK_SECONDS = 600.0)"),
    "deadline_s": _c(None, "no total deadline by default (a request's total_timeout is opt-in: "
                           "router_rust/core.py _error_outlasting_total_timeout)"),
    "max_retries": _c(2, "router_rust/core.py Router settings: num_retries ... else 2 "
                         "(router.py docstring: \"Defaults to 2\")"),
    "retry_on": _c(_OPENAI_RETRY_ON, "utils.py should_retry (408, 409, 429, >= 500), consulted by "
                                     "router_rust/invoke/streaming.py should_retry_status; the non-streaming "
                                     "decision is in the compiled router core: not verified"),
    "retry_sent_non_idempotent": _c(True, "the Router resends the completion whatever was sent"),
    "backoff": _c("exponential", "utils.py calculate_retry_after: INITIAL_RETRY_DELAY * pow(2.0, num_retries)"),
    "backoff_base_s": _c(0.5, "constants.py INITIAL_RETRY_DELAY = 0.5"),
    "backoff_factor": _c(2.0, "utils.py calculate_retry_after: pow(2.0, num_retries)"),
    "backoff_cap_s": _c(8.0, "constants.py MAX_RETRY_DELAY = 8.0"),
    "jitter": _c("additive", "utils.py calculate_retry_after: jitter = JITTER * random.random(), added"),
    "jitter_amount": _c(0.75, "constants.py JITTER = 0.75"),
    "cap_bounds_jitter": _c(False, "utils.py calculate_retry_after: min(sleep_seconds, MAX_RETRY_DELAY) + jitter"),
    "retry_after": _c(True, "utils.py calculate_retry_after: `0 < retry_after <= 60` is the wait"),
    "retry_after_formats": _c(("seconds_int", "date"), "utils.py _get_retry_after_from_exception_header: "
                              "int(retry-after), else an HTTP date; no retry-after-ms"),
    "retry_after_cap_s": _c(60.0, "utils.py calculate_retry_after: `0 < retry_after <= 60`"),
    "retry_after_above_cap": _c("backoff", "utils.py calculate_retry_after: otherwise the exponential backoff"),
    "retry_after_jitter": _c(True, "utils.py calculate_retry_after: `return retry_after + jitter`"),
    "should_retry_header": _c(False, "utils.py should_retry takes the status only"),
    "throttle": _c("none", "no retry throttling in the Router"),
    "timeout_status": _c(408, "exceptions.py Timeout: `self.status_code = exception_status_code or 408`; that "
                              "the proxy answers with this status was not verified in its error mapping"),
    "timeout_between_reads": _c(True, "the timeout reaches the provider's client (openai-python's httpx.Timeout): a "
                                      "read timeout, between bytes (a stream's silences), as the openai-python "
                                      "preset's; not verified in the compiled router core"),
    "cut_counts_as_failure": _c(True, "a stream cut by the timeout raises in the Router's call: taken as a failure "
                                      "toward the deployment's cooldown (not verified in source)"),
    "passes_disconnect": _c(False, "proxy/_types.py ConfigGeneralSettings.cancel_on_disconnect = None; "
                                   "proxy/common_request_processing.py: the upstream call is cancelled only "
                                   "`if general_settings.get(\"cancel_on_disconnect\", False)` (non-streaming)"),
    "passes_disconnect_queued": _c(False, "no queue of its own by default; as passes_disconnect"),
    "max_connections": _c(None, "Router(default_max_parallel_requests=None): no limit"),
    "max_queue": _c(None, "no queue"),
    "queue_timeout_s": _c(None, "no queue"),
    "upstream_servers": _c(1, "one deployment in the model group"),
    "next_server_only": _c(False, "retries may go to the same deployment"),
    "fails_to_mark_down": _c(5, f"{_LITELLM_CD} _should_cooldown_deployment, v2 logic while allowed_fails keeps "
                                "its default: percent_fails > DEFAULT_FAILURE_THRESHOLD_PERCENT once the minute has "
                                "DEFAULT_FAILURE_THRESHOLD_MINIMUM_REQUESTS (5) requests, not for a group of one; "
                                "1.110.2's compiled core: not verified"),
    "down_for_s": _c(5.0, "router_rust/core.py: cooldown_time or DEFAULT_COOLDOWN_TIME_SECONDS "
                          "(constants.py: 5); router.py's docstring says 1: the code's value is used"),
    "balance": _c("random", "router.py Router(routing_strategy=\"simple-shuffle\"): a random deployment, weighted "
                            "only where rpm/tpm/weight are set (least-busy: least-conn)"),
    "health": _c("litellm", f"{_LITELLM_CD} _should_cooldown_deployment: a 429 in a group of more than one, or the "
                            "minute's failure share; _is_cooldown_required: 429, 401, 408, 404 and 5xx"),
    "retry_server": _c("any", "router.py: each retry picks a deployment again among those not cooling down"),
    "no_live_status": _c(429, "router.py RouterRateLimitError \"No deployments available\" (status 429): not "
                              "verified in 1.110.2"),
    "connect_error_status": _c(500, "docs/my-website/docs/exception_mapping.md: APIConnectionError, status 500 (a "
                                    "deployment that refuses the connection); not verified in 1.110.2"),
    "failure_rate": _c(0.5, "constants.py DEFAULT_FAILURE_THRESHOLD_PERCENT = 0.5"),
}, notes=(
    "The Router's own openai client makes no retries (default_litellm_params: \"max_retries\": 0).",
    "A retry waits 0 s instead of the backoff while another deployment is healthy "
    "(router_rust/core.py _sleep_seconds, after _time_to_sleep_before_retry); the preset keeps the backoff, as "
    "for a model group with no other healthy deployment. Which deployments count is decided in the compiled "
    "core: not verified; set backoff = \"none\" for the immediate retry.",
    "The cooldown of a group of several deployments (upstream_servers > 1): the minute's failure share, as the "
    "Python router's cooldown_handlers.py decides it (the 100%-failure rule at 1000 requests a minute is left "
    "out).",
    "Set passes_disconnect = true for general_settings.cancel_on_disconnect: true.",
))

# ---- nginx 1.22.1 -------------------------------------------------------------
NGINX = Preset("gateway", "nginx", "1.22.1", {
    "timeout_s": _c(60.0, "src/http/modules/ngx_http_proxy_module.c ngx_http_proxy_merge_loc_conf: "
                          "proxy_read_timeout 60000 ms (between two reads; a non-streaming reply sends nothing "
                          "before it is done)"),
    "deadline_s": _c(None, "no total deadline"),
    "max_retries": _c(None, "no count of its own: peer.tries = the servers "
                            "(ngx_http_upstream_round_robin.c ngx_http_upstream_tries), see next_server_only"),
    "max_tries": _c(0, "ngx_http_proxy_merge_loc_conf: proxy_next_upstream_tries 0 (no limit)"),
    "tries_timeout_s": _c(None, "ngx_http_proxy_merge_loc_conf: proxy_next_upstream_timeout 0 (no limit)"),
    "retry_on": _c(("timeout", "connect_error"), "ngx_http_proxy_merge_loc_conf: proxy_next_upstream "
                                                 "NGX_HTTP_UPSTREAM_FT_ERROR|NGX_HTTP_UPSTREAM_FT_TIMEOUT "
                                                 "(\"error timeout\")"),
    "retry_sent_non_idempotent": _c(False, "src/http/ngx_http_upstream.c ngx_http_upstream_next: a POST with "
                                           "u->request_sent gets FT_NON_IDEMPOTENT, not in the default mask"),
    "backoff": _c("none", "ngx_http_upstream_next passes the request on at once"),
    "backoff_base_s": _c(0.0, "no wait"),
    "backoff_factor": _c(2.0, "unused"),
    "backoff_cap_s": _c(None, "no wait"),
    "jitter": _c("none", "no wait"),
    "jitter_amount": _c(0.0, "no wait"),
    "cap_bounds_jitter": _c(True, "unused"),
    "retry_after": _c(False, "nginx does not read Retry-After"),
    "retry_after_formats": _c((), "nginx does not read Retry-After"),
    "retry_after_cap_s": _c(None, "nginx does not read Retry-After"),
    "retry_after_above_cap": _c("backoff", "nginx does not read Retry-After"),
    "retry_after_jitter": _c(False, "nginx does not read Retry-After"),
    "should_retry_header": _c(False, "no such header"),
    "throttle": _c("none", "no retry throttling"),
    "timeout_status": _c(504, "ngx_http_upstream.c ngx_http_upstream_next: NGX_HTTP_UPSTREAM_FT_TIMEOUT -> "
                              "NGX_HTTP_GATEWAY_TIME_OUT"),
    "timeout_between_reads": _c(True, "ngx_http_proxy_module.c: proxy_read_timeout is set \"only between two "
                                      "successive read operations\" of the response (the module's documentation)"),
    "cut_counts_as_failure": _c(False, "ngx_http_upstream.c: a read timeout once the response header is sent ends in "
                                       "ngx_http_upstream_finalize_request, `u->peer.free(&u->peer, u->peer.data, 0)`: "
                                       "not NGX_PEER_FAILED; only ngx_http_upstream_next, before the header, counts a "
                                       "failure"),
    "passes_disconnect": _c(True, "ngx_http_proxy_merge_loc_conf: proxy_ignore_client_abort 0 (off); "
                                  "ngx_http_upstream.c ngx_http_upstream_check_broken_connection: \"client "
                                  "prematurely closed connection, so upstream connection is closed too\""),
    "passes_disconnect_queued": _c(True, "no queue (the upstream `queue` directive is NGINX Plus only)"),
    "max_connections": _c(None, "ngx_http_upstream.c ngx_http_upstream_server: max_conns = 0 (no limit)"),
    "max_queue": _c(None, "no queue in open-source nginx"),
    "queue_timeout_s": _c(None, "no queue in open-source nginx"),
    "upstream_servers": _c(1, "one server in the upstream block"),
    "next_server_only": _c(True, "proxy_next_upstream passes the request to the next server; "
                                 "ngx_http_upstream_tries counts one try per server"),
    "fails_to_mark_down": _c(1, "ngx_http_upstream.c ngx_http_upstream_server: max_fails = 1"),
    "down_for_s": _c(10.0, "ngx_http_upstream.c ngx_http_upstream_server: fail_timeout = 10"),
    "balance": _c("round-robin", "ngx_http_upstream_round_robin.c ngx_http_upstream_get_peer: smooth weighted "
                                 "round robin, the default method (least_conn, hash: their modules)"),
    "health": _c("nginx", "ngx_http_upstream_round_robin.c 1.22.1 ngx_http_upstream_get_peer (skips a peer with "
                          "fails >= max_fails while now - checked <= fail_timeout; sets checked = now on the first "
                          "pick after it) and ngx_http_upstream_free_round_robin_peer (NGX_PEER_FAILED: fails++, "
                          "accessed = checked = now; else fails = 0 if accessed < checked; peers->single: nothing "
                          "counted); ngx_http_upstream.c ngx_http_upstream_next: every ft_type but 403 and 404 is "
                          "NGX_PEER_FAILED, a status only where proxy_next_upstream lists it"),
    "retry_server": _c("other", "ngx_http_upstream_get_peer skips the peers in rrp->tried"),
    "no_live_status": _c(502, "ngx_http_upstream.c ngx_http_upstream_connect: NGX_BUSY logs \"no live upstreams\" "
                              "and calls ngx_http_upstream_next(NGX_HTTP_UPSTREAM_FT_NOLIVE), answered "
                              "NGX_HTTP_BAD_GATEWAY"),
    "connect_error_status": _c(502, "ngx_http_upstream.c ngx_http_upstream_next: NGX_HTTP_UPSTREAM_FT_ERROR (the "
                                    "connection refused) is answered NGX_HTTP_BAD_GATEWAY once no try is left"),
}, notes=(
    "A read timeout on a POST already sent is answered 504 and never passed to another server; only a "
    "connection error (the request not sent) moves on, to another server.",
))

# ---- HAProxy 2.6.0 ------------------------------------------------------------
HAPROXY = Preset("gateway", "haproxy", "2.6.0", {
    "timeout_s": _c(None, "doc/configuration.txt \"timeout server\": no default (HAProxy warns when it is "
                          "missing); set it in the scenario"),
    "deadline_s": _c(None, "no total deadline"),
    "max_retries": _c(3, "doc/configuration.txt \"retries\": the default value is 3"),
    "max_tries": _c(0, "no such limit"),
    "tries_timeout_s": _c(None, "no such limit"),
    "retry_on": _c(("connect_error",), "doc/configuration.txt \"retry-on\": the default is \"conn-failure\""),
    "retry_sent_non_idempotent": _c(True, "doc/configuration.txt \"retry-on\": L7 retries replay the request "
                                          "whatever its method (the application must be replay-safe)"),
    "backoff": _c("fixed", "doc/configuration.txt \"retries\": a turn-around timer of "
                           "min(\"timeout connect\", one second) before a retry"),
    "backoff_base_s": _c(1.0, "doc/configuration.txt \"retries\": min(\"timeout connect\", one second), "
                              "\"timeout connect\" unset"),
    "backoff_factor": _c(2.0, "unused"),
    "backoff_cap_s": _c(None, "fixed wait"),
    "jitter": _c("none", "no jitter"),
    "jitter_amount": _c(0.0, "no jitter"),
    "cap_bounds_jitter": _c(True, "unused"),
    "retry_after": _c(False, "HAProxy does not read Retry-After"),
    "retry_after_formats": _c((), "HAProxy does not read Retry-After"),
    "retry_after_cap_s": _c(None, "HAProxy does not read Retry-After"),
    "retry_after_above_cap": _c("backoff", "HAProxy does not read Retry-After"),
    "retry_after_jitter": _c(False, "HAProxy does not read Retry-After"),
    "should_retry_header": _c(False, "no such header"),
    "throttle": _c("none", "no retry throttling"),
    "timeout_status": _c(504, "src/http_ana.c http_wait_for_response: \"read timeout : return a 504 to the client\""),
    "timeout_between_reads": _c(True, "doc/configuration.txt \"timeout server\": \"the maximum inactivity time on "
                                      "the server side\""),
    "cut_counts_as_failure": _c(False, "src/http_ana.c http_wait_for_response: health_adjust(..., "
                                       "HANA_STATUS_HTTP_READ_TIMEOUT) only while waiting for the response header; a "
                                       "200's header is HANA_STATUS_HTTP_OK, and a timeout while the body is forwarded "
                                       "adjusts nothing"),
    "passes_disconnect": _c(False, "src/http_ana.c http_request_forward_body: only with \"option abortonclose\" is "
                                   "the client's shutdown forwarded to the server; doc/configuration.txt "
                                   "\"option abortonclose\": by default aborted requests will be served"),
    "passes_disconnect_queued": _c(False, "doc/configuration.txt \"option abortonclose\" (off by default): with it "
                                          "a request whose client closed is dropped from the queue"),
    "max_connections": _c(None, "doc/configuration.txt server \"maxconn\": the default value is 0, unlimited"),
    "max_queue": _c(None, "doc/configuration.txt server \"maxqueue\": the default value is 0, unlimited"),
    "queue_timeout_s": _c(None, "doc/configuration.txt \"timeout queue\": if unspecified, \"timeout connect\" "
                                "(no default)"),
    "queue_status": _c(503, "doc/configuration.txt \"timeout queue\": dropped and a 503 error is returned"),
    "upstream_servers": _c(1, "one server in the backend"),
    "next_server_only": _c(False, "retries stay on the same server unless \"option redispatch\""),
    "fails_to_mark_down": _c(None, "passive health (\"observe\") is off by default; with \"check observe "
                                   "layer7\", doc/configuration.txt \"error-limit\": 10 consecutive errors by default"),
    "down_for_s": _c(0.0, "unused: a server marked down comes back after \"rise\" good checks (check_interval_s)"),
    "balance": _c("round-robin", "doc/configuration.txt \"balance\": roundrobin (leastconn: least-conn)"),
    "health": _c("haproxy", "doc/configuration.txt \"observe\": layer7 errors are statuses other than 100-499, "
                            "501 and 505, and timeouts; it \"requires to enable health checks\"; src/check.c "
                            "analyze_statuses: HANA_STATUS_L4_ERR \"L4 unsuccessful connection\" is an error in both "
                            "observe modes (the file's version not pinned)"),
    "retry_server": _c("same", "doc/configuration.txt \"option redispatch\" is off by default: a retry stays on "
                               "its server"),
    "no_live_status": _c(503, "doc/configuration.txt \"timeout queue\": a request that no server takes is "
                              "answered 503 (\"no server available\"): not verified in source"),
    "connect_error_status": _c(503, "doc/configuration.txt termination state \"SC\": the server refused the "
                                    "connection and HAProxy answered 503 once \"retries\" were spent; not verified "
                                    "in source"),
    "check_interval_s": _c(2.0, "doc/configuration.txt \"inter\": the delay defaults to 2000 ms (fastinter, "
                                "downinter: inter when unset)"),
    "rise": _c(2, "doc/configuration.txt \"rise\": defaults to 2"),
    "fall": _c(3, "doc/configuration.txt \"fall\": defaults to 3"),
    "on_error": _c("fail-check", "doc/configuration.txt \"on-error\": fail-check (default)"),
}, notes=(
    "`retries` counts connection attempts: once a connection is established nothing is retried unless "
    "retry-on names more than conn-failure.",
    "With `option abortonclose` set both disconnect keys become true.",
))

# ---- Envoy (API v3) -------------------------------------------------------------
_ENVOY_ROUTE = "api/envoy/config/route/v3/route_components.proto (envoy main, commit 0035e40)"
_ENVOY_CB = "api/envoy/config/cluster/v3/circuit_breaker.proto (envoy main, commit 01c2c1f)"
_ENVOY_OD = ("api/envoy/config/cluster/v3/outlier_detection.proto as its comments read (read in APIs copied from "
              "it; the envoy repository itself not read)")
ENVOY = Preset("gateway", "envoy", "API v3 (main at commit 0035e40; these defaults unchanged since v1.x)", {
    "timeout_s": _c(None, f"{_ENVOY_ROUTE} RetryPolicy.per_try_timeout: unset, the route timeout applies"),
    "deadline_s": _c(15.0, f"{_ENVOY_ROUTE} RouteAction.timeout: \"If not specified, the default is 15s\"; "
                           "\"This timeout includes all retries\""),
    "max_retries": _c(0, f"{_ENVOY_ROUTE} RouteAction.retry_policy: unset by default, no retries; "
                         "RetryPolicy.num_retries \"defaults to 1\" once a policy is set"),
    "max_tries": _c(0, "no such limit"),
    "tries_timeout_s": _c(None, "no such limit"),
    "retry_on": _c((), f"{_ENVOY_ROUTE} RetryPolicy.retry_on: no default condition (envoy_retry_on() reads "
                       "\"5xx\", \"gateway-error\", \"reset\", \"connect-failure\", \"retriable-4xx\")"),
    "retry_sent_non_idempotent": _c(True, "Envoy retries per retry_on whatever the method: not verified in source"),
    "backoff": _c("envoy", f"{_ENVOY_ROUTE} RetryPolicy.retry_back_off; router filter docs x-envoy-max-retries: "
                           "fully jittered, [0, (2^N - 1) * base)"),
    "backoff_base_s": _c(0.025, f"{_ENVOY_ROUTE} RetryPolicy.retry_back_off: \"the default base interval is 25 "
                                "milliseconds\""),
    "backoff_factor": _c(2.0, "router filter docs: (2^N - 1) * base"),
    "backoff_cap_s": _c(0.25, f"{_ENVOY_ROUTE} RetryPolicy.retry_back_off: \"The default maximum interval is 10 "
                              "times the base interval\""),
    "jitter": _c("full", "router filter docs: fully jittered exponential back-off"),
    "jitter_amount": _c(0.0, "unused"),
    "cap_bounds_jitter": _c(True, "the draw is below the capped interval"),
    "retry_after": _c(False, f"{_ENVOY_ROUTE} RetryPolicy.rate_limited_retry_back_off: unset by default"),
    "retry_after_formats": _c(("seconds_int",), f"{_ENVOY_ROUTE} RateLimitedRetryBackOff: Retry-After as an integer "
                                            "number of seconds (format SECONDS)"),
    "retry_after_cap_s": _c(300.0, f"{_ENVOY_ROUTE} RateLimitedRetryBackOff.max_interval: \"Defaults to 300 "
                                   "seconds\""),
    "retry_after_above_cap": _c("backoff", f"{_ENVOY_ROUTE} RateLimitedRetryBackOff: a longer interval \"is "
                                           "discarded and the next header ... is tried\", then the exponential "
                                           "back-off"),
    "retry_after_jitter": _c(False, "Envoy draws random(interval, interval * 1.5) for a rate-limited back-off: "
                                    "not modelled (off by default)"),
    "should_retry_header": _c(False, "no such header"),
    "throttle": _c("concurrency", f"{_ENVOY_CB} Thresholds.max_retries: parallel retries, \"If not specified, the "
                                  "default is 3\""),
    "max_concurrent_retries": _c(3, f"{_ENVOY_CB} Thresholds.max_retries default 3"),
    "budget_percent": _c(20.0, f"{_ENVOY_CB} RetryBudget.budget_percent: \"Defaults to 20%\" (set throttle = "
                               "\"budget\" to use it)"),
    "min_retry_concurrency": _c(3, f"{_ENVOY_CB} RetryBudget.min_retry_concurrency: \"Defaults to 3\""),
    "timeout_status": _c(504, "router filter: an upstream request timeout is answered 504: not verified in source"),
    "timeout_between_reads": _c(False, f"{_ENVOY_ROUTE} RouteAction.timeout: it \"spans between the point at which "
                                       "the entire downstream request ... has been processed and when the upstream "
                                       "response has been completely processed\": the whole answer"),
    "cut_counts_as_failure": _c(True, "router filter onUpstreamTimeout: the host's outlier detector is told of a "
                                      "timeout (a local-origin failure, counted with the 5xx unless "
                                      "split_external_local_origin_errors): not verified in source"),
    "passes_disconnect": _c(True, "the router filter resets the upstream request when the downstream stream is "
                                  "reset: not verified in source"),
    "passes_disconnect_queued": _c(True, "as passes_disconnect: not verified in source"),
    "max_connections": _c(1024, f"{_ENVOY_CB} Thresholds.max_requests: \"the default is 1024\""),
    "max_queue": _c(1024, f"{_ENVOY_CB} Thresholds.max_pending_requests: \"the default is 1024\""),
    "queue_timeout_s": _c(None, "pending requests wait within the route timeout (deadline_s)"),
    "queue_status": _c(503, "circuit breaker overflow is answered 503: not verified in source"),
    "upstream_servers": _c(1, "one host in the cluster"),
    "next_server_only": _c(False, "a retry may pick the same host (retry_host_predicate unset)"),
    "fails_to_mark_down": _c(None, f"outlier detection is off by default (Cluster.outlier_detection unset); "
                                   f"{_ENVOY_OD} consecutive_5xx: \"Defaults to 5\" once configured"),
    "down_for_s": _c(30.0, f"{_ENVOY_OD} base_ejection_time: \"Defaults to 30000ms or 30s\", times the host's "
                           "ejections"),
    "balance": _c("round-robin", "api/envoy/config/cluster/v3/cluster.proto Cluster.lb_policy: ROUND_ROBIN by "
                                 "default (LEAST_REQUEST: least-request); not verified in source"),
    "health": _c("envoy", f"{_ENVOY_OD}; arch overview outlier detection: locally originated errors (a timeout, "
                          "a connect failure) count as 5xx unless split_external_local_origin_errors: not verified "
                          "in source"),
    "retry_server": _c("any", f"{_ENVOY_ROUTE} RetryPolicy.retry_host_predicate unset: a retry is a new pick of "
                              "the load balancer"),
    "no_live_status": _c(503, "router filter: \"no healthy upstream\" is answered 503: not verified in source"),
    "connect_error_status": _c(503, "router filter: \"upstream connect error or disconnect/reset before "
                                    "headers\" (response flag UF) is answered 503: not verified in source"),
    "check_interval_s": _c(10.0, f"{_ENVOY_OD} interval: \"Defaults to 10000ms or 10s\" (the ejection sweep)"),
    "max_ejection_percent": _c(10.0, f"{_ENVOY_OD} max_ejection_percent: \"Defaults to 10% but will eject at "
                                     "least one host regardless of the value\""),
    "panic_threshold_percent": _c(50.0, "api/envoy/config/cluster/v3/cluster.proto "
                                        "CommonLbConfig.healthy_panic_threshold: 50% by default; not verified in "
                                        "source"),
    "max_down_for_s": _c(300.0, f"{_ENVOY_OD} max_ejection_time: 300s by default"),
}, notes=(
    "A retry policy is opt-in: `max_retries = 1` with `retry_on = envoy_retry_on(\"5xx\")` is a policy with "
    "num_retries' default. Without a per-try timeout a timed-out request is not retried: the 15 s covers all "
    "attempts.",
))

# ---- Gateway API Inference Extension v1.0.0 (EPP) ------------------------------------
_GAIE = "kubernetes-sigs/gateway-api-inference-extension v1.0.0"
INFERENCE_GATEWAY = Preset("gateway", "inference-gateway (Gateway API Inference Extension EPP)", "v1.0.0", {
    "timeout_s": _c(None, "the Gateway implementation's (Envoy-based); the extension sets none"),
    "deadline_s": _c(None, "the extension sets none"),
    "max_retries": _c(0, "the EPP picks one endpoint per request; retries are the Gateway's"),
    "retry_on": _c((), "no retries of its own"),
    "shed": _c("sheddable", f"{_GAIE} pkg/epp/requestcontrol/director.go Director.admitRequest: a request with "
                            "priority < 0 is dropped when IsSaturated; priority >= 0 bypasses the check"),
    "shed_status": _c(429, f"{_GAIE} pkg/epp/handlers/server.go buildErrResponse: InferencePoolResourceExhausted "
                           "-> StatusCode_TooManyRequests"),
    "queue_depth_threshold": _c(5, f"{_GAIE} pkg/epp/saturationdetector/config.go DefaultQueueDepthThreshold = 5"),
    "kv_cache_threshold": _c(0.8, f"{_GAIE} pkg/epp/saturationdetector/config.go DefaultKVCacheUtilThreshold = 0.8"),
    "metrics_staleness_s": _c(0.2, f"{_GAIE} pkg/epp/saturationdetector/config.go "
                                   "DefaultMetricsStalenessThreshold = 200 * time.Millisecond"),
    "timeout_between_reads": _c(False, "Envoy-based data plane: see the envoy preset (not verified in source)"),
    "cut_counts_as_failure": _c(True, "Envoy-based data plane: see the envoy preset (not verified in source)"),
    "passes_disconnect": _c(True, "Envoy-based data plane: see the envoy preset (not verified in source)"),
    "passes_disconnect_queued": _c(True, "no queue in v1.0.0 (flow control came later)"),
    "max_connections": _c(None, "no connection limit of its own"),
    "max_queue": _c(None, "no queue in v1.0.0"),
    "timeout_status": _c(504, "the Gateway's upstream timeout (Envoy-based)"),
}, notes=(
    f"Saturation ({_GAIE} pkg/epp/saturationdetector/saturationdetector.go Detector.IsSaturated): the pool is "
    "saturated when no pod has fresh metrics with a waiting queue <= 5 and KV cache use <= 0.8.",
    "Priority comes from the request's InferenceObjective (apix/v1alpha2 InferenceObjectiveSpec.Priority, unset "
    "= 0): only objectives with a negative priority are sheddable.",
))

PRESETS: dict[str, Preset] = {
    "openai-python": OPENAI,
    "openai-python-1": OPENAI_1,
    "langchain-openai": LANGCHAIN,
    "langchain-with-retry": WITH_RETRY,
    "litellm": LITELLM,
    "nginx": NGINX,
    "haproxy": HAPROXY,
    "envoy": ENVOY,
    "inference-gateway": INFERENCE_GATEWAY,
}


def keys_of(kind: str) -> tuple:
    """The settings a layer of this kind takes."""
    if kind == "client":
        return RETRY_KEYS
    if kind == "gateway":
        return RETRY_KEYS + GATEWAY_KEYS
    raise ValueError(f"kind: unknown layer kind {kind!r} (known: {', '.join(KINDS)})")


def _plain(value):
    return tuple(value) if isinstance(value, list) else value


def policies(settings: dict):
    """(RetryPolicy, GatewayPolicy or None) of a layer's effective settings."""
    kind = settings.get("kind", "client")
    keys_of(kind)
    retry = RetryPolicy(**{k: _plain(v) for k, v in settings.items() if k in RETRY_KEYS})
    gateway = (GatewayPolicy(**{k: _plain(v) for k, v in settings.items() if k in GATEWAY_KEYS})
               if kind == "gateway" else None)
    return retry, gateway


def preset(kind: str, name: str, **overrides) -> dict:
    """A layer's effective settings: the named preset's values with the
    overrides on top (`name` labels the layer). Refuses an unknown preset or key and any setting its
    policy refuses, with a one-line ValueError that names the key."""
    allowed = keys_of(kind)
    p = PRESETS.get(name)
    if p is None:
        raise ValueError(f"preset: unknown preset {name!r} (known: {', '.join(PRESETS)})")
    if p.kind != kind:
        raise ValueError(f"preset: {name!r} is a {p.kind} preset, not a {kind}")
    for k in overrides:
        if k not in allowed and k != "name":
            raise ValueError(f"{k}: not a setting of a {kind} layer")
    out = {"kind": kind, "preset": name, "version": p.version}
    out.update({k: c.value for k, c in p.settings.items()})
    out.update({k: _plain(v) for k, v in overrides.items()})
    policies(out)
    return out


def changed_keys(kind: str, settings: dict, kept: tuple) -> list:
    """The keys of a layer's effective settings, outside `kept` (and the
    layer's own META keys and name), whose value differs from its preset's:
    [(key, the preset's value)]."""
    base = preset(kind, settings["preset"])
    return [(k, base.get(k)) for k, v in settings.items()
            if k not in META and k not in kept and k != "name" and base.get(k) != v]


def citations(name: str) -> dict:
    """Key -> citation of a preset's values."""
    return {k: c.source for k, c in PRESETS[name].settings.items()}
