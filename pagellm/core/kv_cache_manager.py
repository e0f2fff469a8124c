"""The scheduler's only view of KV memory: block tables per request, allocation, prefix reuse."""

from __future__ import annotations

from pagellm.core.block_pool import BlockPool
from pagellm.core.prefix_hash import ROOT_HASH, BlockHash, hash_full_blocks
from pagellm.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> float:
        """Fraction of blocks held by live requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached chain of full blocks for a request that holds none yet.
        The last token is always left to compute, so its logits exist."""
        if not self.enable_caching or req.request_id in self.req_blocks:
            return [], 0
        hashes = self._hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for h in hashes[:max_blocks]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hit.append(block_id)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hit) * self.block_size
        return hit, len(hit) * self.block_size

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make the block table cover num_computed_tokens (+ prefix hit) + num_new_tokens tokens.
        Returns the newly allocated block ids, or None (and changes nothing) if memory is short."""
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        needed = max(needed, 0)
        revived = sum(1 for b in computed_blocks if self.pool.is_free(b))
        if needed + revived > self.pool.num_free:
            return None
        self.pool.touch(computed_blocks)
        new = self.pool.allocate(needed)
        self.req_blocks[req.request_id] = blocks + computed_blocks + new
        return new

    def cache_full_blocks(self, req: Request) -> None:
        """Publish the request's full, computed blocks in the prefix cache."""
        if not self.enable_caching:
            return
        blocks = self.req_blocks.get(req.request_id)
        if not blocks:
            return
        hashes = self._hashes(req)
        num_full = min(req.num_computed_tokens // self.block_size, len(hashes), len(blocks))
        for i in range(num_full):
            self.pool.cache(blocks[i], hashes[i])

    def free(self, req: Request) -> None:
        blocks = self.req_blocks.pop(req.request_id, None)
        if blocks:
            self.pool.free(list(reversed(blocks)))
        self._req_hashes.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()

    def _hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens are added."""
        hashes = self._req_hashes.setdefault(req.request_id, [])
        if len(hashes) < req.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else ROOT_HASH
            salt = getattr(req.params, "cache_salt", None)
            extra = (salt,) if salt else ()
            hashes += hash_full_blocks(req.all_token_ids, self.block_size, len(hashes), parent, extra)
        return hashes
