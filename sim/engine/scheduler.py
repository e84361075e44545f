"""vLLM V1's scheduler (`v1/core/sched/scheduler.py`), one decision per step.

`schedule()` is the whole algorithm:
  1. running requests, in admission order, take their tokens from the step's
     token budget — a decoding request 1, a request still in prefill
     min(remaining, budget) (chunked prefill); a request that needs a KV
     block when none is free preempts the most recently admitted running
     request, which goes back to the front of the waiting queue;
  2. unless this step preempted, waiting requests are admitted from the head
     while budget and seats remain; a request is admitted only if its whole
     remaining prompt fits in free blocks after its prefix-cache hit, and a
     head that does not fit stops admission (head-of-line blocking).

Decoding requests form a *decode group*: their progress is a function of the
step index (one token per step), kept in aggregate — a count, a context sum,
and how many of them need a new block at each step modulo the block size — so
a decode step touches no request. `Request` fields of a group member are
brought up to date by `sync()` whenever a member leaves the group.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from .block_pool import BlockPool, Extent, call_space, exec_space, prefix_space
from .request import Request, WAITING, RUNNING, FINISHED, ABORTED
from .step_time import StepTimeModel


KV_POLICIES = ("on-demand", "reserve")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    num_gpu_blocks: int = 60_000
    block_size: int = 16
    max_model_len: int = 32_768
    # KV allocation: "on-demand" (vLLM V1: blocks as tokens are scheduled) or
    # "reserve" (blocks for prompt + max_tokens set aside at admission; the
    # whole reservation must fit; what is unused goes back at finish or abort)
    kv_policy: str = "on-demand"

    def __post_init__(self):
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")


class StepPlan:
    """What one scheduler decision sends to the forward pass. A plan with
    count > 1 is a run of identical decode-only steps advanced in closed form."""
    __slots__ = ("index", "count", "start", "end", "ctx0", "num_reqs", "num_tokens", "n_decode",
                 "prefill", "first_outputs", "finishing")

    def __init__(self, index: int):
        self.index = index          # index of the (first) step
        self.count = 1
        self.start = self.end = 0.0
        self.ctx0 = 0.0             # decode context sum of the (first) step
        self.num_reqs = 0
        self.num_tokens = 0
        self.n_decode = 0
        self.prefill = []           # (request, tokens, context before)
        self.first_outputs = []     # requests whose prefill completes: they emit a token
        self.finishing = []         # requests whose last token is in the (last) step

    @property
    def last(self) -> int:
        return self.index + self.count - 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, step_model: StepTimeModel):
        self.config = config
        self.step_model = step_model
        self.block_size = bs = config.block_size
        self.pool = BlockPool(config.num_gpu_blocks, bs)
        self.waiting: deque[Request] = deque()
        self.num_waiting = 0            # waiting requests not aborted (aborted ones leave lazily)
        self.running: list[Request] = []       # admission order
        self.prefilling: list[Request] = []    # running requests still in prefill, admission order
        self.next_step = 0              # index of the next step to schedule
        # decode group
        self.n_dec = 0
        self.dec_base = 0               # sum over members of (c0 - dec_start)
        self.block_phase = [0] * bs     # members needing a new block at steps == phase (mod bs)
        self.finish_at: dict[int, list[Request]] = {}
        self.finish_heap: list[int] = []
        # counters, as vLLM defines them
        self.counters = {"prompt_tokens_total": 0, "prefix_cache_queries_total": 0,
                         "prefix_cache_hits_total": 0}
        self.num_preemptions = 0
        self.num_steps = 0
        self._blocked = None            # (head, pool.releases, chunks) when the head last did not fit
        self._num_chunks = 0            # prefill chunks scheduled so far
        self.reserve = config.kv_policy == "reserve"

    # ----------------------------------------------------------- decode group
    def _join(self, r: Request, start: int) -> None:
        """r's prefill completed in step start-1; it decodes from step `start`."""
        r.decoding = True
        r.stint = True
        r.dec_start = start
        r.c0 = r.num_computed_tokens
        r.out0 = r.num_output_tokens
        r.dec_last = start + (r.out_limit - r.out0) - 1
        r.phase = (start - r.c0) % self.block_size
        self.n_dec += 1
        self.dec_base += r.c0 - start
        self.block_phase[r.phase] += 1
        lst = self.finish_at.get(r.dec_last)
        if lst is None:
            self.finish_at[r.dec_last] = [r]
            heapq.heappush(self.finish_heap, r.dec_last)
        else:
            lst.append(r)
        for e in r.blocks:
            if e.owner is r and e.space != exec_space(r.request_id):
                e.owner = None          # complete: only the output blocks still grow
        top = r.blocks[-1] if r.blocks else None
        if top is None or top.space != exec_space(r.request_id) or top.owner is not r:
            b = r.c0 // self.block_size if r.c0 % self.block_size == 0 else -(-r.c0 // self.block_size)
            e = Extent(exec_space(r.request_id), b, b, r)
            e.holders.append(r)
            r.blocks.append(e)

    def sync(self, r: Request, through: int) -> None:
        """Bring a group member's fields up to date as of step `through`."""
        k = min(through, r.dec_last) - r.dec_start + 1
        if k < 0:
            k = 0
        r.num_computed_tokens = r.c0 + k
        r.num_output_tokens = r.out0 + k
        top = r.blocks[-1]
        top.hi = max(top.lo, -(-r.num_computed_tokens // self.block_size))

    def _leave(self, r: Request, through: int) -> None:
        """Take r out of the decode group, its last scheduled step being `through`."""
        self.sync(r, through)
        r.decoding = False
        self.n_dec -= 1
        self.dec_base -= r.c0 - r.dec_start
        self.block_phase[r.phase] -= 1
        lst = self.finish_at.get(r.dec_last)
        if lst is not None and r in lst and r.dec_last != through:
            lst.remove(r)

    def outputs_through(self, r: Request, through: int) -> int:
        """Outputs r has produced once steps up to `through` are processed."""
        if not r.stint:
            return r.outputs_done
        k = min(through, r.dec_last) - r.dec_start + 1
        return r.outputs_done + (k if k > 0 else 0)

    # --------------------------------------------------------------- blocks
    def _segments(self, r: Request, upto_blocks: int):
        bs = self.block_size
        npf = r.shared_prefix // bs
        npc = r.prompt_len // bs
        return ((prefix_space(r.prefix_group), 0, min(npf, upto_blocks)),
                (call_space(r.call_id), npf, min(npc, upto_blocks)),
                (exec_space(r.request_id), npc, upto_blocks))

    def _full_blocks(self, e: Extent) -> int:
        return e.owner.num_computed_tokens // self.block_size

    def _find_hit(self, r: Request):
        cap = (r.num_tokens - 1) // self.block_size
        pieces = []
        cur = 0
        for space, a, b in self._segments(r, cap):
            if a >= b:
                continue
            if cur < a:
                break
            got = self.pool.lookup(space, a, b, self._full_blocks)
            pieces.extend(got)
            cur = got[-1][2] if got else cur
            if cur < b:
                break
        return pieces, cur

    def _blocks_held(self, r: Request) -> int:
        return r.blocks[-1].hi if r.blocks else 0

    def _allocate(self, r: Request, upto_tokens: int) -> bool:
        """Give r blocks for its first `upto_tokens` tokens; False if not enough free."""
        bs = self.block_size
        target = -(-upto_tokens // bs)
        held = self._blocks_held(r)
        if target <= held:
            return True
        if target - held > self.pool.num_free:
            return False
        for space, a, b in self._segments(r, target):
            lo = max(a, held)
            if lo >= b:
                continue
            top = r.blocks[-1] if r.blocks else None
            if top is not None and top.space == space and top.owner is r and top.hi == lo:
                self.pool.grow(top, b)
            else:
                if top is not None and top.owner is r and top.space != space:
                    top.owner = None            # complete: the sequence moved past it
                r.blocks.append(self.pool.new_extent(space, lo, b, r))
            held = b
        return True

    def _free(self, r: Request) -> None:
        self.pool.release(r, r.num_computed_tokens // self.block_size)

    # -------------------------------------------------------- queue changes
    def add_request(self, r: Request) -> None:
        r.status = WAITING
        self.waiting.append(r)
        self.num_waiting += 1

    def finish(self, r: Request, through: int) -> None:
        """r produced its last token in step `through` (output processed).
        A request preempted after that step was scheduled has already given
        back its blocks and waits to be recomputed: it finishes all the same."""
        if r.decoding:
            self._leave(r, through)
        r.outputs_done = self.outputs_through(r, through)
        r.stint = False
        if r.status == WAITING:
            self.num_waiting -= 1           # leaves the waiting queue lazily
        else:
            self.running.remove(r)
            self._free(r)
        r.status = FINISHED

    def abort(self, r: Request, processed: int) -> bool:
        """Abort r at a step boundary; steps up to `processed` have had their
        output processed. Returns False if r had already left."""
        if r.status == WAITING:
            r.status = ABORTED
            self.num_waiting -= 1
            return True
        if r.status != RUNNING:
            return False
        if r.decoding:
            self._leave(r, self.next_step - 1)
        r.outputs_done = self.outputs_through(r, processed)
        r.stint = False
        r.status = ABORTED
        self.running.remove(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
        self._free(r)
        return True

    def _preempt(self, r: Request, step: int) -> None:
        """Preempt r while scheduling `step`: free its blocks, reset its
        progress, put it back at the front of the waiting queue."""
        if r.decoding:
            self._leave(r, step - 1)
        r.outputs_done = self.outputs_through(r, step - 1)
        r.stint = False
        self.running.remove(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
        self._free(r)
        r.num_computed_tokens = 0
        r.status = WAITING
        r.ever_preempted = True
        self.waiting.appendleft(r)
        self.num_waiting += 1
        self.num_preemptions += 1
        if r.record is not None:
            r.record.preemptions += 1

    # ------------------------------------------------------------- schedule
    def schedule(self, macro_limit=None, tail: int = 0) -> StepPlan | None:
        """Decide the next step. `macro_limit(plan, ctx0)` may return how many
        identical decode-only steps may be decided now; the plan then stands
        for all but the last `tail` of them (closed form), which the caller
        schedules as single steps right after."""
        S = self.next_step
        cfg = self.config
        bs = self.block_size
        pool = self.pool
        gone = self.finish_at.pop(S - 1, None)
        if gone is not None:
            for r in gone:
                if r.decoding and r.dec_last == S - 1:
                    self._leave(r, S - 1)
        while self.finish_heap and self.finish_heap[0] < S:
            heapq.heappop(self.finish_heap)
        plan = StepPlan(S)
        budget = cfg.max_num_batched_tokens
        preempted = False
        ntok = 0

        # 1. running requests: the decode group, then those still in prefill
        need = self.block_phase[S % bs]
        if need <= pool.num_free:
            pool.take_free(need)
        else:
            preempted = self._allocate_decodes_slow(S)
        n = self.n_dec
        # the decode group as it enters this step: requests whose prefill
        # completes below join it for the next step and add nothing here
        base = self.dec_base
        budget -= n
        ntok += n
        for r in list(self.prefilling):
            if budget <= 0:
                break
            if r.status != RUNNING:
                continue            # preempted above as a victim
            q = min(r.num_tokens - r.num_computed_tokens, budget)
            while not self._allocate(r, r.num_computed_tokens + q):
                victim = self.running[-1]
                self._preempt(victim, S)
                preempted = True
                if victim is r:
                    break
            if r.status != RUNNING:
                continue
            self._schedule_chunk(plan, r, q, S)
            budget -= q
            ntok += q

        # 2. admission from the waiting queue
        blocked = False
        if not preempted:
            while budget > 0 and self.num_waiting and len(self.running) < cfg.max_num_seqs:
                r = self.waiting[0]
                if r.status != WAITING:
                    self.waiting.popleft()
                    continue
                if self._blocked == (r, pool.releases, self._num_chunks):
                    # since this head last did not fit, no block came back and no
                    # prompt block was computed that it could hit; allocations and
                    # evictions only shrink what it could get
                    blocked = True
                    break
                pieces, hit_blocks = self._find_hit(r)
                hit_free = sum(p[2] - p[1] for p in pieces if p[0].free)
                if self.reserve:
                    total = -(-(r.prompt_len + r.max_tokens) // bs)
                    free = pool.num_free - self.reservation_gap(S)
                else:
                    total = -(-r.num_tokens // bs)
                    free = pool.num_free
                if total - hit_blocks + hit_free > free:
                    blocked = True
                    self._blocked = (r, pool.releases, self._num_chunks)
                    break
                self.waiting.popleft()
                self.num_waiting -= 1
                r.reserve_top = total
                for e, lo, hi in pieces:
                    r.blocks.append(pool.acquire(e, lo, hi, r))
                hit = hit_blocks * bs
                r.num_computed_tokens = hit
                r.status = RUNNING
                self.running.append(r)
                self.prefilling.append(r)
                if not r.ever_preempted:
                    self.counters["prefix_cache_queries_total"] += r.prompt_len
                    self.counters["prefix_cache_hits_total"] += hit
                if r.record is not None:
                    r.record.prefix_hit_tokens += hit
                q = min(r.num_tokens - hit, budget)
                ok = self._allocate(r, hit + q)
                assert ok, "admission check guarantees the blocks"
                self._schedule_chunk(plan, r, q, S)
                budget -= q
                ntok += q

        nreq = n + len(plan.prefill)
        if nreq == 0:
            return None
        plan.n_decode = n
        plan.num_reqs = nreq
        plan.num_tokens = ntok
        plan.ctx0 = ctx0 = base + n * (S + 1)
        fin = self.finish_at.get(S)
        if (macro_limit is not None and not plan.prefill and not preempted and n
                and not self.prefilling and (blocked or not self.num_waiting
                                                 or len(self.running) >= cfg.max_num_seqs)):
            m = macro_limit(plan, ctx0)
            if m > 1:
                m = self._cap_macro(S, m) - tail
            if m > 1:
                plan.count = m
                extra = sum(self.block_phase[s % bs] for s in range(S + 1, S + m)) \
                    if m <= bs else self._phase_blocks(S + 1, m - 1)
                pool.take_free(extra)
                fin = self.finish_at.get(S + m - 1)
        if fin:
            plan.finishing.extend(r for r in fin if r.decoding and r.dec_last == plan.last)
        self.next_step = S + plan.count
        self.num_steps += plan.count
        return plan

    def reservation_gap(self, through: int) -> int:
        """Reserve policy: blocks set aside for running requests and not yet
        holding a token, once steps up to `through` are scheduled (a member of
        the decode group is counted from its step index, not synced)."""
        bs = self.block_size
        gap = 0
        for r in self.running:
            if r.decoding:
                k = min(through, r.dec_last) - r.dec_start + 1
                held = -(-(r.c0 + (k if k > 0 else 0)) // bs)
            else:
                held = r.blocks[-1].hi if r.blocks else 0
            if r.reserve_top > held:
                gap += r.reserve_top - held
        return gap

    def _phase_blocks(self, start: int, m: int) -> int:
        """New blocks the decode group needs over steps [start, start + m)."""
        bs = self.block_size
        full, rem = divmod(m, bs)
        total = full * self.n_dec
        for s in range(start, start + rem):
            total += self.block_phase[s % bs]
        return total

    def _cap_macro(self, S: int, m: int) -> int:
        """Largest m' <= m such that no member's last step falls before the
        last step of the run and the group's new blocks fit."""
        if self.finish_heap:
            m = min(m, self.finish_heap[0] - S + 1)
        free = self.pool.num_free          # the blocks of step S are already taken
        if m > 1 and self._phase_blocks(S + 1, m - 1) > free:
            lo, hi = 1, m - 1                # largest k with blocks(S+1, k) <= free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self._phase_blocks(S + 1, mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            m = lo + 1 if self._phase_blocks(S + 1, lo) <= free else 1
        return max(m, 1)

    def _allocate_decodes_slow(self, S: int) -> bool:
        """Not enough free blocks for every decoding request that needs one at
        step S: go through running requests in admission order, preempting
        from the tail, as vLLM does."""
        bs = self.block_size
        preempted = False
        for r in list(self.running):
            if r.status != RUNNING or not r.decoding:
                continue
            if (S - r.phase) % bs:
                continue
            while self.pool.num_free < 1:
                victim = self.running[-1]
                self._preempt(victim, S)
                preempted = True
                if victim is r:
                    break
            if r.status == RUNNING:
                self.pool.take_free(1)
        return preempted

    def _schedule_chunk(self, plan: StepPlan, r: Request, q: int, S: int) -> None:
        r.num_computed_tokens += q
        r.chunks.append([S, q])
        self._num_chunks += 1
        if r.record is not None:
            r.record.prompt_computed += q
        plan.prefill.append((r, q, r.num_computed_tokens - q))
        if r.num_computed_tokens == r.num_tokens:
            r.num_output_tokens += 1
            plan.first_outputs.append(r)
            self.prefilling.remove(r)
            if r.num_output_tokens >= r.out_limit:
                plan.finishing.append(r)
            else:
                self._join(r, S + 1)
