"""Per-request KV block bookkeeping on top of the BlockPool, with prefix caching.

Block hashes are chained: hash(parent hash, cache salt on the first block, the block's token ids),
so two requests share a block only if everything before it matches too. The hash is a keyed-free
BLAKE2b digest rather than Python's ``hash()``: a collision would silently hand one user another
user's KV, and crafted collisions against a 64-bit non-cryptographic hash are practical.
"""

from __future__ import annotations

import hashlib
from array import array

from shm_engine.engine.block_pool import BlockPool, KVBlock
from shm_engine.engine.request import Request


def hash_block(parent: bytes | None, token_ids: list[int], salt: str | None) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    # NOTE: a tag byte keeps the three kinds of prefix apart: a 16-byte salt must never hash
    # like a parent digest (a salted first block equal to another chain's later block).
    if parent is not None:
        h.update(b"\x01" + parent)
    elif salt:
        h.update(b"\x02" + salt.encode())
    else:
        h.update(b"\x00")
    h.update(array("i", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_published: dict[str, int] = {}  # leading blocks cache_computed already did

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def update_block_hashes(self, req: Request) -> None:
        """Hash every full block of the request's known tokens that is not hashed yet."""
        if not self.enable_caching:
            return
        bs = self.block_size
        hashes = req.block_hashes
        tokens = req.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs], req.cache_salt))

    def find_cached_prefix(self, req: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached blocks matching the request's prefix.

        At least one token is always left to compute, since the model must produce logits for
        the last prompt token; with prompt logprobs, every position whose logits are still owed.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(req)
        limit = req.num_tokens - 1
        if req.prompt_logprobs is not None:
            limit = min(limit, req.num_prompt_scored)
        max_blocks = limit // self.block_size
        hits: list[KVBlock] = []
        for block_hash in req.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def count_prefix_lookup(self, req: Request, num_hit: int) -> None:
        """Prefix-cache statistics, counted once per admission (a request that waits for free
        blocks looks its prefix up again every step). As vLLM's: no lookups without caching,
        and none for a prompt-logprobs request (its prompt is computed, not read from cache)."""
        if not self.enable_caching or req.prompt_logprobs is not None:
            return
        self.pool.queries += req.num_tokens
        self.pool.hits += num_hit

    def blocks_to_allocate(self, req: Request, num_new_tokens: int) -> int:
        """Free blocks ``allocate(req, num_new_tokens)`` would take (no cached prefix)."""
        held = len(self.req_blocks.get(req.request_id, ()))
        return max(0, self.blocks_needed(req.num_computed_tokens + num_new_tokens) - held)

    def allocate(self, req: Request, num_new_tokens: int, prefix: list[KVBlock] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; False if full.

        ``prefix`` are cached blocks found by find_cached_prefix for a request not yet holding any;
        the caller has already counted them in ``req.num_computed_tokens``.
        """
        blocks = self.req_blocks.get(req.request_id)
        held = len(blocks) if blocks is not None else 0
        total = req.num_computed_tokens + num_new_tokens
        needed = self.blocks_needed(total) - held - len(prefix)
        # Cached prefix blocks sitting in the free queue stop being allocatable once touched.
        reclaimed = sum(1 for b in prefix if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - reclaimed:
            return False
        if blocks is None:
            blocks = self.req_blocks[req.request_id] = []
        if prefix:
            self.pool.touch(list(prefix))
            blocks.extend(prefix)
        if needed > 0:
            blocks.extend(self.pool.allocate(needed))
        return True

    def free_surplus(self, req: Request) -> None:
        """Give back the blocks past those the computed tokens fill (taken for draft tokens
        that were rejected: never published, since only known tokens' blocks are)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = self.blocks_needed(req.num_computed_tokens)
        if blocks and len(blocks) > keep:
            surplus = blocks[keep:]
            del blocks[keep:]
            self.pool.free(reversed(surplus))

    def cache_computed(self, req: Request) -> None:
        """Publish the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        self.update_block_hashes(req)
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes), len(blocks))
        # NOTE: only the blocks completed since the last call: looping over all of them every
        # step cost a long sequence O(its length) a step (the largest Python cost of a step).
        rid = req.request_id
        for i in range(self.num_published.get(rid, 0), n_full):
            self.pool.cache(blocks[i], req.block_hashes[i])
        self.num_published[rid] = n_full  # grows while the blocks are held (free() resets it)

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        self.num_published.pop(req.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def block_ids(self, req: Request) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req.request_id, ())]

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_prefix_cache()
