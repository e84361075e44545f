"""The decode group: running requests whose prefill is complete, kept in
closed form so that a decode step touches no request.

A member that joined at step `decode_first_step` with `join_computed_tokens`
computed and `join_output_tokens` scheduled outputs has, once steps up to s
are scheduled, k(s) = min(s, decode_last_step) - decode_first_step + 1 more of
each (one token a step). The group keeps only aggregates:
  - `num_reqs`, the members;
  - `context_offset`, the sum over members of join_computed_tokens -
    decode_first_step, so that the decode context of step s (tokens read,
    the new one included) is `context_offset + num_reqs * (s + 1)`;
  - `new_blocks_by_phase[p]`, how many members need a new KV block at steps
    s with s % block_size == p (a member's block phase);
  - the members by their last step, and a heap of those steps, so that a
    stretch of steps in which nobody finishes can be advanced at once (the
    engine's fast-forward).
A member's `Request` fields are brought up to date by `sync()`, which the
scheduler calls whenever the member leaves the group.
"""
from __future__ import annotations

import heapq

from .request import Request


class DecodeGroup:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.num_reqs = 0
        self.context_offset = 0
        self.new_blocks_by_phase = [0] * block_size
        self.by_last_step: dict[int, list[Request]] = {}
        self.last_steps: list[int] = []         # heap of the keys of by_last_step

    # ------------------------------------------------------------ membership
    def join(self, r: Request, first_step: int) -> None:
        """r's prefill completed in step first_step-1; it decodes from `first_step`."""
        r.in_decode_group = True
        r.decode_outputs_pending = True
        r.decode_first_step = first_step
        r.join_computed_tokens = computed = r.num_computed_tokens
        r.join_output_tokens = r.num_output_tokens
        r.decode_last_step = last = first_step + (r.out_limit - r.num_output_tokens) - 1
        r.block_phase = (first_step - computed) % self.block_size
        self.num_reqs += 1
        self.context_offset += computed - first_step
        self.new_blocks_by_phase[r.block_phase] += 1
        members = self.by_last_step.get(last)
        if members is None:
            self.by_last_step[last] = [r]
            heapq.heappush(self.last_steps, last)
        else:
            members.append(r)

    def leave(self, r: Request, through: int) -> None:
        """Take r out of the group, its last scheduled step being `through`
        (its fields synced as of then)."""
        self.sync(r, through)
        r.in_decode_group = False
        self.num_reqs -= 1
        self.context_offset -= r.join_computed_tokens - r.decode_first_step
        self.new_blocks_by_phase[r.block_phase] -= 1
        members = self.by_last_step.get(r.decode_last_step)
        if members is not None and r.decode_last_step != through and r in members:
            members.remove(r)

    def pop_done(self, step: int) -> list[Request]:
        """Members whose last step is step-1, to leave before `step` is
        scheduled (last steps before `step` are forgotten)."""
        members = self.by_last_step.pop(step - 1, None)
        if members is None:
            return []
        return [r for r in members if r.in_decode_group and r.decode_last_step == step - 1]

    def finishing_at(self, step: int) -> list[Request]:
        """Members whose last output is scheduled in `step`."""
        members = self.by_last_step.get(step)
        if not members:
            return []
        return [r for r in members if r.in_decode_group and r.decode_last_step == step]

    # ------------------------------------------------------------- progress
    @staticmethod
    def steps_through(r: Request, through: int) -> int:
        """Decode steps of r's stint scheduled once steps up to `through` are."""
        k = min(through, r.decode_last_step) - r.decode_first_step + 1
        return k if k > 0 else 0

    def sync(self, r: Request, through: int) -> None:
        """Bring a member's fields up to date as of step `through`."""
        last = r.decode_last_step                          # steps_through(r, through)
        k = (through if through < last else last) - r.decode_first_step + 1
        if k < 0:
            k = 0
        r.num_computed_tokens = r.join_computed_tokens + k
        r.num_output_tokens = r.join_output_tokens + k

    def outputs_through(self, r: Request, through: int) -> int:
        """Outputs r has produced once steps up to `through` are processed."""
        if not r.decode_outputs_pending:
            return r.outputs_done
        last = r.decode_last_step                          # steps_through(r, through)
        k = (through if through < last else last) - r.decode_first_step + 1
        return r.outputs_done + k if k > 0 else r.outputs_done

    def context_sum(self, step: int) -> int:
        """Decode context of `step` summed over the members."""
        return self.context_offset + self.num_reqs * (step + 1)

    # ---------------------------------------------------------------- blocks
    def new_blocks_at(self, step: int) -> int:
        """New KV blocks the members need in `step`."""
        return self.new_blocks_by_phase[step % self.block_size]

    def new_blocks(self, start: int, num_steps: int) -> int:
        """New KV blocks the members need over steps [start, start + num_steps)."""
        full, rest = divmod(num_steps, self.block_size)
        total = full * self.num_reqs
        for s in range(start, start + rest):
            total += self.new_blocks_by_phase[s % self.block_size]
        return total

    # ---------------------------------------------------------- fast-forward
    def fast_forward_cap(self, step: int, num_steps: int, num_free_blocks: int) -> int:
        """Largest n <= num_steps such that no member's last step falls before
        step + n - 1 and the group's new blocks of steps step+1 .. step+n-1 fit
        in `num_free_blocks` (those of `step` are already taken)."""
        last_steps = self.last_steps
        while last_steps and last_steps[0] < step:
            heapq.heappop(last_steps)           # steps already scheduled
        if last_steps:
            num_steps = min(num_steps, last_steps[0] - step + 1)
        if num_steps > 1 and self.new_blocks(step + 1, num_steps - 1) > num_free_blocks:
            lo, hi = 1, num_steps - 1            # largest k with new_blocks(step+1, k) <= free
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.new_blocks(step + 1, mid) <= num_free_blocks:
                    lo = mid
                else:
                    hi = mid - 1
            num_steps = lo + 1 if self.new_blocks(step + 1, lo) <= num_free_blocks else 1
        return max(num_steps, 1)
