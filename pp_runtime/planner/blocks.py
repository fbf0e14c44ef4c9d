"""The KV cache's blocks: one pool for the whole pipeline, owned by the planner. No torch.

Every stage's cache is `num_blocks` blocks of `block_size` positions per layer
(`model/kv_cache.py`). A request holds a block table: the blocks of its positions in order
(position p is at offset p % block_size of block table[p // block_size]). The planner owns
the one pool and every `SeqChunk` carries its request's table, so every stage reads and
writes the same blocks, and a real run and its simulation admit, grow and free alike.
`memory.kv_blocks` sizes the pool to the stage with the least room.

The rules (`KVBlocks`):
- admission takes the blocks of everything the request must prefill (its prompt, or its
  prompt and generated tokens after a preemption) while at least `cache.watermark` of the
  pool stays free for the requests already running; with `cache.paged: false` it takes
  the whole context (the paper's slots: nothing ever grows);
- a decode that enters a new block takes one (`grow`); when none is free the planner
  preempts (`BasePlanner.place`);
- prefix caching (`cache.prefix_caching`): a block whose positions are all computed is
  keyed by a hash of its tokens and of every token before it. When its last owner lets
  go it keeps its content and key on a least-recently-used list; a request whose prefill
  starts with the same tokens takes it instead of computing it again. A keyed block goes
  back to work for another request only when no plain free block is left.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import deque

from pp_runtime.config import Config
from pp_runtime.costmodel.memory import kv_blocks
from pp_runtime.core.request import Request


class BlockPool:
    """Free blocks, owners per block, and the prefix cache's keys."""

    def __init__(self, num_blocks: int, prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        self.free: deque[int] = deque(range(num_blocks))  # no owner, no key
        self.refs = [0] * num_blocks  # owners of each block
        self.key_of: dict[int, bytes] = {}  # keyed block -> key
        self.by_key: dict[bytes, int] = {}  # key -> block
        self.unused: dict[int, None] = {}  # keyed blocks with no owner, least recently used first

    @property
    def num_free(self) -> int:
        """Blocks a request can take now (plain free ones and keyed ones nobody owns)."""
        return len(self.free) + len(self.unused)

    def take(self) -> int:
        """A block for one owner: a plain free one, else the least recently used keyed one
        (its key dropped)."""
        if self.free:
            block = self.free.popleft()
        else:
            block = next(iter(self.unused))
            del self.unused[block]
            del self.by_key[self.key_of.pop(block)]
        self.refs[block] = 1
        return block

    def take_many(self, n: int) -> list[int]:
        """`[take() for _ in range(n)]`: the same blocks in the same order, popped in one
        loop where the plain free ones suffice (an admission takes a prompt's blocks)."""
        free = self.free
        if len(free) < n:
            return [self.take() for _ in range(n)]
        blocks = [free.popleft() for _ in range(n)]
        refs = self.refs
        for block in blocks:
            refs[block] = 1
        return blocks

    def share(self, key: bytes) -> int | None:
        """The block cached under `key`, with one more owner; None on a miss."""
        block = self.by_key.get(key)
        if block is not None:
            if self.refs[block] == 0:
                del self.unused[block]
            self.refs[block] += 1
        return block

    def release(self, blocks: list[int]) -> None:
        """One owner fewer for each block; the last blocks of a table go first, so the
        start of a shared prefix is the last to be evicted."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.unused[block] = None
                else:
                    self.free.append(block)

    def register(self, block: int, key: bytes) -> None:
        """Key a fully computed block (the first block with this content keeps the key)."""
        if key not in self.by_key and block not in self.key_of:
            self.key_of[block] = key
            self.by_key[key] = block


def block_key(prev: bytes, tokens) -> bytes:
    """The prefix cache's key of a block: its tokens and the key of the block before it."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


class KVBlocks:
    """Block tables of requests over one `BlockPool`: admission, growth, release, prefix
    hits, and keying blocks once they are computed."""

    def __init__(self, cfg: Config):
        c = cfg.cache
        self.block_size = c.block_size
        num_blocks = kv_blocks(cfg)
        self.pool = BlockPool(num_blocks, c.prefix_caching and c.paged)
        self.paged = c.paged
        self.per_context = -(-cfg.seq_len // c.block_size)  # blocks of a whole context
        self.watermark = int(c.watermark * num_blocks) if c.paged else 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def prefix_hits(self, req: Request) -> list[bytes]:
        """Keys of the request's leading full blocks found in the cache; at least one token
        is left to compute (it samples the next token)."""
        if not self.pool.prefix_caching:
            return []
        keys, key, bs = [], b"", self.block_size
        for i in range((req.prefill_len - 1) // bs):
            key = block_key(key, req.token_range(i * bs, (i + 1) * bs))
            if key not in self.pool.by_key:
                break
            keys.append(key)
        return keys

    def need(self, req: Request, tokens: int | None = None) -> int:
        """Blocks admission takes for `req` (without prefix hits): those of `tokens`
        positions (default its prefill), or a whole context with paged: false."""
        return self.blocks_for(tokens or req.prefill_len) if self.paged else self.per_context

    def admit(self, req: Request, watermark: bool = True, tokens: int | None = None) -> bool:
        """Give `req` the blocks of its prefill, or of `tokens` positions (paged), or of a
        whole context (slots), cached prefix blocks first; False, and nothing taken, when
        they are not free (leaving the watermark free, unless `watermark` is False)."""
        hits = self.prefix_hits(req)
        need = self.need(req, tokens) - len(hits)
        revived = sum(1 for k in hits if self.pool.refs[self.pool.by_key[k]] == 0)
        if need + revived > self.pool.num_free - (self.watermark if watermark else 0):
            return False
        req.blocks = [self.pool.share(k) for k in hits] + self.pool.take_many(need)
        cached = len(hits) * self.block_size
        req.num_scheduled = req.num_computed = req.num_keyed = cached
        req.num_cached += cached
        req.last_key = hits[-1] if hits else b""
        return True

    def grow(self, req: Request, kv_len: int) -> bool:
        """Blocks for positions [0, kv_len); False when the pool has none left."""
        blocks = req.blocks
        while len(blocks) * self.block_size < kv_len:
            if not self.pool.num_free:
                return False
            blocks.append(self.pool.take())
        return True

    def key_computed(self, req: Request) -> None:
        """Key every block of `req` whose positions are all computed (prefix caching)."""
        bs = self.block_size
        while req.num_keyed + bs <= req.num_computed:
            start = req.num_keyed
            req.last_key = block_key(req.last_key, req.token_range(start, start + bs))
            self.pool.register(req.blocks[start // bs], req.last_key)
            req.num_keyed = start + bs

    def free(self, req: Request) -> None:
        if req.blocks is not None:
            self.pool.release(req.blocks)
            req.blocks = None


class GrowthReserve:
    """The share of the running requests' owed KV growth that admission keeps free, adapted
    as gLLM adapts its decode reserve (gty111/gLLM @bc91d98, gllm/scheduler.py 41-42 and
    `_decode_reserve_pages` 109-163; planner/gllm.py): it falls `FALL` per micro-batch to
    `FLOOR` and rises `RISE` after a micro-batch that preempted, up to all of the growth.
    Where finishing requests free pages as fast as running ones grow (a served load) the
    reserve only idles memory, so the floor is none, as in vLLM and Sarathi-Serve (the
    watermark only; gLLM stops at 0.1); a burst that outgrows the pool preempts, and the
    reserve climbs back. docs/measurements/baselines.md, "Memory: the growth reserve
    adapts": GPT-3 P:D 1 at 3x and 5x, and the same at half its KV."""

    START, FLOOR, FALL, RISE = 0.3, 0.0, 0.002, 0.05

    def __init__(self) -> None:
        self.share = self.START
        self._seen = 0  # preemptions counted so far

    def step(self, preemptions: int) -> None:
        """After a micro-batch is planned; `preemptions`: the planner's count so far."""
        if preemptions > self._seen:
            self._seen, self.share = preemptions, min(1.0, self.share + self.RISE)
        else:
            self.share = max(self.FLOOR, self.share - self.FALL)
