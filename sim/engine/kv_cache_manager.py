"""KV cache manager (vLLM's `v1/core/kv_cache_manager.py`): each request's
block table over the block pool, and the prefix-cache lookup.

A request's sequence is laid out in three key spaces (see block_pool): the
shared prompt prefix, the full blocks of its call's prompt, and its own
execution's blocks (a partial prompt tail and the outputs).

Contract, with `r.blocks` the request's block table (extents in sequence order):
  - `get_computed_blocks(r)` -> (blocks, num_computed_tokens): the longest
    chain of cached full blocks r's sequence starts with, leaving at least
    one token to compute; takes nothing from the pool.
  - `allocate_slots(r, num_new_tokens, num_new_computed_tokens, new_computed_blocks)`
    -> bool: give r blocks for its first r.num_computed_tokens +
    num_new_computed_tokens + num_new_tokens tokens, taking the hit blocks
    `new_computed_blocks` first. False, with nothing taken, if the free
    blocks do not suffice. On admission (hit blocks given, possibly none)
    the whole request must fit besides: its remaining prompt under the
    on-demand policy, prompt + max_tokens under the reserve policy, in the
    free blocks less `num_blocks_set_aside`.
  - `free(r)`: r gives back its blocks (finish, abort or preemption); a
    partial last block loses its hash. `leak(r)` instead keeps them held
    for ever (fault injection: a block leak on abort).
  - Decode-group members grow their last extent implicitly: the group's new
    blocks are taken with `allocate_decode_blocks(n)`, and a member's table
    catches up with `sync_output_blocks(r)` when it leaves the group.
"""
from __future__ import annotations

from .block_pool import PREFIX_SPACE, BlockPool, Extent
from .request import Request


class KVCacheManager:
    def __init__(self, num_gpu_blocks: int, block_size: int, reserve: bool = False):
        self.block_size = block_size
        self.block_pool = BlockPool(num_gpu_blocks, block_size)
        self.reserve = reserve          # reserve policy: prompt + max_tokens set aside at admission
        self.num_leaked_blocks = 0      # block positions of leaked tables (fault injection)

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free

    @staticmethod
    def num_blocks_held(r: Request) -> int:
        return r.blocks[-1].hi if r.blocks else 0

    # --------------------------------------------------------------- layout
    def _layout(self, r: Request) -> tuple[int, int, int, int, int]:
        """(prefix group space, end of the shared prefix's blocks, prompt space (its call's, or its pool
        prompt's: `Request.prompt_id`), end of the prompt's full blocks, r's own space), computed once per
        request."""
        layout = r.kv_layout
        if layout is None:
            bs = self.block_size
            # block_pool's prefix_space, call_space and exec_space inlined: -0.4% instructions a fleet run (callgrind)
            g = r.prefix_group
            layout = r.kv_layout = (PREFIX_SPACE if g == 0 else (1 << 62) + g, r.shared_prefix // bs,
                                    1 + 2 * r.prompt_id, r.num_prompt_tokens // bs, 2 + 2 * r.request_id)
        return layout

    def _segments(self, r: Request, num_blocks: int):
        """(space, first block, end block) of r's first `num_blocks` blocks."""
        prefix, prefix_end, call, prompt_end, own = r.kv_layout or self._layout(r)
        return ((prefix, 0, prefix_end if prefix_end < num_blocks else num_blocks),
                (call, prefix_end, prompt_end if prompt_end < num_blocks else num_blocks),
                (own, prompt_end, num_blocks))

    # --------------------------------------------------------------- lookup
    def get_computed_blocks(self, r: Request):
        """The prefix-cache hit of r: pieces (extent, lo, hi) and the tokens they hold."""
        bs = self.block_size
        max_blocks = (r.num_prompt_tokens + r.num_output_tokens - 1) // bs
        prefix, prefix_end, call, prompt_end, own = r.kv_layout or self._layout(r)
        pool = self.block_pool
        cached = pool.cached
        pieces = []
        end = 0
        # the segments of r's first max_blocks blocks (see _segments)
        for space, first, last in ((prefix, 0, prefix_end), (call, prefix_end, prompt_end),
                                   (own, prompt_end, max_blocks)):
            if last > max_blocks:
                last = max_blocks
            if first >= last:
                continue
            if end < first:
                break
            if space in cached:
                found = pool.lookup(space, first, last)
                if found:
                    pieces += found
                    end = found[-1][2]
            if end < last:
                break
        return pieces, end * bs

    # ----------------------------------------------------------- allocation
    def allocate_slots(self, r: Request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_blocks_set_aside: int = 0) -> bool:
        pool = self.block_pool
        bs = self.block_size
        table = r.blocks
        if new_computed_blocks is not None:
            # blocks of the whole request; cdiv inlined here and below: -0.6% instructions a run (bench_run, callgrind)
            needed = -((r.num_prompt_tokens + (r.max_tokens if self.reserve else r.num_output_tokens)) // -bs)
            hit_in_free_queue = 0
            for e, lo, hi in new_computed_blocks:
                if e.free:
                    hit_in_free_queue += hi - lo
            if needed - num_new_computed_tokens // bs + hit_in_free_queue > pool.num_free - num_blocks_set_aside:
                return False
            r.reserve_top = needed
            for e, lo, hi in new_computed_blocks:
                table.append(pool.acquire(e, lo, hi, r))
        target = -((r.num_computed_tokens + num_new_computed_tokens + num_new_tokens) // -bs)    # cdiv
        if table:
            top = table[-1]
            held = top.hi
            if target <= held:
                return True
        else:
            top = None
            held = 0
        if target - held > pool.num_free:
            assert new_computed_blocks is None, "the admission check guarantees the blocks"
            return False
        prefix, prefix_end, call, prompt_end, own = r.kv_layout or self._layout(r)
        # blocks [held, target), a piece per segment they cross (see _segments)
        while held < target:
            if held < prefix_end:
                space, last = prefix, prefix_end
            elif held < prompt_end:
                space, last = call, prompt_end
            else:
                space, last = own, target
            if last > target:
                last = target
            if top is not None and top.owner is r and top.space == space and top.hi == held:
                pool.grow(top, last)
            else:
                if top is not None and top.owner is r and top.space != space:
                    top.owner = None            # complete: the sequence moved past it
                top = pool.new_extent(space, held, last, r)
                table.append(top)
            held = last
        return True

    def allocate_decode_blocks(self, num_blocks: int) -> bool:
        """Take the decode group's new blocks; False, taking nothing, if they do not fit."""
        pool = self.block_pool
        if num_blocks > pool.num_free:
            return False
        if num_blocks:
            pool.take_free(num_blocks)
        return True

    def free(self, r: Request) -> None:
        self.block_pool.release(r, r.num_computed_tokens // self.block_size)

    def leak(self, r: Request) -> None:
        """Fault injection: r's blocks are never given back. They stay held
        by r (its table kept, so a sharer's split still finds them) and
        hashed, so a later request may still hit them."""
        self.num_leaked_blocks += self.num_blocks_held(r)

    # ---------------------------------------------------- decode-group tables
    def open_output_blocks(self, r: Request) -> None:
        """r joins the decode group: its prompt extents are complete, and its
        table ends in an extent of its own space that the outputs grow."""
        own = (r.kv_layout or self._layout(r))[4]
        table = r.blocks
        for e in table:
            if e.owner is r and e.space != own:
                e.owner = None
        top = table[-1] if table else None
        if top is None or top.space != own or top.owner is not r:
            first = -(r.num_computed_tokens // -self.block_size)     # cdiv
            table.append(Extent(own, first, first, r, r))

    def sync_output_blocks(self, r: Request) -> None:
        """A member leaving the group: its output extent covers its computed tokens."""
        top = r.blocks[-1]
        hi = -(r.num_computed_tokens // -self.block_size)      # cdiv
        top.hi = hi if hi > top.lo else top.lo
