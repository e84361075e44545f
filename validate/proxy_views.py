"""What the live proxy (`validate.proxy.LiveProxy`) knows of its engines, and
what it exports: per replica, the prompt tokens dispatched there awaiting
their first token, the executions sent there and not ended, and the engine's
gauges at the last scrape of its `/metrics` (every `scrape_every_s`); the
prompt throughput each policy core sees (`PromptRate`); the views read of
them by the estimator (`EngineView`), the router (`ReplicaView`) and the
layers above the policy core (`pods`); the proxy's own prometheus metrics
(`Metrics`), with the waste gauges over the executions the engines accepted
(running sums: `retire` folds an ended one in)."""
from __future__ import annotations

import asyncio
import math

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from sim.policy.proxy import EngineView, PromptRate
from sim.policy.router import ReplicaView

from .engine import parse_metrics


class Metrics:
    """The live proxy's `/metrics` (prometheus-client), in their own registry."""

    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.attempts = Counter("llmsim_proxy_attempts", "attempts received", ["kind"], registry=r)
        ex = lambda n, h: Counter(f"llmsim_proxy_executions_{n}", h, registry=r)   # noqa: E731
        self.created = ex("created", "executions created")
        self.attached = ex("attached", "attempts attached to a live execution")
        self.refused = Counter("llmsim_proxy_refused", "attempts refused", ["reason", "status"], registry=r)
        self.cancelled = ex("cancelled", "executions cancelled at the engine")
        self.orphaned = ex("orphaned", "executions left with no subscriber and read on")
        self.dropped = ex("dropped", "queued executions dropped before the engine")
        self.completed = ex("completed", "executions the engine finished")
        self.engine_refused = ex("engine_refused", "executions the engine refused (503)")
        self.queue = Gauge("llmsim_proxy_queue_depth", "executions waiting in the proxy queue", registry=r)
        self.outstanding = Gauge("llmsim_proxy_outstanding", "executions dispatched and not finished", registry=r)
        self.engine_waiting = Gauge("llmsim_engine_waiting", "engine's vllm:num_requests_waiting (scraped)",
                                    registry=r)
        self.engine_running = Gauge("llmsim_engine_running", "engine's vllm:num_requests_running (scraped)",
                                    registry=r)
        self.abort_rate = Gauge("abort_rate", "accepted executions finished by abort / accepted", registry=r)
        self.completion_ratio = Gauge("completion_ratio", "tokens generated / max tokens (accepted)", registry=r)
        self.useful_token_ratio = Gauge("useful_token_ratio",
                                        "tokens of completed executions / max tokens (accepted)", registry=r)


class EngineViews:
    """What the proxy knows of the engines at `upstreams` (on the clock
    `now`), exported through `metrics`; `bind(cluster)` once the stack is
    bound over them."""

    def __init__(self, upstreams: list[str], now, metrics: Metrics, scrape_every_s: float = 1.0):
        n = len(upstreams)
        self.upstreams, self.now, self.metrics, self.scrape_every_s = upstreams, now, metrics, scrape_every_s
        # per replica: prompt tokens dispatched and awaiting their first token, executions sent and not ended, the
        # engine's scraped gauges
        self.awaiting = [0] * n
        self.held = [0] * n
        self.engine_gauges: list[dict] = [{} for _ in range(n)]
        self.scraped_at = [-math.inf] * n           # when each engine's gauges were read (now())
        self.cluster = None
        self.prompt_rates: list[PromptRate] = []
        self.accepted_live: set = set()            # streams accepted by the engine, not ended (waste gauges)
        self.accepted_ended = {"n": 0, "cancelled": 0, "max_tokens": 0, "tokens": 0, "useful": 0}
        self.fates: dict[str, int] = {}            # accepted executions ended, by fate (GET /stats)
        self.scraper: asyncio.Task | None = None

    def bind(self, cluster) -> None:
        """The cluster of engines the views are read for (`Stack.bind`'s)."""
        self.cluster = cluster
        self.prompt_rates = [PromptRate(60.0) for _ in cluster.groups]    # the prompt throughput each proxy sees

    def start(self, session: aiohttp.ClientSession) -> None:
        """Scrape the engines' `/metrics` from now on, over `session`."""
        self.scraper = asyncio.create_task(self.scrape(session))

    async def scrape(self, session: aiohttp.ClientSession) -> None:
        while True:
            for r, url in enumerate(self.upstreams):
                try:
                    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                        self.engine_gauges[r] = parse_metrics(await resp.text())
                        self.scraped_at[r] = self.now()
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    pass
            for gauge, key in ((self.metrics.engine_waiting, "vllm:num_requests_waiting"),
                               (self.metrics.engine_running, "vllm:num_requests_running")):
                gauge.set(sum(g.get(key, 0.0) for g in self.engine_gauges))
            await asyncio.sleep(self.scrape_every_s)

    def engine_view_of(self, group: tuple, g: int, t: float) -> EngineView:
        """What the g-th policy core knows of the engines it feeds
        (`group`): the prompt tokens sent there awaiting their first token,
        the prompt throughput seen there, and the engines' waiting requests
        and mean KV cache usage at the last scrape of their `/metrics`."""
        gauges = [self.engine_gauges[r] for r in group]
        return EngineView(float(sum(self.awaiting[r] for r in group)), self.prompt_rates[g].rate(t),
                          float(sum(x.get("vllm:num_requests_waiting", 0.0) for x in gauges)),
                          sum(x.get("vllm:kv_cache_usage_perc", 0.0) for x in gauges) / len(gauges))

    def pods(self, t: float) -> list:
        """What a layer above the policy core reads of each engine: (waiting,
        KV cache usage, age of the reading in s) from its last /metrics."""
        return [(g.get("vllm:num_requests_waiting", 0.0), g.get("vllm:kv_cache_usage_perc", 0.0), t - at)
                for g, at in zip(self.engine_gauges, self.scraped_at)]

    def replica_view(self, r: int) -> ReplicaView:
        """What the router reads of replica r: the executions this proxy has
        sent it and not seen end, plus its own proxy queue (a sidecar's); the
        KV cache usage its engine's /metrics gave at the last scrape."""
        return ReplicaView(self.held[r] + self.cluster.queued_at(r),
                           self.engine_gauges[r].get("vllm:kv_cache_usage_perc", 0.0))

    def update_waste(self) -> None:
        """Set the waste gauges from the sums of the ended executions and the live ones."""
        e, live = self.accepted_ended, self.accepted_live
        n = e["n"] + len(live)
        mx = e["max_tokens"] + sum(s.max_tokens for s in live)
        m = self.metrics
        m.abort_rate.set(e["cancelled"] / n if n else 0.0)
        m.completion_ratio.set((e["tokens"] + sum(s.tokens for s in live)) / mx if mx else 0.0)
        m.useful_token_ratio.set(e["useful"] / mx if mx else 0.0)

    def retire(self, st) -> None:
        """An accepted execution (its `Stream`) has ended: fold it into the waste sums."""
        if st in self.accepted_live:
            self.accepted_live.discard(st)
            e = self.accepted_ended
            e["n"] += 1
            e["cancelled"] += st.fate == "cancelled"
            e["max_tokens"] += st.max_tokens
            e["tokens"] += st.tokens
            e["useful"] += st.tokens if st.fate == "completed" else 0
            fate = str(st.fate)
            self.fates[fate] = self.fates.get(fate, 0) + 1
