"""Physical KV blocks: ref counts, an LRU free queue, and the hash -> block map for prefix reuse."""

from __future__ import annotations

from collections import OrderedDict

from pagellm.core.prefix_hash import BlockHash


class BlockPool:
    """Blocks with ref count 0 sit in `_free` (oldest-freed first); a cached one keeps its hash there
    until it is handed out again, which is what makes eviction lazy."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            out.append(block_id)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on blocks found in the prefix cache (reviving free ones)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self._free[block_id]
            self.ref_cnt[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; blocks reaching 0 join the free queue in the given order, so pass
        a chain tail-first to have its tail evicted before its head."""
        for block_id in block_ids:
            self.ref_cnt[block_id] -= 1
            assert self.ref_cnt[block_id] >= 0, f"block {block_id} freed twice"
            if self.ref_cnt[block_id] == 0:
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> None:
        if self.block_hash[block_id] is not None:
            return
        if block_hash in self._cached:  # same content computed twice concurrently: keep the first
            return
        self.block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def reset_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free != self.num_blocks:
            return False
        self._cached.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def _evict(self, block_id: int) -> None:
        h = self.block_hash[block_id]
        if h is not None:
            self.block_hash[block_id] = None
            if self._cached.get(h) == block_id:
                del self._cached[h]
                self.num_evictions += 1
