"""Hash chain identifying full KV blocks by everything that precedes them."""

from __future__ import annotations

import hashlib
import struct

BlockHash = bytes

ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: list[int] | tuple[int, ...], extra_keys: tuple = ()) -> BlockHash:
    """sha256 over (parent, tokens, extra): collision-resistant, so a hit never needs a token compare."""
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra_keys:
        h.update(repr(extra_keys).encode())
    return h.digest()


def hash_full_blocks(token_ids: list[int], block_size: int, start_block: int, parent: BlockHash,
                     extra_keys: tuple = ()) -> list[BlockHash]:
    """Hashes of the full blocks from `start_block` on, chained onto `parent`."""
    out = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size:(b + 1) * block_size], extra_keys)
        out.append(parent)
    return out
