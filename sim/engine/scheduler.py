"""vLLM V1's scheduler (`v1/core/sched/scheduler.py`), one decision per step.

`schedule()` is the whole algorithm:
  1. running requests, in admission order, take their tokens from the step's
     token budget — a decoding request 1, a request still in prefill
     min(remaining, budget) (chunked prefill); a request that needs a KV
     block when none is free preempts the most recently admitted running
     request, which goes back to the front of the waiting queue (PREEMPTED);
  2. unless this step preempted, waiting requests are admitted from the head
     while budget and seats remain; a request is admitted only if its whole
     remaining prompt fits in free blocks after its prefix-cache hit, and a
     head that does not fit stops admission (head-of-line blocking).

Under the priority policy (`scheduling_policy = "priority"`, vLLM's
`--scheduling-policy priority`) the waiting queue is ordered by (priority,
arrival time), smaller first, and a preempted request goes back by that key
rather than to the front (`PriorityWaitingQueue`); a request that needs a KV
block when none is free preempts the running request with the largest
(priority, arrival time) instead of the most recently admitted one, which
gives back the tokens it had been given in this step (see
`_schedule_prefills_by_priority`). Admission is otherwise the same: from the
head, whole prompt must fit, a head that does not fit stops it.

Blocks and the prefix cache belong to the `KVCacheManager`; decoding requests
form a `DecodeGroup` advanced in closed form, so a decode step touches no
request. When nothing can change a run of decode-only steps, `schedule()` may
decide all of them at once (fast-forward): one `SchedulerOutput` stands for
`num_steps` identical steps.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from itertools import count

from .decode_group import DecodeGroup
from .kv_cache_manager import KVCacheManager
from .request import ABORTED, FINISHED, PREEMPTED, RUNNING, WAITING, WAITING_STATUSES, Request
from .step_time import StepTimeModel
from .utils import cdiv

KV_POLICIES = ("on-demand", "reserve")
SCHEDULING_POLICIES = ("fcfs", "priority")


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
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority"
    # (waiting queue by (priority, arrival time); preemption takes the
    # running request with the largest such key)
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")


def priority_key(r: Request) -> tuple:
    """The priority policy's order: smaller priority first, then earlier
    arrival (vLLM's `Request.__lt__`)."""
    return (r.priority, r.arrival_time)


class PriorityWaitingQueue:
    """vLLM's `PriorityRequestQueue` (`v1/core/sched/request_queue.py`): a
    heap by (priority, arrival time); ties keep insertion order. It offers
    the deque operations the scheduler uses on its waiting queue; prepending
    (a preempted request) pushes by key like any other, as vLLM's
    `prepend_request` does. Aborted requests stay in it until they reach the
    head, as in the deque."""
    __slots__ = ("_heap", "_seq")

    def __init__(self):
        self._heap: list = []
        self._seq = count()

    def append(self, r: Request) -> None:
        heapq.heappush(self._heap, (r.priority, r.arrival_time, next(self._seq), r))

    appendleft = append

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def __getitem__(self, i: int) -> Request:
        if i != 0:
            raise IndexError("only the head of a priority queue can be read")
        return self._heap[0][3]

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self):
        """The requests in queue order."""
        return (e[3] for e in sorted(self._heap))


class SchedulerOutput:
    """What one scheduler decision sends to the forward pass. An output with
    num_steps > 1 is a fast-forward: identical decode-only steps, their time
    in closed form."""
    __slots__ = ("first_step", "num_steps", "last", "start", "end", "decode_context", "num_reqs",
                 "total_num_scheduled_tokens", "num_decode_reqs", "prefill_chunks", "prefill_pairs",
                 "first_outputs", "finishing", "admission_blocked")

    def __init__(self, first_step: int):
        self.first_step = first_step
        self.num_steps = 1
        self.last = first_step          # index of the last step
        self.start = self.end = 0.0
        self.decode_context = 0         # decode context sum of the first step
        self.num_reqs = 0
        self.total_num_scheduled_tokens = 0
        self.num_decode_reqs = 0
        self.prefill_chunks = []        # (request, tokens, context before)
        self.prefill_pairs = 0          # query-key pairs of the chunks (step_time.prefill_pairs)
        # the next two are mostly empty: a shared () until the first request
        self.first_outputs = ()         # requests whose prefill completes: they emit a token
        self.finishing = ()             # requests whose last token is in the (last) step
        # a request waits and cannot be admitted until a running one leaves
        # (its head does not fit, or every seat is taken): a request added
        # to the waiting queue's end changes none of these steps
        self.admission_blocked = False


class Scheduler:
    def __init__(self, config: SchedulerConfig, step_model: StepTimeModel, leak_blocks_on_abort: bool = False):
        self.config = config
        self.leak_blocks_on_abort = leak_blocks_on_abort    # fault injection (EngineConfig)
        self.step_model = step_model
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.reserve = config.kv_policy == "reserve"
        self.kv_cache_manager = KVCacheManager(config.num_gpu_blocks, config.block_size, self.reserve)
        self.block_pool = self.kv_cache_manager.block_pool
        self.decode_group = DecodeGroup(config.block_size)
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting = PriorityWaitingQueue() if self.by_priority else deque()
        self.num_waiting = 0            # waiting requests not aborted (aborted ones leave lazily)
        self.running: list[Request] = []       # admission order
        self.prefilling: list[Request] = []    # running requests still in prefill, admission order
        self.next_step = 0              # index of the next step to schedule
        # counters, as vLLM defines them
        self.counters = {"prompt_tokens_total": 0, "prefix_cache_queries_total": 0,
                         "prefix_cache_hits_total": 0}
        self.num_preemptions = 0
        self.num_steps = 0
        self._blocked = None            # (head, pool.releases, chunks) when the head last did not fit
        self._num_chunks = 0            # prefill chunks scheduled so far
        # outputs_through(r, through): outputs r has produced once steps up
        # to `through` are processed (the decode group's count)
        self.outputs_through = self.decode_group.outputs_through

    # ------------------------------------------------------------- schedule
    def schedule(self, fast_forward_limit=None, num_tail_steps: int = 0) -> SchedulerOutput | None:
        """Decide the next step. `fast_forward_limit(output)` may return how
        many identical decode-only steps may be decided now; the output then
        stands for all but the last `num_tail_steps` of them, which the
        caller schedules as single steps right after."""
        step = self.next_step
        group = self.decode_group
        if step - 1 in group.by_last_step:
            for r in group.pop_done(step):
                self._leave_decode_group(r, step - 1)
        output = SchedulerOutput(step)
        max_num_batched_tokens = self.max_num_batched_tokens
        preempted = False

        # 1. running requests: the decode group, one token each, then those in prefill
        num_new_blocks = group.new_blocks_at(step)
        if num_new_blocks and not self.kv_cache_manager.allocate_decode_blocks(num_new_blocks):
            if self.by_priority:
                preempted = self._allocate_decode_blocks_by_priority(step, num_new_blocks)
            else:
                preempted = self._allocate_decode_blocks_preempting(step)
        # the group as it enters this step: requests whose prefill completes
        # below join it for the next step
        num_decode = group.num_reqs
        output.decode_context = group.context_sum(step)
        token_budget = max_num_batched_tokens - num_decode
        num_prefill = 0
        kv = self.kv_cache_manager
        if self.prefilling:
            if self.by_priority:
                token_budget, num_prefill, preempted, num_decode = self._schedule_prefills_by_priority(
                    output, step, token_budget, preempted)
            else:
                for r in list(self.prefilling):
                    if token_budget <= 0:
                        break
                    if r.status != RUNNING:
                        continue                # preempted above as a victim
                    # inlined r.num_tokens (a property): -0.6% instructions a run (bench_run, callgrind)
                    num_new_tokens = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens
                    if num_new_tokens > token_budget:
                        num_new_tokens = token_budget
                    while not kv.allocate_slots(r, num_new_tokens):
                        preempted = True
                        if self._preempt_last(step) is r:
                            break
                    if r.status == RUNNING:
                        self._schedule_chunk(output, r, num_new_tokens, step)
                        token_budget -= num_new_tokens
                        num_prefill += 1

        # 2. waiting requests, from the head, unless this step preempted
        blocked = False
        if not preempted:
            waiting, running, max_num_seqs = self.waiting, self.running, self.max_num_seqs
            while token_budget > 0 and self.num_waiting and len(running) < max_num_seqs:
                r = waiting[0]
                if r.status not in WAITING_STATUSES:
                    waiting.popleft()           # aborted while waiting
                    continue
                if self._blocked == (r, self.block_pool.releases, self._num_chunks):
                    # since this head last did not fit, no block came back and no
                    # prompt block was computed that it could hit; allocations and
                    # evictions only shrink what it could get
                    blocked = True
                    break
                computed_blocks, num_computed_tokens = kv.get_computed_blocks(r)
                num_new_tokens = r.num_prompt_tokens + r.num_output_tokens - num_computed_tokens
                if num_new_tokens > token_budget:
                    num_new_tokens = token_budget
                set_aside = self.reservation_gap(step) if self.reserve else 0
                if not kv.allocate_slots(r, num_new_tokens, num_computed_tokens, computed_blocks, set_aside):
                    blocked = True
                    self._blocked = (r, self.block_pool.releases, self._num_chunks)
                    break
                waiting.popleft()
                self.num_waiting -= 1
                self._admit(r, num_computed_tokens)
                self._schedule_chunk(output, r, num_new_tokens, step)
                token_budget -= num_new_tokens
                num_prefill += 1

        if num_decode + num_prefill == 0:
            return None
        output.num_decode_reqs = num_decode
        output.num_reqs = num_decode + num_prefill
        output.total_num_scheduled_tokens = max_num_batched_tokens - token_budget
        if (fast_forward_limit is not None and num_decode and not num_prefill and not preempted
                and not self.prefilling):
            # nothing waits, or what waits cannot be admitted
            output.admission_blocked = bool(self.num_waiting) and (blocked or len(self.running) >= self.max_num_seqs)
            if output.admission_blocked or not self.num_waiting:
                if self.by_priority and len(self.running) < self.max_num_seqs:
                    # a request of higher priority than the head that does
                    # not fit may come in and fit: only seats block it for sure
                    output.admission_blocked = False
                self._fast_forward(output, fast_forward_limit, num_tail_steps)
        last = output.last
        if last in group.by_last_step:
            finishing = group.finishing_at(last)
            if finishing:
                output.finishing = [*output.finishing, *finishing]
        self.next_step = step + output.num_steps
        self.num_steps += output.num_steps
        return output

    def _fast_forward(self, output: SchedulerOutput, limit, num_tail_steps: int) -> None:
        """Stretch a decode-only output over as many steps as `limit` allows,
        no member finishing before the last of them and their blocks fitting."""
        num_steps = limit(output)
        if num_steps > 1:
            step = output.first_step
            group = self.decode_group
            num_steps = group.fast_forward_cap(step, num_steps, self.kv_cache_manager.num_free_blocks) - num_tail_steps
            if num_steps > 1:
                output.num_steps = num_steps
                output.last = step + num_steps - 1
                ok = self.kv_cache_manager.allocate_decode_blocks(group.new_blocks(step + 1, num_steps - 1))
                assert ok, "the cap keeps the group's blocks within the free ones"

    def _allocate_decode_blocks_preempting(self, step: int) -> bool:
        """Not enough free blocks for every decoding request that needs one in
        `step`: go through running requests in admission order, preempting
        from the tail, as vLLM does. Returns whether any was preempted."""
        block_pool = self.block_pool
        preempted = False
        for r in list(self.running):
            if r.status != RUNNING or not r.in_decode_group or (step - r.block_phase) % self.block_size:
                continue
            while block_pool.num_free < 1:
                preempted = True
                if self._preempt_last(step) is r:
                    break
            if r.status == RUNNING:
                block_pool.take_free(1)
        return preempted

    def _allocate_decode_blocks_by_priority(self, step: int, num_new_blocks: int) -> bool:
        """The priority policy's `_allocate_decode_blocks_preempting`: while
        the decoding requests' new blocks of `step` do not fit, preempt the
        running request with the largest (priority, arrival time) — vLLM
        preempts it whichever running request is asking — then take them."""
        block_pool = self.block_pool
        bs = self.block_size
        while num_new_blocks > block_pool.num_free:
            v = max(self.running, key=priority_key)
            if v.in_decode_group and not (step - v.block_phase) % bs:
                num_new_blocks -= 1     # it was one of those needing a block
            self._preempt(v, step)
        block_pool.take_free(num_new_blocks)
        return True

    def _schedule_prefills_by_priority(self, output: SchedulerOutput, step: int, token_budget: int,
                                       preempted: bool) -> tuple[int, int, bool, int]:
        """The running requests in prefill under the priority policy, in
        admission order (vLLM's running loop, `Scheduler.schedule`): each
        takes min(remaining, budget) tokens; when its blocks do not fit, the
        running request with the largest (priority, arrival time) is
        preempted, and if it had been given tokens in this step they go back
        to the budget (a decoding one's token and its new block too). If the
        request itself is the largest, it is preempted and the loop stops.
        Chunks are committed once the loop is over, so a victim's blocks are
        freed as of its computed tokens before this step. Returns the budget
        left, the chunks scheduled, whether any request was preempted and the
        decoding requests in the step (the decode context set in `output`)."""
        kv = self.kv_cache_manager
        bs = self.block_size
        planned: dict[Request, int] = {}        # request -> tokens, admission order
        for r in list(self.prefilling):
            if token_budget <= 0:
                break
            if r.status != RUNNING:
                continue                # preempted above as a victim
            num_new_tokens = r.num_prompt_tokens + r.num_output_tokens - r.num_computed_tokens
            if num_new_tokens > token_budget:
                num_new_tokens = token_budget
            while not kv.allocate_slots(r, num_new_tokens):
                preempted = True
                decoding = None
                v = max(self.running, key=priority_key)
                if v.in_decode_group:
                    # counted in this step's decode batch, with a new block if at its phase
                    decoding = not (step - v.block_phase) % bs
                self._preempt(v, step)
                if v in planned:
                    token_budget += planned.pop(v)
                elif decoding is not None:
                    token_budget += 1
                    if decoding:
                        self.block_pool.put_back(1)
                if v is r:
                    break
            if r.status != RUNNING:
                break                   # no one left to preempt: the loop stops (vLLM)
            planned[r] = num_new_tokens
            token_budget -= num_new_tokens
        group = self.decode_group
        num_decode = group.num_reqs         # before the chunks' requests join it
        output.decode_context = group.context_offset + num_decode * (step + 1)
        for r, num_new_tokens in planned.items():
            self._schedule_chunk(output, r, num_new_tokens, step)
        return token_budget, len(planned), preempted, num_decode

    def _admit(self, r: Request, num_computed_tokens: int) -> None:
        """r leaves the waiting queue for the running ones with its prefix-cache hit."""
        r.num_computed_tokens = num_computed_tokens
        r.status = RUNNING
        self.running.append(r)
        self.prefilling.append(r)
        if not r.ever_preempted:
            self.counters["prefix_cache_queries_total"] += r.num_prompt_tokens
            self.counters["prefix_cache_hits_total"] += num_computed_tokens
        if r.record is not None:
            r.record.prefix_hit_tokens += num_computed_tokens

    def _schedule_chunk(self, output: SchedulerOutput, r: Request, num_new_tokens: int, step: int) -> None:
        context_before = r.num_computed_tokens
        r.num_computed_tokens = computed = context_before + num_new_tokens
        r.chunks.append([step, num_new_tokens])
        self._num_chunks += 1
        if r.record is not None:
            r.record.prompt_computed += num_new_tokens
        output.prefill_chunks.append((r, num_new_tokens, context_before))
        # inlined prefill_pairs(num_new_tokens, context_before): -0.9% instructions a run (bench_run, callgrind)
        output.prefill_pairs += num_new_tokens * (context_before + (num_new_tokens + 1) / 2.0)
        if computed == r.num_prompt_tokens + r.num_output_tokens:     # inlined r.num_tokens, as below

            r.num_output_tokens += 1
            output.first_outputs = [*output.first_outputs, r]
            self.prefilling.remove(r)
            if r.num_output_tokens >= r.out_limit:
                output.finishing = [*output.finishing, r]
            else:
                self.decode_group.join(r, step + 1)
                self.kv_cache_manager.open_output_blocks(r)

    def reservation_gap(self, through: int) -> int:
        """Reserve policy: blocks set aside for running requests and not yet
        holding a token, once steps up to `through` are scheduled (a member of
        the decode group is counted from its step index, not synced)."""
        bs = self.block_size
        gap = 0
        for r in self.running:
            if r.in_decode_group:
                computed = r.join_computed_tokens + DecodeGroup.steps_through(r, through)
                held = cdiv(computed, bs)
            else:
                held = KVCacheManager.num_blocks_held(r)
            if r.reserve_top > held:
                gap += r.reserve_top - held
        return gap

    # -------------------------------------------------------- queue changes
    def add_request(self, r: Request) -> None:
        r.status = WAITING
        self.waiting.append(r)
        self.num_waiting += 1

    def finish(self, r: Request, through: int) -> None:
        """r produced its last token in step `through` (output processed).
        A request preempted after that step was scheduled has already given
        back its blocks and waits to be recomputed: it finishes all the same."""
        self._stop(r, through, through)
        if r.status == PREEMPTED:
            self.num_waiting -= 1           # leaves the waiting queue lazily
        else:
            self.running.remove(r)
            self.kv_cache_manager.free(r)
        r.status = FINISHED

    def abort(self, r: Request, processed: int) -> bool:
        """Abort r at a step boundary; steps up to `processed` have had their
        output processed. Returns False if r had already left."""
        if r.status in WAITING_STATUSES:
            r.status = ABORTED
            self.num_waiting -= 1
            return True
        if r.status != RUNNING:
            return False
        self._stop(r, self.next_step - 1, processed)
        r.status = ABORTED
        self._remove_running(r)
        if self.leak_blocks_on_abort:
            self.kv_cache_manager.leak(r)
        else:
            self.kv_cache_manager.free(r)
        return True

    def _preempt_last(self, step: int) -> Request:
        """Preempt the most recently admitted running request while
        scheduling `step` (the fcfs policy). Returns it."""
        r = self.running[-1]
        self._preempt(r, step)
        return r

    def _preempt(self, r: Request, step: int) -> None:
        """Preempt running request r while scheduling `step`: free its
        blocks, reset its progress, put it back in the waiting queue (at the
        front under fcfs, by its key under priority)."""
        self._stop(r, step - 1, step - 1)
        self._remove_running(r)
        self.kv_cache_manager.free(r)
        r.num_computed_tokens = 0
        r.status = PREEMPTED
        r.ever_preempted = True
        self.waiting.appendleft(r)
        self.num_waiting += 1
        self.num_preemptions += 1
        if r.record is not None:
            r.record.preemptions += 1

    def _stop(self, r: Request, scheduled_through: int, processed_through: int) -> None:
        """End r's decode stint: out of the group as of its last scheduled
        step, its outputs counted through the last processed one."""
        if r.in_decode_group:
            self._leave_decode_group(r, scheduled_through)
        r.outputs_done = self.decode_group.outputs_through(r, processed_through)
        r.decode_outputs_pending = False

    def _leave_decode_group(self, r: Request, through: int) -> None:
        self.decode_group.leave(r, through)
        self.kv_cache_manager.sync_output_blocks(r)

    def _remove_running(self, r: Request) -> None:
        self.running.remove(r)
        if r in self.prefilling:
            self.prefilling.remove(r)
