"""Open-loop load generator for a vLLM OpenAI server (asyncio + aiohttp).

Each call of a trace is sent at its planned time (relative to the run's start)
as its own task, whatever happened to earlier calls: no retries, no
concurrency limit. A call is a streamed `/v1/completions` request whose prompt
is a list of token ids (the shared prefix, then the call's own random ids),
with `max_tokens` and `ignore_eos` fixing the response length. The client
gives a call up `deadline_s` after sending it and closes its connection (vLLM
then aborts the request). A sampler reads the engine's `/metrics` every
second (`vllm:num_requests_waiting`, `vllm:num_requests_running`).
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from .engine import parse_metrics
from .tokenizer import word

VOCAB_LO, VOCAB_HI = 3, 8000     # the tiny model's vocabulary is 8192 ids; 0-2 are specials
LINGERING: set[asyncio.Task] = set()   # attempts cut at their deadline that have not ended yet
STRAGGLERS_S = 600.0     # retry_storm: how long past its calls' due end it waits for those a starved machine delays


async def cut_at(coro, timeout_s: float):
    """Await `coro` (an HTTP attempt) for at most `timeout_s` s, as an HTTP
    client's timeout does: at the deadline its task is cancelled (which closes
    its connection) and TimeoutError raised at once, whether or not the task
    has ended. Under a retry storm on two cores, attempts awaited inside
    `asyncio.timeout` ran on long past it (a cancellation lost within the HTTP
    library), so a client held its call well past its deadline; here the
    caller goes on regardless, and a task still running is kept in
    LINGERING until it ends (counted by `retry_storm`)."""
    task = asyncio.ensure_future(coro)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(0.0, timeout_s))
    except asyncio.CancelledError:
        task.cancel()
        raise
    if done:
        return task.result()
    task.cancel()
    LINGERING.add(task)
    task.add_done_callback(LINGERING.discard)
    raise TimeoutError


class TracePrompts:
    """Token-id prompts for a trace, made when a call is sent (a trace of
    thousands of 1,000-token prompts would not be held in memory): the same
    `shared_prefix` ids first (generator seeded with `seed`), then call i's
    own ids (generator seeded with (seed, i)), so every call's prompt is fixed
    by the seed whatever order calls are made in."""

    def __init__(self, prompt_len: np.ndarray, shared_prefix: int, seed: int):
        self.prompt_len, self.seed = np.asarray(prompt_len), seed
        self.prefix = np.random.default_rng(seed).integers(VOCAB_LO, VOCAB_HI, shared_prefix).tolist()

    def __len__(self) -> int:
        return len(self.prompt_len)

    def __getitem__(self, i: int) -> list[int]:
        n = max(0, int(self.prompt_len[i]) - len(self.prefix))
        return self.prefix + np.random.default_rng((self.seed, i)).integers(VOCAB_LO, VOCAB_HI, n).tolist()


class TextPrompts(TracePrompts):
    """The same prompts as text, each token id its word of the tiny model's
    word-level tokenizer (`validate.tokenizer`), for an engine that loads it:
    the server tokenizes them back to the same ids, as it does the load
    testers' text prompts."""

    def __getitem__(self, i: int) -> str:
        return " ".join(map(word, super().__getitem__(i)))


def request_body(model: str, prompt: list[int] | str, max_tokens: int) -> dict:
    """A call's streamed /v1/completions request: token-id (or text) prompt, a fixed
    response length (end-of-sequence ignored), greedy, usage in the stream."""
    return {"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class CallRecord:
    index: int
    planned: float                     # planned send time (s from the run's start)
    sent: float | None = None          # actual send time
    first_token: float | None = None
    end: float | None = None
    tokens: int = 0                    # streamed tokens (usage when given)
    status: int | None = None
    outcome: str = "pending"           # ok | deadline | http_error | error | cancelled

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class LoadGen:
    """Replays `arrival` (s) with `prompts` and `max_tokens` against `url`."""
    url: str
    model: str
    arrival: np.ndarray
    prompts: list
    max_tokens: np.ndarray
    deadline_s: float = 120.0
    sample_every_s: float = 1.0
    records: list[CallRecord] = field(default_factory=list)
    samples: list[tuple[float, float, float]] = field(default_factory=list)   # (t, waiting, running)
    t0: float = 0.0
    metrics_url: str | None = None     # where the engine's gauges are read (default: url)

    def now(self) -> float:
        return time.monotonic() - self.t0

    async def _stream(self, session: aiohttp.ClientSession, rec: CallRecord, body: dict) -> str:
        """One call's request, its stream read to [DONE] into `rec`; returns
        its outcome (`_call` records it: a task cut at its deadline and still
        running writes none)."""
        async with session.post(self.url + "/v1/completions", json=body) as resp:
            rec.status = resp.status
            if resp.status != 200:
                await resp.read()
                return "http_error"
            async for line in resp.content:
                if rec.end is not None:       # cut at its deadline: the record is closed
                    return "deadline"
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                d = json.loads(data)
                if d.get("choices"):
                    if rec.first_token is None:
                        rec.first_token = self.now()
                    rec.tokens += 1
                if d.get("usage"):
                    rec.tokens = d["usage"].get("completion_tokens", rec.tokens)
            return "ok"

    async def _call(self, session: aiohttp.ClientSession, rec: CallRecord) -> None:
        body = request_body(self.model, self.prompts[rec.index], self.max_tokens[rec.index])
        rec.sent = self.now()
        try:
            rec.outcome = await cut_at(self._stream(session, rec, body), self.deadline_s)
        except TimeoutError:
            rec.outcome = "deadline"
        except asyncio.CancelledError:
            rec.outcome = "cancelled"
            raise
        except (aiohttp.ClientError, ValueError) as e:
            rec.outcome = f"error: {type(e).__name__}"
        finally:
            rec.end = self.now()

    async def _sampler(self, session: aiohttp.ClientSession) -> None:
        k = 0
        while True:
            await asyncio.sleep(max(0.0, k * self.sample_every_s - self.now()))
            t = self.now()
            try:
                async with session.get((self.metrics_url or self.url) + "/metrics") as r:
                    m = parse_metrics(await r.text())
                self.samples.append((t, m.get("vllm:num_requests_waiting", 0.0),
                                     m.get("vllm:num_requests_running", 0.0)))
            except (aiohttp.ClientError, TimeoutError):
                pass
            k += 1

    async def _dispatch(self, session: aiohttp.ClientSession, tasks: list) -> None:
        for i, t in enumerate(self.arrival):
            delay = float(t) - self.now()
            if delay > 0:
                await asyncio.sleep(delay)
            rec = CallRecord(i, float(t))
            self.records.append(rec)
            tasks.append(asyncio.create_task(self._call(session, rec)))

    async def run(self, until=None, stage_hook=None) -> None:
        """Send the trace. `stage_hook` (async, optional) is awaited
        concurrently; when it returns True (or at `until` s, or when every
        call has ended) the run stops: unsent calls are never sent and calls
        in flight are cancelled, closing their connections."""
        conn = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
            self.t0 = time.monotonic()
            tasks: list[asyncio.Task] = []
            sampler = asyncio.create_task(self._sampler(session))
            dispatcher = asyncio.create_task(self._dispatch(session, tasks))
            waiters = [dispatcher]
            if stage_hook is not None:
                waiters.append(asyncio.create_task(stage_hook(self)))
            try:
                deadline = None if until is None else max(0.0, until - self.now())
                done, _ = await asyncio.wait(waiters, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
                if dispatcher in done and len(waiters) == 1:
                    rest = [t for t in tasks if not t.done()]
                    if rest:
                        left = None if until is None else max(0.0, until - self.now())
                        await asyncio.wait(rest, timeout=left)
                elif dispatcher in done:              # trace sent: wait for the hook
                    left = None if until is None else max(0.0, until - self.now())
                    await asyncio.wait(waiters[1:], timeout=left)
                for w in waiters:
                    if not w.done():
                        w.cancel()
                    else:
                        w.result()
            finally:
                for t in [sampler, dispatcher, *waiters, *tasks]:
                    if not t.done():
                        t.cancel()
                await asyncio.gather(sampler, dispatcher, *waiters, *tasks, return_exceptions=True)

    def sent_between(self, a: float, b: float) -> int:
        return sum(1 for r in self.records if r.sent is not None and a <= r.sent < b)

    def queue_between(self, a: float, b: float) -> tuple[np.ndarray, np.ndarray]:
        s = [(t, w) for t, w, _ in self.samples if a <= t < b]
        return np.array([t for t, _ in s], dtype=float), np.array([w for _, w in s], dtype=float)

    def outcomes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r.outcome] = out.get(r.outcome, 0) + 1
        return out


# ------------------------------------------------------------- retry storm
async def retry_storm(url: str, model: str, rate: float, duration_s: float, max_calls: int, deadline_s: float,
                      retries: int, retry_wait_s: float, prompt_len: int, max_tokens: int, seed: int = 0) -> dict:
    """A retry storm against a proxy (or engine) at `url`: call i is sent at
    i / rate s (open loop, at most `max_calls`, within `duration_s`), as
    attempts carrying `X-Call-Id: storm-i` and `X-Attempt`; each attempt is cut
    at `deadline_s` and retried after `retry_wait_s`, `retries` times, then the
    call gives up. Bounded in calls and time: on a machine that keeps up
    everything ends within duration_s + (retries + 1) x (deadline_s +
    retry_wait_s); every call ends by itself (its attempts are cut), so the
    generator waits for them `STRAGGLERS_S` more before it counts a call
    unfinished (a starved generator ends its calls late, not never: a CI
    run's first storm had 275 of 300 calls still going 30 s past that time).
    Returns counts of attempts by outcome."""
    counts: dict[str, int] = {}

    def count(k: str) -> None:
        counts[k] = counts.get(k, 0) + 1

    rng = np.random.default_rng(seed)
    n = min(max_calls, int(rate * duration_s))
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10)) as s:
        async def call(i: int) -> None:
            body = request_body(model, rng.integers(VOCAB_LO, VOCAB_HI, prompt_len).tolist(), max_tokens)
            async def attempt(k: int) -> bool:
                """Whether the stream ended with its `[DONE]` (else it was cut short: counted "truncated")."""
                async with s.post(url + "/v1/completions", json=body,
                                  headers={"X-Call-Id": f"storm-{i}", "X-Attempt": str(k)}) as r:
                    count(f"status_{r.status}")
                    last = b""
                    async for line in r.content:
                        last = line.strip() or last
                    return last == b"data: [DONE]"

            for k in range(retries + 1):
                count("attempts")
                try:
                    count("complete" if await cut_at(attempt(k), deadline_s) else "truncated")
                    return
                except TimeoutError:
                    count("timeout")
                except aiohttp.ClientError:
                    count("error")
                await asyncio.sleep(retry_wait_s)
            count("gave_up")

        loop = asyncio.get_running_loop()
        t0 = loop.time()
        tasks = []
        for i in range(n):
            await asyncio.sleep(max(0.0, t0 + i / rate - loop.time()))
            tasks.append(asyncio.create_task(call(i)))
        bound = duration_s + (retries + 1) * (deadline_s + retry_wait_s) + STRAGGLERS_S
        done, pending = await asyncio.wait(tasks, timeout=max(1.0, t0 + bound - loop.time()))
        for t in pending:
            t.cancel()
        counts["calls"] = n
        counts["unfinished"] = len(pending)
        counts["attempts_lingering"] = len(LINGERING)    # cut at their deadline, not yet ended
        for t in list(LINGERING):
            t.cancel()
    return counts


if __name__ == "__main__":
    import argparse
    import sys
    ap = argparse.ArgumentParser(prog="python -m validate.loadgen", description="a bounded retry storm (JSON out)")
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", required=True)
    for flag, kind, default in (("--rate", float, 20.0), ("--duration", float, 15.0), ("--max-calls", int, 1000),
                                ("--deadline", float, 0.3), ("--retries", int, 3), ("--retry-wait", float, 0.1),
                                ("--prompt-len", int, 64), ("--max-tokens", int, 300), ("--seed", int, 0)):
        ap.add_argument(flag, type=kind, default=default)
    a = ap.parse_args()
    res = asyncio.run(retry_storm(a.url, a.model, a.rate, a.duration, a.max_calls, a.deadline, a.retries,
                                  a.retry_wait, a.prompt_len, a.max_tokens, a.seed))
    json.dump(res, sys.stdout)
    print()
