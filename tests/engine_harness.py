"""A tiny driver for engine-only scenarios: requests added and aborted at
given times, every step taking `step_s` seconds unless a model is given."""
from __future__ import annotations

from sim.clock import Clock
from sim.engine.core import EngineConfig, EngineCore
from sim.engine.request import Request
from sim.engine.scheduler import SchedulerConfig
from sim.engine.step_time import StepTimeModel
from sim.runlog import ExecutionRecord


class Harness:
    def __init__(self, num_gpu_blocks=100, block_size=4, budget=8, max_num_seqs=16, depth=1,
                 step_s=1.0, model=None, max_queued=None, fast_forward=True, kv_policy="on-demand",
                 abort_latency="v1", leak_blocks_on_abort=False, stalls=(), abort_bound=False,
                 scheduling_policy="fcfs", frontend_s=0.0):
        self.env = Clock()
        model = model or StepTimeModel(step_s, 0.0, 0.0, 0.0, 0.0)
        cfg = EngineConfig(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                           num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                                           kv_policy=kv_policy, scheduling_policy=scheduling_policy),
                           depth=depth, max_queued=max_queued, abort_latency=abort_latency,
                           leak_blocks_on_abort=leak_blocks_on_abort, stalls=stalls, frontend_s=frontend_s)
        self.timers = []
        self.abort_timers = []
        # abort_bound: the engine is told when the next abort comes (else any input bounds a fast-forward)
        self.engine = EngineCore(self.env, cfg, model, next_input_time=self._next_input,
                                 fast_forward=fast_forward, next_abort_time=self._next_abort if abort_bound else None)
        self.sched = self.engine.scheduler
        self.requests = {}
        self.refused = []

    def _next_input(self):
        future = [t for t in self.timers + self.abort_timers if t >= self.env.now]
        return min(future) if future else float("inf")

    def _next_abort(self):
        future = [t for t in self.abort_timers if t >= self.env.now]
        return min(future) if future else float("inf")

    def _at(self, t, fn, timers=None):
        timers = self.timers if timers is None else timers
        timers.append(t)
        ev = self.env.timeout(t - self.env.now)
        ev.callbacks.append(lambda _e: (timers.remove(t), fn()))

    def add(self, t, rid, prompt, max_tokens, call=None, prefix=0, stop_at=None, priority=0):
        rec = ExecutionRecord(id=rid, call=rid if call is None else call, attempt=0, prompt_len=prompt,
                              max_tokens=max_tokens, created_at=t)
        req = Request(rid, rec.call, prompt, max_tokens, prefix, record=rec, stop_at=stop_at, priority=priority)
        self.requests[rid] = req

        def go():
            if not self.engine.add_request(req, self.env.now):
                self.refused.append(rid)
        self._at(t, go)
        return rec

    def abort(self, t, rid):
        self._at(t, lambda: self.engine.abort_request(self.requests[rid], self.env.now), self.abort_timers)

    def run(self, until=1000.0):
        self.env.run(until=until)
        return self
