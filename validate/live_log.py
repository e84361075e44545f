"""What a live run (`validate.live_run.LiveRun`) saw, as its log: the
engines' `/metrics` and the proxy's queue sampled every second (`Sampler`,
which also notices a lost engine: `engine_lost()` giving a reason, or
`LOST_AFTER_S` consecutive seconds without an answer from `/metrics`), and
the parts of the `sim.runlog.RunLog` made from the samples and the proxy's
records: the gauge series on whole seconds, the engine's counters (at the
end and at the pulse's and the hold's end), the attempts joined to the
executions they subscribed to, and the executions as they stood at the
run's end."""
from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import aiohttp
import numpy as np

from sim.replicas import sum_counters
from sim.runlog import AttemptRecord, Series
from sim.scenario import Scenario

from .engine import parse_metrics

# engine counter -> record key (`counters`); preemptions for `engine`
COUNTERS = {"vllm:prompt_tokens_total": "prompt_tokens_total",
            "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
            "vllm:num_preemptions_total": "preemptions"}
LOST_AFTER_S = 30          # consecutive seconds without an answer from /metrics


@dataclass
class Sample:
    t: float
    waiting: float
    running: float
    proxy_queue: int
    counters: dict
    replicas: list | None = None       # a fleet's: per engine (waiting, running, proxy queue, counters)


class Sampler:
    """The engines at `urls` and the queues of the live proxy `proxy`,
    sampled every second of the run's clock `now` into `samples`; `report(t)`
    is called about every `report_every_s`. `lost` says why the engine was
    lost, if it was; `metrics_missed` counts the scrapes that did not answer
    (the series has a gap)."""

    def __init__(self, urls: list[str], proxy, now, engine_lost=None, report=None, report_every_s: float = 10.0):
        self.urls, self.proxy, self.now = urls, proxy, now
        self.engine_lost = engine_lost                    # callable -> reason the engine is gone, or None
        self.report, self.report_every_s = report, report_every_s
        self.samples: list[Sample] = []
        self.metrics_missed = 0
        self.lost: str | None = None

    async def run(self, session: aiohttp.ClientSession, replica_up=None) -> None:
        """Sample every second; returns only when the engine is lost. A
        replica for which `replica_up(r)` is false is sampled as empty."""
        k = 0
        last_report = -math.inf
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
                self.samples.append(await self._sample(session, t, replica_up))
                failing = 0
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.metrics_missed += 1
            if self.report is not None and t - last_report >= self.report_every_s:
                last_report = t
                self.report(t)
            k += 1

    def silence_s(self, end: float) -> float:
        """The longest stretch to `end` without an answered scrape (from the
        run's start to the first answer, between answers, from the last to
        `end`): an engine's server that answers nothing also passes on its
        calls' requests and aborts late."""
        ts = [0.0, *(s.t for s in self.samples), end]
        return max(b - a for a, b in zip(ts, ts[1:]))

    async def _sample(self, session: aiohttp.ClientSession, t: float, up) -> Sample:
        per = []
        for r, url in enumerate(self.urls):
            if up is not None and not up(r):
                per.append((0.0, 0.0, self.proxy.cluster.queued_at(r), {}))
                continue
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=5)) as resp:
                m = parse_metrics(await resp.text())
            q = self.proxy.cluster.queued_at(r)
            per.append((m.get("vllm:num_requests_waiting", 0.0), m.get("vllm:num_requests_running", 0.0), q,
                        {v: m[c] for c, v in COUNTERS.items() if c in m}))
        return Sample(t, sum(p[0] for p in per), sum(p[1] for p in per), self.proxy.proxy.queued,
                      sum_counters(p[3] for p in per), per if len(per) > 1 else None)


def series(samples: list[Sample], end: float) -> Series:
    """The gauges on whole seconds to `end`: each second's the last sample taken by it (half a second's grace)."""
    ts = np.arange(0.0, math.floor(end) + 1.0)
    st = np.array([s.t for s in samples], dtype=float)

    def at(col):
        v = np.array([getattr(s, col) for s in samples], dtype=float)
        if not len(v):
            return np.zeros(len(ts), dtype=np.int64)
        idx = np.clip(np.searchsorted(st, ts + 0.5, side="right") - 1, 0, len(v) - 1)
        return np.rint(v[idx]).astype(np.int64)
    return Series(t=ts, waiting=at("waiting"), running=at("running"), proxy_queue=at("proxy_queue"))


def counters_at(samples: list[Sample], t: float) -> dict | None:
    """The engine's counters at the last sample by `t` (half a second's grace), if any."""
    before = [s for s in samples if s.t <= t + 0.5]
    return dict(before[-1].counters) if before else None


def engine_counters(samples: list[Sample], scenario: Scenario, steps) -> dict:
    """The log's `counters` (at the end), `counters_at` (the pulse's and the
    hold's end) and `engine` (`steps`, the preemptions) from the samples."""
    last = dict(samples[-1].counters) if samples else {}
    sc = scenario
    at = {t: c for t in (sc.pulse_end, sc.hold_end) if (c := counters_at(samples, t)) is not None}
    counters = {k: int(v) for k, v in last.items() if k != "preemptions"}
    engine = {"steps": steps, "preemptions": int(last["preemptions"]) if "preemptions" in last else None,
              "aborted_before_scheduled": None}
    return {"counters": counters, "counters_at": at, "engine": engine}


def join_subscriptions(attempts: list[AttemptRecord], subscriptions: dict) -> None:
    """Attempts that ended before the response headers came get their
    execution from the proxy's table of subscriptions."""
    for a in attempts:
        if a.execution < 0 and (sub := subscriptions.get((str(a.call), a.number))) is not None:
            a.execution, a.attached = sub


def executions_at_end(executions: list, streams: dict, end: float) -> None:
    """The execution records as they stood at `end`: what the run's own end
    did (closing the attempts still open) is not part of the run; one still
    live has the tokens streamed so far."""
    nan = float("nan")
    for r in executions:
        if r.orphaned_at > end:
            r.orphaned_at = nan
        if r.finished_at > end:
            r.fate, r.finished_at = "", nan
        if r.cancel_requested_at > end:
            r.cancel_requested_at = nan
        if not r.fate:                      # still live at the end: the tokens streamed so far
            st_ = streams.get(r.id)
            if st_ is not None:
                r.tokens_generated = st_.tokens
