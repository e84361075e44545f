"""The engine's step loop in simulated time (vLLM's EngineCore with a batch
queue of `depth` steps: 2 under async scheduling on GPU, 1 on CPU).

At every step boundary, in this order: the finished step's output is
processed (tokens streamed, finished requests freed), then the arrivals and
aborts that came in during the step are applied, then steps are scheduled
until `depth` are in flight. So an abort that arrives during step k is applied
when step k ends; step k and (at depth 2) step k+1 still run with the request
in them — their prompt tokens are "in flight" — and it is gone from step k+2.

One SimPy event per scheduler output: the engine loop is a chain of
callbacks on the SimPy queue (`_loop` at the top of an iteration,
`_step_end` when the step in flight ends), not a SimPy process. A run of identical decode-only steps
with nothing able to change them (no request finishing, no block shortage,
admission blocked or nothing waiting, no input due before the last of them
would be scheduled) is one output, a fast-forward, its duration in closed
form, up to the horizon the driver gives (the contract in `sim.clock`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

from simpy.events import URGENT

from ..clock import Clock
from .request import ABORTED, FINISHED, RUNNING, WAITING_STATUSES, Request
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .step_time import StepTimeModel

INF = float("inf")
ABORT_LATENCIES = ("v1", "v0")


@dataclass(frozen=True)
class EngineConfig:
    scheduler: SchedulerConfig
    depth: int = 2                   # steps in flight (async scheduling on GPU: 2; CPU: 1)
    max_queued: int | None = None    # engine cap Q (vLLM --max-num-queued-reqs): refuse beyond it
    # when an abort takes effect: "v1" at the next step boundary; "v0" (the
    # V0 engine's RequestTracker) one full iteration later, so the request
    # still takes a seat in one more forward pass
    abort_latency: str = "v1"
    # fault injection, off by default. A KV block leak on abort: an aborted
    # running request's blocks never go back to the free pool (they stay
    # held, and hashed), so KV usage only climbs and admission stops once
    # the head no longer fits.
    leak_blocks_on_abort: bool = False
    # engine stalls (a long GC pause, a device hiccup): (T, S) pairs; the
    # engine does nothing in [T, T+S) — a step boundary that falls in it is
    # handled at T+S (outputs streamed, inputs applied, the next step
    # scheduled then); steps already queued on the device (depth 2) still run
    stalls: tuple = ()
    # the time a request spends in the server before it reaches the
    # scheduler (HTTP, tokenization, the hand-over to the engine core: vLLM's
    # API server), on every request's way in; its abort passes at once
    frontend_s: float = 0.0

    def __post_init__(self):
        if not (isinstance(self.frontend_s, (int, float)) and math.isfinite(self.frontend_s)
                and self.frontend_s >= 0):
            raise ValueError(f"frontend_s must be a finite number of seconds >= 0, got {self.frontend_s!r}")
        if self.abort_latency not in ABORT_LATENCIES:
            raise ValueError(f"abort_latency must be one of {', '.join(ABORT_LATENCIES)}, got {self.abort_latency!r}")
        stalls = []
        for item in self.stalls:
            try:
                start, length = (float(x) for x in item)
            except (TypeError, ValueError):
                raise ValueError(f"each stall must be a pair (start s, length s), got {item!r}") from None
            if not (math.isfinite(start) and math.isfinite(length) and start >= 0 and length > 0):
                raise ValueError(f"a stall needs a finite start >= 0 and a finite length > 0, got {item!r}")
            stalls.append((start, length))
        object.__setattr__(self, "stalls", tuple(sorted(stalls)))


class EngineCore:
    # the frontend (`Frontend`), an instance's own only where it has one: no attribute more for an engine
    # without (CPython keeps up to 30 of an instance's attributes inline; one more slows every attribute
    # read of the step loop, 2 % of a reference run's instructions)
    frontend = None

    def __init__(self, env: Clock, config: EngineConfig, step_model: StepTimeModel,
                 on_first_token: Callable[[Request, float], None] = None,
                 on_finished: Callable[[Request, float], None] = None,
                 next_input_time: Callable[[], float] = None,
                 fast_forward: bool = True,
                 next_abort_time: Callable[[], float] = None):
        if config.depth < 1:
            raise ValueError("depth must be at least 1")
        self.env = env
        self.config = config
        self.depth = config.depth
        self.step_model = step_model
        self.scheduler = Scheduler(config.scheduler, step_model, config.leak_blocks_on_abort)
        self.on_first_token = on_first_token or (lambda r, t: None)
        self.on_finished = on_finished or (lambda r, t: None)
        # the horizon (the contract in sim.clock): no input before
        # next_input_time(), no abort before next_abort_time() (by default,
        # no input); a fast-forward whose admission is blocked runs up to the
        # latter, requests added meanwhile applied at its end as of the
        # boundaries they came in before (`_apply_adds_during`)
        self.next_input_time = next_input_time or (lambda: INF)
        self.next_abort_time = next_abort_time or self.next_input_time
        self.fast_forward = fast_forward
        self.pending: deque[SchedulerOutput] = deque()
        self.inbox: list[tuple[str, Request]] = []
        self._inbox_prompt_tokens = 0        # prompt tokens of the requests added to the inbox
        self._inbox_adds = 0                 # and how many they are
        self._scheduled_uncomputed = None    # uncomputed prompt tokens in the scheduler (None: to count)
        self.processed = -1          # index of the last step whose output was processed
        self.now = 0.0               # the engine's own clock: end of the last processed step
        self._idle = False           # the loop waits for an input (`_poke` resumes it)
        self._ending = None          # the output whose step ended during a stall
        self.gauge_log: list[tuple[float, int, int]] = []   # (t, waiting, running) at changes
        self.aborted_before_scheduled = 0
        self.busy_s = 0.0            # duration of every step scheduled so far
        self.steps_done = 0          # steps whose output has been processed
        self.busy_done = 0.0         # and their duration
        self.num_step_events = 0     # SimPy-level step events (a fast-forward counts once)
        self._deferred: list[Request] = []   # v0: aborts that wait one more iteration
        self.gap_log: list[tuple[float, int]] = []   # reserve policy: (t, reserved - used blocks) at changes
        self.stalls = config.stalls
        self._next_stall = 0         # index of the first stall not yet begun at a boundary
        if config.frontend_s > 0:               # the paths with a frontend; without one, the plain methods
            self.frontend = Frontend(config.frontend_s, self.next_input_time)
            self.add_request, self.abort_request = self._add_via_frontend, self._abort_via_frontend
            self.num_in_engine, self.next_input_time = self._num_in_engine_frontend, self._next_input_frontend
            self.uncomputed_prompt_tokens = self._uncomputed_frontend
        if config.abort_latency == "v0":
            self._apply_inbox = self._apply_inbox_v0
        if config.scheduler.kv_policy == "reserve":
            self._log_gauges = self._log_gauges_gap
        env.call_later(0.0, self._loop, URGENT)         # where a SimPy process would start

    # ------------------------------------------------------------- inputs
    def num_in_engine(self) -> int:
        s = self.scheduler
        return s.num_waiting + len(s.running) + self._inbox_adds

    def uncomputed_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed of the requests waiting or running,
        or on their way in. The scheduler's part is counted once between
        step boundaries (it changes only there), not at every call."""
        tok = self._scheduled_uncomputed
        if tok is None:
            s = self.scheduler
            tok = 0
            for r in s.waiting:
                if r.status in WAITING_STATUSES:
                    tok += r.num_prompt_tokens - min(r.num_prompt_tokens, r.num_computed_tokens)
            for r in s.prefilling:
                tok += max(0, r.num_prompt_tokens - r.num_computed_tokens)
            self._scheduled_uncomputed = tok
        return tok + self._inbox_prompt_tokens

    def add_request(self, r: Request, now: float) -> bool:
        """An execution arrives at `now` (the clock's time, given by the
        caller: no read of the clock's property a request); False if the
        engine cap refuses it (503)."""
        # `_admits` inlined: one call fewer an execution (0.3 % of a reference run's instructions)
        q = self.config.max_queued
        if q is not None and self.num_in_engine() + 1 > q:
            return False
        if r.num_prompt_tokens + r.max_tokens > self.config.scheduler.max_model_len:
            raise self._too_long(r)
        r.arrival_time = now
        self.inbox.append(("add", r))
        self._inbox_prompt_tokens += r.num_prompt_tokens
        self._inbox_adds += 1
        if self._idle:          # checked here, not in _poke: no call while the engine is awake (most inputs)
            self._poke()
        return True

    def _admits(self, r: Request) -> bool:
        """False if the engine cap refuses r; ValueError if it can never fit."""
        q = self.config.max_queued
        if q is not None and self.num_in_engine() + 1 > q:
            return False
        if r.num_prompt_tokens + r.max_tokens > self.config.scheduler.max_model_len:
            raise self._too_long(r)
        return True

    def _too_long(self, r: Request) -> ValueError:
        mx = self.config.scheduler.max_model_len
        return ValueError(f"request of {r.num_prompt_tokens}+{r.max_tokens} tokens exceeds max_model_len {mx}")

    def abort_request(self, r: Request, now: float) -> None:
        """The abort of a request arrives at `now` (the clock's time)."""
        if r.abort_seen < 0:     # last step whose output was streamed when the abort came
            r.abort_seen = self.work_by(now)[0] - 1
        self.inbox.append(("abort", r))
        if self._idle:
            self._poke()

    # ------------------------------------------------------------ the frontend
    def _add_via_frontend(self, r: Request, now: float) -> bool:
        """`add_request` with a frontend: the engine cap answers at once; the
        request reaches the scheduler `frontend_s` later (`Frontend`)."""
        if not self._admits(r):
            return False
        ready = self.frontend.add(r, now)
        if self._idle:
            self.env.call_later(ready - now, self._frontend_due)
        return True

    def _abort_via_frontend(self, r: Request, now: float) -> None:
        """`abort_request` with a frontend: a request still in it never
        reaches the scheduler (aborted there, before any step)."""
        if r.arrival_time <= now:               # it reached the scheduler's side: in order, before its abort
            self._take_from_frontend(now)
        elif self.frontend.drop(r):
            rec = r.record
            r.status = ABORTED
            if rec is not None:
                rec.fate, rec.finished_at, rec.tokens_generated, rec.prompt_in_flight = "aborted", now, 0, 0
            self.aborted_before_scheduled += 1
            return
        EngineCore.abort_request(self, r, now)

    def _frontend_due(self, _event=None) -> None:
        """The head of the frontend reaches an idle engine."""
        if self._idle:
            self._idle = False
            self._loop()

    def _take_from_frontend(self, t: float) -> None:
        """The requests whose frontend time is over by t join the inbox, as
        `add_request` would have put them there at their arrival."""
        for r in self.frontend.due(t):
            self.inbox.append(("add", r))
            self._inbox_prompt_tokens += r.num_prompt_tokens
            self._inbox_adds += 1

    def _num_in_engine_frontend(self) -> int:
        return EngineCore.num_in_engine(self) + len(self.frontend)

    def _uncomputed_frontend(self) -> int:
        return EngineCore.uncomputed_prompt_tokens(self) + self.frontend.prompt_tokens

    def _next_input_frontend(self) -> float:
        """The driver's next input, or the frontend's next request if sooner."""
        fe = self.frontend
        return min(fe.driver_next_input(), fe.next_ready())

    def _poke(self) -> None:
        """An input came to the idle engine: its loop resumes now (the callers check `_idle`)."""
        self._idle = False
        self.env.call_later(0.0, self._loop)

    # ---------------------------------------------------------------- loop
    def _loop(self, _event=None) -> None:
        """The top of the loop: with no step in flight, apply the inputs and
        schedule; then wait for the end of the first step in flight (or,
        idle, for an input)."""
        env = self.env
        if self.stalls and self._wait_out_stall(self._loop):
            return
        if not self.pending:
            self.now = env.now
            if self.frontend is not None:
                self._take_from_frontend(self.now)
            self._apply_inbox(idle=True)
            self._fill()
            self._log_gauges()
            if not self.pending:
                self._idle = True
                if self.frontend is not None and self.frontend:
                    env.call_later(self.frontend.next_ready() - env.now, self._frontend_due)
                return
        env.call_when(self.pending[0].end, self._step_end)

    def _step_end(self, _event) -> None:
        """The first step in flight ended: a step boundary."""
        output = self.pending.popleft()
        self.now = output.end
        if self.stalls:
            self._ending = output
            self._step_end_in_stall()
            return
        self._boundary(output)
        pending = self.pending
        if pending:                     # as _loop() with a step in flight
            self.env.call_when(pending[0].end, self._step_end)
        else:
            self._loop()

    def _step_end_in_stall(self, _event=None) -> None:
        if self._wait_out_stall(self._step_end_in_stall):
            return
        output = self._ending
        self.now = max(output.end, self.env.now)     # outputs of steps that ended in a stall
        self._boundary(output)
        self._loop()

    def _boundary(self, output: SchedulerOutput) -> None:
        """A step boundary (module docstring): the ended step's output
        processed, the inputs that came in during it applied, steps
        scheduled, the gauges logged."""
        if self.frontend is not None:
            self._take_from_frontend(self.now)
        if output.admission_blocked and self.inbox:
            self._apply_adds_during(output)
        self._process(output)
        if self.inbox or self._deferred:    # (no call when nothing came in: 2 boundaries in 5 of a fleet run)
            self._apply_inbox()
        self._fill()
        self._log_gauges()

    def _wait_out_stall(self, then) -> bool:
        """At a boundary that falls in a stall, call `then` at its end (True)."""
        env = self.env
        while self._next_stall < len(self.stalls):
            start, length = self.stalls[self._next_stall]
            if env.now < start:
                return False
            self._next_stall += 1
            if env.now < start + length:
                env.call_later(start + length - env.now, then)
                return True
        return False

    def _fill(self) -> None:
        self._scheduled_uncomputed = None
        sched = self.scheduler
        limit = self._fast_forward_limit if self.fast_forward else None
        depth = self.depth
        while len(self.pending) < depth:
            output = sched.schedule(limit, depth - 1)
            if output is None:
                return
            self._launch(output)
            if output.num_steps > 1:
                # the last depth-1 steps of a fast-forward stay single steps,
                # so the output after it is scheduled at the boundary it would
                # be when stepping one step at a time
                for _ in range(self.depth - 1):
                    self._launch(sched.schedule(None))

    def _launch(self, output: SchedulerOutput) -> None:
        start = self.pending[-1].end if self.pending else self.now
        if self.stalls and start < self.now:
            start = self.now        # the step queued before it ended during a stall
        if output.num_steps == 1:
            dur = self.step_model.duration(output.num_reqs, output.total_num_scheduled_tokens,
                                           output.prefill_pairs, output.decode_context)
        else:
            dur = self.step_model.fast_forward_duration(output.num_decode_reqs, output.decode_context,
                                                        output.num_steps)
        output.start = start
        output.end = start + dur
        self.busy_s += dur
        self.num_step_events += 1
        for r, _, _ in output.prefill_chunks:
            rec = r.record
            if rec is not None and rec.first_scheduled_at != rec.first_scheduled_at:
                rec.first_scheduled_at = start
        self.pending.append(output)

    def _fast_forward_limit(self, output: SchedulerOutput) -> int:
        """How many identical decode steps, from the step being scheduled
        (`output.first_step`, its first one described by `output`), may be
        decided now. When stepping one at a time, step first+i is scheduled
        at the end of step first+i-depth with every input that arrived before
        then applied, so m steps may be decided now iff no input is due before
        the end of step first+m-1-depth."""
        pending = self.pending
        if self.inbox or self._deferred:
            return 1
        for p in pending:
            if p.num_steps > 1:
                return 1
            if p.finishing and self.scheduler.num_waiting:
                return 1    # freed blocks may admit the head before the fast-forward ends
        # while admission is blocked, requests added change none of the
        # steps: only an abort can
        t_in = self.next_abort_time() if output.admission_blocked else self.next_input_time()
        if self._next_stall < len(self.stalls):
            t_in = min(t_in, self.stalls[self._next_stall][0])     # a stall is an input: it moves boundaries
        if t_in == INF:
            return 1 << 30
        depth = self.depth
        model = self.step_model
        processed = self.processed
        start = pending[-1].end if pending else self.now
        if self.stalls and start < self.now:
            start = self.now
        first = output.first_step
        num_decode = output.num_decode_reqs
        context = output.decode_context

        def end_of(step: int) -> float:
            if step <= processed:
                return -INF
            if step < first:
                return pending[step - processed - 1].end
            return start + model.fast_forward_duration(num_decode, context, step - first + 1)

        # done: how many steps from `first` end before t_in
        done = model.fast_forward_steps_before(num_decode, context, start, t_in)
        if done >= 1 << 30:
            return 1 << 30
        if done > 0:
            return done + depth           # first+m-1-depth = first+done-1
        num_steps = depth
        while num_steps > 1 and end_of(first + num_steps - 1 - depth) >= t_in:
            num_steps -= 1
        return num_steps

    # -------------------------------------------------------------- output
    def _process(self, output: SchedulerOutput) -> None:
        self._scheduled_uncomputed = None
        sched = self.scheduler
        t = self.now
        self.processed = output.last
        self.steps_done += output.num_steps
        self.busy_done += output.end - output.start
        for r in output.first_outputs:
            if r.status == ABORTED or r.status == FINISHED:
                continue
            r.outputs_done += 1
            if not r.first_output_done:
                r.first_output_done = True
                sched.counters["prompt_tokens_total"] += r.num_prompt_tokens
                if r.record is not None:
                    r.record.first_token_at = t
                self.on_first_token(r, t)
        for r in output.finishing:
            if r.status != RUNNING and r.status not in WAITING_STATUSES:
                continue        # aborted; a preempted one still finishes with this output
            sched.finish(r, output.last)
            if r.record is not None:
                r.record.tokens_generated = r.outputs_done
                r.record.finished_at = t
                r.record.fate = "completed"
            self.on_finished(r, t)

    def work_by(self, t: float) -> tuple[int, float]:
        """Steps finished and busy time by time t, the step running at t
        counted for its part (the same whether or not decode steps are
        fast-forwarded)."""
        steps, busy = self.steps_done, self.busy_done
        te = t + 1e-9                   # a step ending at t, up to rounding, counts
        for p in self.pending:
            if p.start >= t:
                break
            if p.end <= te:
                steps += p.num_steps
                busy += p.end - p.start
                continue
            busy += t - p.start
            if p.num_steps > 1:         # whole steps of the fast-forward done by t
                done = 0
                while done + 1 < p.num_steps and p.start + self.step_model.fast_forward_duration(
                        p.num_decode_reqs, p.decode_context, done + 1) <= te:
                    done += 1
                steps += done
            break
        return steps, busy

    def _apply_adds_during(self, output: SchedulerOutput) -> None:
        """At the end of a fast-forward whose admission was blocked, before
        its output is processed, the requests added during its steps but its
        last join the waiting queue as stepping one step at a time would have
        them join: each at the end of the step it came in during, the gauges
        logged there. (They change none of the steps; only their queue
        position and the gauge log's times depend on it.)"""
        items = self.inbox
        model = self.step_model
        n, ctx, start, last = output.num_decode_reqs, output.decode_context, output.start, output.num_steps
        sched = self.scheduler
        now = self.now
        k = 0
        while k < len(items):
            kind, r = items[k]
            if kind != "add":
                break                   # an abort comes in during the last step only (next_abort_time)
            # the step it came in during: the first to end at or after its arrival
            i = model.fast_forward_steps_before(n, ctx, start, r.arrival_time) + 1
            if i >= last:
                break                   # during the last step: applied at this boundary
            boundary = start + model.fast_forward_duration(n, ctx, i)
            while k < len(items) and items[k][0] == "add" and items[k][1].arrival_time <= boundary:
                r = items[k][1]
                sched.add_request(r)
                self._inbox_prompt_tokens -= r.num_prompt_tokens
                self._inbox_adds -= 1
                k += 1
            self.now = boundary
            self._log_gauges()
        self.now = now
        self._scheduled_uncomputed = None
        del items[:k]

    def _apply_inbox_v0(self, idle: bool = False) -> None:
        """V0 abort latency: an abort that came in during this iteration is
        applied at the end of the next one; with no step running (idle) there
        is no iteration to wait for."""
        late, self._deferred = self._deferred, []
        fresh = []
        for item in self.inbox:
            if item[0] == "abort" and not idle:
                self._deferred.append(item[1])
            else:
                fresh.append(item)
        self.inbox = [("abort", r) for r in late] + fresh
        EngineCore._apply_inbox(self)

    def _apply_inbox(self, idle: bool = False) -> None:
        if not self.inbox:
            return
        sched = self.scheduler
        items, self.inbox = self.inbox, []
        self._inbox_prompt_tokens = 0
        self._inbox_adds = 0
        self._scheduled_uncomputed = None
        for kind, r in items:
            if kind == "add":
                sched.add_request(r)
            else:
                was_waiting = r.status in WAITING_STATUSES
                r.outputs_seen = sched.outputs_through(r, r.abort_seen)
                if not sched.abort(r, self.processed):
                    continue
                rec = r.record
                if rec is not None:
                    rec.fate = "aborted"
                    rec.finished_at = self.now
                    rec.tokens_generated = r.outputs_done
                    # prompt work of steps that finished after the abort arrived
                    first = self.processed if self.config.abort_latency == "v1" else r.abort_seen + 1
                    in_flight = 0
                    for s, q in r.chunks:
                        if s >= first:
                            in_flight += q
                    rec.prompt_in_flight = in_flight
                if was_waiting and not r.chunks:
                    self.aborted_before_scheduled += 1

    def _log_gauges_gap(self) -> None:
        EngineCore._log_gauges(self)
        g = self.scheduler.reservation_gap(self.scheduler.next_step - 1)
        if not self.gap_log or self.gap_log[-1][1] != g:
            self.gap_log.append((self.now, g))

    def _log_gauges(self) -> None:
        s = self.scheduler
        waiting, running = s.num_waiting, len(s.running)
        log = self.gauge_log
        if not log or log[-1][1] != waiting or log[-1][2] != running:
            log.append((self.now, waiting, running))


class Frontend:
    """The requests on their way through the server to the scheduler, in
    order: each reaches it `delay_s` after it came in (one constant: first
    in, first out), at its `arrival_time`."""

    def __init__(self, delay_s: float, driver_next_input: Callable[[], float]):
        self.delay_s = delay_s
        self.driver_next_input = driver_next_input      # the engine's next input from the driver
        self.queue: deque[Request] = deque()
        self.prompt_tokens = 0

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, r: Request, now: float) -> float:
        """r comes in at now: the time it reaches the scheduler (its arrival_time)."""
        r.arrival_time = now + self.delay_s
        self.queue.append(r)
        self.prompt_tokens += r.num_prompt_tokens
        return r.arrival_time

    def drop(self, r: Request) -> bool:
        """Take r out if it is still here."""
        try:
            self.queue.remove(r)
        except ValueError:
            return False
        self.prompt_tokens -= r.num_prompt_tokens
        return True

    def due(self, t: float) -> list[Request]:
        """Take out the requests that reach the scheduler by t."""
        out = []
        queue = self.queue
        while queue and queue[0].arrival_time <= t:
            r = queue.popleft()
            self.prompt_tokens -= r.num_prompt_tokens
            out.append(r)
        return out

    def next_ready(self) -> float:
        return self.queue[0].arrival_time if self.queue else INF
