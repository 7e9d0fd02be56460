"""The pool of KV cache blocks: reference counts, an LRU free queue and the prefix-cache index.

A block whose last user finished keeps its contents and its hash while it sits in the free queue,
so a later request with the same prefix can take it back ("touch") instead of recomputing it.
Allocation pops from the front of the queue (least recently freed first) and evicts the popped
block's hash, which is the LRU eviction of cached blocks.
"""

from __future__ import annotations

from collections import OrderedDict


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # NOTE: OrderedDict gives O(1) popleft for allocation and O(1) removal from the middle
        # when a cached block is touched again, which a deque cannot.
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[bytes, KVBlock] = {}
        self.hits = 0
        self.queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take references on cached blocks that a new request shares."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop references; pass blocks tail first so the tail of a sequence is evicted first."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full, computed block under its chained hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; blocks in use keep their contents but can no longer be shared."""
        n = len(self.cached)
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return n

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None
