"""An engine request: one execution as vLLM's engine sees it
(`v1/request.py`)."""
from __future__ import annotations

WAITING, RUNNING, PREEMPTED, FINISHED, ABORTED = "waiting", "running", "preempted", "finished", "aborted"
# statuses of a request in the waiting queue: never admitted, or preempted
WAITING_STATUSES = (WAITING, PREEMPTED)


class Request:
    """`num_computed_tokens` and `num_output_tokens` are the scheduler's view
    (a step's tokens count once it is scheduled, as in vLLM). While a request
    is in the scheduler's decode group they are kept implicitly — see
    `DecodeGroup.sync` — so a decode step costs nothing per request."""

    __slots__ = (
        "request_id", "call_id", "num_prompt_tokens", "max_tokens", "shared_prefix", "prefix_group", "prompt_id",
        "arrival_time", "status", "num_computed_tokens", "num_output_tokens", "outputs_done",
        "blocks", "kv_layout", "ever_preempted", "first_output_done", "chunks", "record",
        # decode group (see DecodeGroup)
        "in_decode_group", "decode_outputs_pending", "decode_first_step", "decode_last_step",
        "join_computed_tokens", "join_output_tokens", "block_phase",
        # early termination and waste accounting
        "stop_at", "out_limit", "reserve_top", "abort_seen", "outputs_seen",
        # the priority policy's key (smaller first), as vLLM's `priority`
        "priority",
    )

    def __init__(self, request_id: int, call_id: int, num_prompt_tokens: int, max_tokens: int,
                 shared_prefix: int = 0, record=None, stop_at: int | None = None, prefix_group: int = 0,
                 priority: int = 0, prompt_id: int | None = None):
        self.request_id = request_id
        self.call_id = call_id
        self.num_prompt_tokens = int(num_prompt_tokens)
        self.max_tokens = int(max_tokens)
        self.shared_prefix = int(shared_prefix)
        self.prefix_group = int(prefix_group)     # calls of one group share their prefix's blocks
        # requests of one prompt id send the same tokens past the prefix and share those blocks: an execution of
        # a call (the default: retries resend its prompt), or of a pool's prompt (sim.workload.Trace.prompt_id)
        self.prompt_id = call_id if prompt_id is None else prompt_id
        self.arrival_time = 0.0         # when it reached the engine (set by the engine)
        self.status = WAITING
        self.num_computed_tokens = 0
        self.num_output_tokens = 0      # outputs scheduled for (optimistic)
        self.outputs_done = 0           # outputs produced by processed steps, outside the decode group
        self.blocks = []                # block table: list of Extent, in sequence order
        self.kv_layout = None           # where its blocks live, set by the KV cache manager
        self.ever_preempted = False
        self.first_output_done = False
        self.chunks = []                # [step index, prompt-work tokens] per scheduled prefill chunk
        self.record = record            # ExecutionRecord updated by the engine, or None
        self.in_decode_group = False
        # True from joining the decode group until its outputs there are
        # folded into outputs_done (at finish, abort or preemption); while
        # True the decode_* and join_* fields describe that stint
        self.decode_outputs_pending = False
        self.decode_first_step = self.decode_last_step = 0
        self.join_computed_tokens = self.join_output_tokens = self.block_phase = 0
        # a stop sequence (or end of sequence) ends the response after `stop_at`
        # outputs; the engine learns it only then, so KV reservations and the
        # completion ratio still go by max_tokens
        if stop_at is not None and int(stop_at) < 1:
            raise ValueError(f"stop_at must be at least 1, got {stop_at}")
        self.stop_at = None if stop_at is None else int(stop_at)
        self.out_limit = self.max_tokens if stop_at is None else min(self.max_tokens, int(stop_at))
        self.reserve_top = 0            # reserve policy: blocks set aside up to this block position
        self.abort_seen = -1            # last processed step when its abort arrived
        self.outputs_seen = 0           # outputs streamed before its abort arrived
        self.priority = priority        # read only under the priority policy

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    def __repr__(self) -> str:
        return (f"Request({self.request_id}, {self.status}, computed={self.num_computed_tokens}, "
                f"out={self.num_output_tokens}/{self.max_tokens})")
