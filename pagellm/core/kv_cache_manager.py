"""The scheduler's only view of KV memory: block tables per request, allocation, prefix reuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.core.block_pool import BlockPool
from pagellm.core.prefix_hash import ROOT_HASH, BlockHash, hash_full_blocks
from pagellm.request import Request


@dataclass
class BlockCopies:
    """Block moves the runner performs before a step's forward, in this order."""

    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    cow: list[tuple[int, int]] = field(default_factory=list)  # (src device block, dst device block)

    def __bool__(self) -> bool:
        return bool(self.swap_out or self.swap_in or self.cow)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Device blocks in `pool`; optional host blocks in `host_pool` for swap preemption.

    Data movement is only planned here: `take_copies()` hands the runner the block copies (copy-on-write,
    swap out to host, swap in from host) to perform before the step's forward pass."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False, num_host_blocks: int = 0):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None
        self.req_blocks: dict[str, list[int]] = {}
        self.req_host_blocks: dict[str, list[int]] = {}  # swapped-out requests
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self.prefix_queries = 0  # tokens looked up
        self.prefix_hits = 0  # tokens found
        self.num_cow_copies = 0
        self._copies = BlockCopies()

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
        if not self._looks_up(req) or req.request_id in self.req_blocks or req.request_id in self.req_host_blocks:
            return [], 0
        hashes = self._hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit = []
        for h in hashes[:max_blocks]:
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hit.append(block_id)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, req: Request, num_hit_tokens: int) -> None:
        """Counts a lookup in the hit-rate statistics once its request was admitted: a request that waits
        looks up again at every step, and counting each attempt had overstated queries and hits."""
        if self._looks_up(req):
            self.prefix_queries += req.num_tokens
            self.prefix_hits += num_hit_tokens

    def _looks_up(self, req: Request) -> bool:
        # Prompt logprobs need the logits of every prompt position, which cached KV does not keep: such a
        # request recomputes its prompt (and still publishes its blocks for others).
        return self.enable_caching and not (req.params.prompt_logprobs is not None and not req.output_token_ids)

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make the block table cover num_computed_tokens (+ prefix hit) + num_new_tokens tokens.
        Returns the newly allocated block ids, or None (and changes nothing) if memory is short."""
        computed_blocks = computed_blocks or []
        if req.request_id in self.req_host_blocks:
            return self._swap_in(req, num_new_tokens)
        blocks = self.req_blocks.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        needed = max(needed, 0)
        # The first write lands in a partially filled block; if a fork shares it, copy it first.
        cow = num_new_tokens > 0 and num_computed % self.block_size != 0 and \
            self.pool.ref_cnt[blocks[num_computed // self.block_size]] > 1
        revived = sum(1 for b in computed_blocks if self.pool.is_free(b))
        if needed + revived + cow > self.pool.num_free:
            return None
        self.pool.touch(computed_blocks)
        new = self.pool.allocate(needed)
        blocks = blocks + computed_blocks + new
        if cow:
            i = num_computed // self.block_size
            [dst] = self.pool.allocate(1)
            self._copies.cow.append((blocks[i], dst))
            self.pool.free([blocks[i]])
            blocks[i] = dst
            self.num_cow_copies += 1
        self.req_blocks[req.request_id] = blocks
        return new

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Give `child` the parent's blocks holding its first `num_tokens` tokens, shared (ref counted).
        A partially filled shared block is copied on the first write (see allocate_slots)."""
        shared = self.req_blocks[parent.request_id][:cdiv(num_tokens, self.block_size)]
        self.pool.touch(shared)
        self.req_blocks[child.request_id] = list(shared)

    def swap_out(self, req: Request) -> bool:
        """Move the request's KV to host blocks (planned copies); False if the host pool is too small."""
        blocks = self.req_blocks.get(req.request_id, [])
        if self.host_pool is None or not blocks or len(blocks) > self.host_pool.num_free:
            return False
        host = self.host_pool.allocate(len(blocks))
        self._copies.swap_out.extend(zip(blocks, host, strict=True))
        self.req_host_blocks[req.request_id] = host
        self.pool.free(list(reversed(self.req_blocks.pop(req.request_id))))
        return True

    def _swap_in(self, req: Request, num_new_tokens: int) -> list[int] | None:
        host = self.req_host_blocks[req.request_id]
        total = max(len(host), cdiv(req.num_computed_tokens + num_new_tokens, self.block_size))
        if total > self.pool.num_free:
            return None
        blocks = self.pool.allocate(total)
        self._copies.swap_in.extend(zip(host, blocks, strict=False))
        self.host_pool.free(list(reversed(self.req_host_blocks.pop(req.request_id))))
        self.req_blocks[req.request_id] = blocks
        return blocks

    def is_swapped(self, req: Request) -> bool:
        return req.request_id in self.req_host_blocks

    def take_copies(self) -> BlockCopies:
        copies, self._copies = self._copies, BlockCopies()
        return copies

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
        host = self.req_host_blocks.pop(req.request_id, None)
        if host:
            self.host_pool.free(list(reversed(host)))
        self._req_hashes.pop(req.request_id, None)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_cache()

    def _hashes(self, req: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended incrementally as tokens are added."""
        hashes = self._req_hashes.setdefault(req.request_id, [])
        if len(hashes) < req.num_tokens // self.block_size:
            parent = hashes[-1] if hashes else ROOT_HASH
            extra = (req.cache_salt,) if req.cache_salt else ()
            hashes += hash_full_blocks(req.all_token_ids, self.block_size, len(hashes), parent, extra)
        return hashes
