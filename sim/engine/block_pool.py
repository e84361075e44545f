"""KV block pool with a hashed prefix cache, in the shape of vLLM's
`v1/core/block_pool.py`, kept at range granularity so that a 12k-token prompt
costs a handful of operations rather than 750 block objects.

A block's hash is its *key*: (space, index). Blocks of the shared prompt
prefix live in space 0 (or their prefix group's); full blocks lying wholly inside
one call's prompt live in that call's space (a retry resends the same prompt, so
it may hit them; the calls that send one prompt of a pool share its space);
blocks holding output tokens, or a prompt's partial tail, live in the
execution's own space. Within a space, index = the block's position in the
sequence, so a request's leading run of cached blocks is a chain of ranges.

An `Extent` is a run of physically distinct blocks [lo, hi) of one space, all
with the same reference count. Free blocks sit in `free_queue` (LRU: evicted
from the front, freed blocks appended at the back); a free extent is evicted
from its top block down, so a request's tail blocks go before its prefix,
exactly as vLLM frees a request's blocks in reverse order. Free blocks with no
hash (never filled, or a partial last block) are extents of space -1.
"""
from __future__ import annotations

from collections import deque

UNHASHED = -1
PREFIX_SPACE = 0


def prefix_space(group: int) -> int:
    """The space of prefix group `group`'s blocks: 0, or beyond any call's or execution's."""
    return PREFIX_SPACE if group == 0 else (1 << 62) + group


def call_space(call_id: int) -> int:
    return 1 + 2 * call_id


def exec_space(request_id: int) -> int:
    return 2 + 2 * request_id


class Extent:
    __slots__ = ("space", "lo", "hi", "holders", "free", "owner")

    def __init__(self, space: int, lo: int, hi: int, owner=None, holder=None):
        self.space = space
        self.lo = lo
        self.hi = hi
        self.holders = [] if holder is None else [holder]  # requests holding these blocks (the ref count)
        self.free = False     # in the free queue (ref == 0, still hashed)
        self.owner = owner    # request that is still filling the top block, if any

    def __len__(self) -> int:
        return self.hi - self.lo

    def __repr__(self) -> str:
        return f"Extent(space={self.space}, [{self.lo},{self.hi}), ref={len(self.holders)}, free={self.free})"


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_free = num_blocks
        first = Extent(UNHASHED, 0, num_blocks)
        first.free = True
        self.free_queue: deque[Extent] = deque([first])
        self.cached: dict[int, list[Extent]] = {}   # space -> extents holding hashed blocks
        self.evicted = 0                            # hashed blocks evicted (for tests and stats)
        self.releases = 0                           # calls of release(): free blocks can only grow there

    # ------------------------------------------------------------------ usage
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def _index(self, e: Extent) -> None:
        if e.space >= 0 and e.hi > e.lo:
            self.cached.setdefault(e.space, []).append(e)

    def _unindex(self, e: Extent) -> None:
        lst = self.cached.get(e.space)
        if lst is not None:
            try:
                lst.remove(e)
            except ValueError:
                pass
            if not lst:
                del self.cached[e.space]

    # ------------------------------------------------------------- allocation
    def take_free(self, n: int) -> None:
        """Remove n blocks from the front of the free queue (evicting their
        hashes); the caller owns them now. Caller checks n <= num_free."""
        if n <= 0:
            return
        assert n <= self.num_free, (n, self.num_free)
        self.num_free -= n
        q = self.free_queue
        while True:
            e = q[0]
            lo = e.lo
            size = e.hi - lo
            if size > n and e.free:     # part of it: its top n blocks
                e.hi -= n
                if e.space >= 0:
                    self.evicted += n
                return
            q.popleft()
            if not e.free or not size:
                continue                # left the queue earlier (taken by a hit) or empty
            e.hi = lo                   # all of it
            e.free = False
            if e.space >= 0:
                self.evicted += size
                self._unindex(e)
            n -= size
            if not n:
                return

    def put_back(self, n: int) -> None:
        """Return n blocks taken with `take_free` and never filled (no hash)
        to the end of the free queue."""
        plain = Extent(UNHASHED, 0, n)
        plain.free = True
        self.free_queue.append(plain)
        self.num_free += n

    def new_extent(self, space: int, lo: int, hi: int, owner) -> Extent:
        """A fresh extent of hi-lo newly allocated blocks, held by `owner`."""
        self.take_free(hi - lo)
        e = Extent(space, lo, hi, owner, owner)
        if space >= 0 and hi > lo:      # inlined self._index(e): -0.4% instructions a run (bench_run, callgrind)
            lst = self.cached.get(space)
            if lst is None:
                self.cached[space] = [e]
            else:
                lst.append(e)
        return e

    def grow(self, e: Extent, hi: int) -> None:
        """Extend an extent its owner is filling to `hi` blocks."""
        self.take_free(hi - e.hi)
        e.hi = hi

    # ---------------------------------------------------------------- lookup
    def lookup(self, space: int, start: int, end: int) -> list[tuple[Extent, int, int]]:
        """Longest cached chain of blocks [start, x) of `space`, x <= end.
        The hashed part of an extent whose owner is still filling it is the
        owner's full blocks (its num_computed_tokens // block_size). Returns
        pieces (extent, lo, hi)."""
        pieces = []
        lst = self.cached.get(space)
        if not lst:
            return pieces
        bs = self.block_size
        cur = start
        while cur < end:
            best = None
            best_hi = cur
            for e in lst:
                if e.lo <= cur:
                    top = e.hi
                    if e.owner is not None:
                        full = e.owner.num_computed_tokens // bs
                        if full < top:
                            top = full
                    if top > best_hi:
                        best, best_hi = e, top
            if best is None:
                break
            hi = best_hi if best_hi < end else end
            pieces.append((best, cur, hi))
            cur = hi
        return pieces

    def acquire(self, e: Extent, lo: int, hi: int, req) -> Extent:
        """Take blocks [lo, hi) of a cached extent for request `req` (a prefix
        cache hit); returns the extent (possibly split off) it now holds. A
        split of a held extent is mirrored in every holder's block table."""
        if e.free:
            n = hi - lo
            self.num_free -= n
            piece = Extent(e.space, lo, hi, None, req)
            self._index(piece)
            if lo == e.lo and hi == e.hi:
                e.free = False
                e.hi = e.lo
                self._unindex(e)
            elif lo == e.lo:
                e.lo = hi
            elif hi == e.hi:
                e.hi = lo
            else:  # middle: the part above stays queued in e's place
                upper = Extent(e.space, hi, e.hi)
                upper.free = True
                e.hi = lo
                self._index(upper)
                q = self.free_queue
                q.insert(q.index(e), upper)   # upper blocks are evicted before lower ones
            return piece
        # held by others: share, splitting so that ref counts stay uniform
        if hi < e.hi:
            self._split(e, hi)
        if lo > e.lo:
            e = self._split(e, lo)
        e.holders.append(req)
        return e

    def _split(self, e: Extent, at: int) -> Extent:
        """Split a held extent at block `at`; returns the upper part, inserted
        after `e` in every holder's table."""
        upper = Extent(e.space, at, e.hi, e.owner)
        upper.holders = list(e.holders)
        e.hi = at
        e.owner = None
        self._index(upper)
        for req in e.holders:
            t = req.blocks
            t.insert(t.index(e) + 1, upper)
        return upper

    # ----------------------------------------------------------------- free
    def release(self, req, full_blocks: int) -> None:
        """A request gives back its blocks (finish, abort or preemption).
        `full_blocks` is the number of its leading blocks that are full; a
        partial last block loses its hash. Blocks whose ref count drops to
        zero join the free queue, tail first."""
        self.releases += 1
        q = self.free_queue
        table = req.blocks
        num_free = self.num_free
        for e in reversed(table):
            holders = e.holders
            holders.remove(req)
            if e.owner is req:
                e.owner = None
                lo, hi = e.lo, e.hi
                if hi > full_blocks:            # the partial top block: no hash
                    k = hi - (full_blocks if full_blocks > lo else lo)
                    e.hi = hi = hi - k
                    plain = Extent(UNHASHED, 0, k)
                    plain.free = True
                    q.append(plain)
                    num_free += k
                    if hi == lo:
                        self._unindex(e)
                        continue
            if not holders:
                e.free = True
                q.append(e)
                num_free += e.hi - e.lo
        self.num_free = num_free
        table.clear()
