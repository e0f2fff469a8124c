"""Unified paged attention: a flat batch of prefill chunks and decodes in one launch.

Request i owns query rows query_start_loc[i]:query_start_loc[i + 1] and attends to its seq_lens[i] keys
through block_tables[i]; query j of its n queries sits at position seq_len - n + j (causal), optionally
seeing only keys in (position - window, position]. One program takes BLOCK_Q queries of one request and
all the query heads that share one KV head (GQA packed into the rows), walks the request's keys in tiles
of TILE_N (each key finds its block through the block table, so tiles need not match blocks) and keeps a
FlashAttention-style online softmax in float32.

All metadata is read from device tensors and the grid depends only on shapes (T query rows, B requests),
so a launch can be captured in a CUDA graph. With num_splits > 1 (flash-decoding) each program covers one
slice of the keys and a second kernel merges the slices' partial softmax sums.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagellm.kernels.triton.kv_write import cast_to

MAX_HEAD_DIM = 256
READABLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
# The running max starts here, not at -inf, so a row with no key yet never computes inf - inf. (Kernels may
# read module globals only if they are constexpr.)
MASKED = tl.constexpr(-1.0e30)


@triton.jit
def request_of_tile(query_start_loc, num_reqs, tile, BLOCK_Q: tl.constexpr):
    """Request i's query tiles are numbered from query_start_loc[i] // BLOCK_Q + i on: strictly increasing
    in i, with room for its ceil(n_i / BLOCK_Q) tiles. The grid then needs only T // BLOCK_Q + B programs,
    a number known from shapes, and each program finds its request by binary search."""
    lo: tl.int32 = 0  # typed: loop-carried values must keep one type (num_reqs == 1 comes as a constant)
    hi: tl.int32 = num_reqs
    while hi - lo > 1:  # invariant: the answer is in [lo, hi)
        mid = (lo + hi) // 2
        if tl.load(query_start_loc + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def paged_attention_kernel(
    out, q, cache, block_tables, seq_lens, query_start_loc, partial_acc, partial_ml,
    scale_log2, num_reqs, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_half, stride_block, stride_slot, stride_head, stride_table,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    D_PAD: tl.constexpr, TILE_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = request_of_tile(query_start_loc, num_reqs, tile, BLOCK_Q)
    q_start = tl.load(query_start_loc + req)
    num_queries = tl.load(query_start_loc + req + 1) - q_start
    first_query = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_query >= num_queries:  # a spare program of the grid's upper bound
        return
    seq_len = tl.load(seq_lens + req)
    context = seq_len - num_queries  # keys cached before this step's queries

    rows = tl.arange(0, BLOCK_M)
    query = first_query + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (rows // GROUP_PAD < BLOCK_Q) & (query < num_queries) & (rows % GROUP_PAD < GROUP)
    position = context + query
    dims = tl.arange(0, D_PAD)
    dim_ok = dims < head_dim
    q_rows = (q_start + query).to(tl.int64)
    q_tile = tl.load(q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                     mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q_tile = q_tile.to(tl.float32)
    dot_dtype = q_tile.dtype  # both products take their operands in q's dtype (16-bit: the tensor cores)

    # The keys any row of this tile sees (the start rounded down to a multiple of TILE_N, so that tiles and
    # blocks line up), then this program's slice of them.
    key_end = context + tl.minimum(first_query + BLOCK_Q, num_queries)
    key_begin = 0
    if HAS_WINDOW:
        key_begin = tl.maximum(context + first_query - window + 1, 0) // TILE_N * TILE_N
    if NUM_SPLITS > 1:
        split = tl.program_id(2)
        tiles_per_split = tl.cdiv(tl.cdiv(key_end - key_begin, TILE_N), NUM_SPLITS)
        key_begin = key_begin + split * tiles_per_split * TILE_N
        key_end = tl.minimum(key_end, key_begin + tiles_per_split * TILE_N)

    m = tl.full([BLOCK_M], MASKED, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = block_tables + req.to(tl.int64) * stride_table
    kv_base = cache + kv_head * stride_head
    for tile_start in range(key_begin, key_end, TILE_N):
        keys = tile_start + tl.arange(0, TILE_N)
        key_ok = keys < key_end  # never past seq_len: block table padding and stale slots are not read
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        offset = block * stride_block + (keys % BLOCK_SIZE) * stride_slot
        load_mask = key_ok[:, None] & dim_ok[None, :]
        k_tile = tl.load(kv_base + offset[:, None] + dims[None, :], mask=load_mask, other=0.0)
        v_tile = tl.load(kv_base + stride_half + offset[:, None] + dims[None, :], mask=load_mask, other=0.0)

        scores = tl.dot(q_tile, tl.trans(k_tile.to(dot_dtype)), input_precision=DOT_PRECISION) * scale_log2
        seen = key_ok[None, :] & (keys[None, :] <= position[:, None])
        if HAS_WINDOW:
            seen = seen & (keys[None, :] > position[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        rescale = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        denom = denom * rescale + tl.sum(p, axis=1)
        acc = acc * rescale[:, None] + tl.dot(p.to(dot_dtype), v_tile.to(dot_dtype), input_precision=DOT_PRECISION)
        m = m_new

    if NUM_SPLITS == 1:
        result = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 cast_to(result, out.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # scratch [T, H, NUM_SPLITS, D_PAD] and [T, H, NUM_SPLITS, 2], contiguous
        slot = (q_rows * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        tl.store(partial_acc + slot[:, None] * D_PAD + dims[None, :], acc, mask=row_ok[:, None])
        tl.store(partial_ml + slot * 2, m, mask=row_ok)
        tl.store(partial_ml + slot * 2 + 1, denom, mask=row_ok)


@triton.jit
def merge_splits_kernel(out, partial_acc, partial_ml, query_start_loc, num_reqs, stride_ot, stride_oh, head_dim,
                        NUM_SPLITS: tl.constexpr, D_PAD: tl.constexpr):
    """One (query row, head): the splits' partial sums rescaled to their common max and added."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if row >= tl.load(query_start_loc + num_reqs):  # a row of no request: its scratch was never written
        return
    slot = (row * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, D_PAD)
    m = tl.load(partial_ml + slot * 2)
    weight = tl.exp2(m - tl.max(m, axis=0))
    denom = tl.sum(tl.load(partial_ml + slot * 2 + 1) * weight, axis=0)
    acc = tl.sum(tl.load(partial_acc + slot[:, None] * D_PAD + dims[None, :]) * weight[:, None], axis=0)
    result = acc / tl.where(denom > 0, denom, 1.0)
    tl.store(out + row * stride_ot + head * stride_oh + dims, cast_to(result, out.dtype.element_ty),
             mask=dims < head_dim)


def is_interpreted(kernel) -> bool:
    return not isinstance(kernel, triton.runtime.JITFunction)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, sliding_window: int | None = None, *,
                    out: torch.Tensor | None = None, block_q: int | None = None, tile_n: int | None = None,
                    num_splits: int = 1) -> torch.Tensor:
    """q: [T, H, D] (float32/float16/bfloat16, last dim contiguous); kv_cache: [2, num_blocks, block_size,
    KV, D] (float or fp8); block_tables: [B, max_blocks] int32/int64; seq_lens: [B] int32; query_start_loc:
    [B + 1] int32. Returns out [T, H, D] in q's dtype; rows past query_start_loc[B] are left as they were.

    block_q: queries per program (default: 1 when every request has one query, i.e. T == B, else enough
    to fill 64 rows with the packed heads, 32 for float32); tile_n: keys per inner step (a power of two
    >= 16; default 32, 16 for float32);
    num_splits: slices of the keys per query tile (a power of two; > 1 pays for long decodes)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv, num_reqs = kv_cache.shape[3], seq_lens.shape[0]
    # Sizes chosen so that ptxas reports no register spills for head_dim 128 on sm_80 (not timed on a GPU):
    # float32 products (exact, not TF32) take more registers than the 16-bit ones on the tensor cores.
    wide = q.dtype == torch.float32
    tile_n = tile_n or (16 if wide else 32)
    check_shapes(q, kv_cache, block_tables, seq_lens, query_start_loc, tile_n, num_splits)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv
    group_pad = triton.next_power_of_2(group)
    if block_q is None:
        block_q = 1 if num_tokens == num_reqs else max(1, (32 if wide else 64) // group_pad)
    block_m = max(16, triton.next_power_of_2(block_q * group_pad))  # tl.dot needs 16 rows on a GPU
    d_pad = max(16, triton.next_power_of_2(head_dim))
    grid = (num_tokens // block_q + num_reqs, num_kv, num_splits)
    # The interpreter multiplies bfloat16 dot operands as raw integers (Triton 3.x), so there they are
    # upcast; on a GPU they stay bfloat16 for the tensor cores.
    upcast = q.dtype == torch.bfloat16 and is_interpreted(paged_attention_kernel)
    if num_splits > 1:
        partial_acc = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32, device=q.device)
        partial_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        partial_acc = partial_ml = out  # unused
    paged_attention_kernel[grid](
        out, q, kv_cache, block_tables, seq_lens, query_start_loc, partial_acc, partial_ml,
        scale * math.log2(math.e), num_reqs, sliding_window or 0,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
        head_dim,
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_M=block_m, D_PAD=d_pad, TILE_N=tile_n,
        BLOCK_SIZE=kv_cache.shape[2], HAS_WINDOW=sliding_window is not None, NUM_SPLITS=num_splits,
        UPCAST_DOT=upcast, DOT_PRECISION="ieee" if wide or upcast else None,  # not TF32
        num_warps=8 if block_m >= 64 else 4,
    )
    if num_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            out, partial_acc, partial_ml, query_start_loc, num_reqs, out.stride(0), out.stride(1), head_dim,
            NUM_SPLITS=num_splits, D_PAD=d_pad)
    return out


def check_shapes(q, kv_cache, block_tables, seq_lens, query_start_loc, tile_n, num_splits):
    num_tokens, num_heads, head_dim = q.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != head_dim:
        raise ValueError(f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, {head_dim}] for q "
                         f"{tuple(q.shape)}, got {tuple(kv_cache.shape)}")
    if kv_cache.dtype not in READABLE_DTYPES or q.dtype not in READABLE_DTYPES[:3]:
        raise ValueError(f"Triton paged attention reads float32/float16/bfloat16/fp8 caches with a float32/float16/"
                         f"bfloat16 q, got cache {kv_cache.dtype}, q {q.dtype}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim {head_dim} is over the Triton kernel's limit of {MAX_HEAD_DIM}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_cache.shape[3]}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables must be contiguous in their last dimension")
    if not (seq_lens.is_contiguous() and query_start_loc.is_contiguous()):
        raise ValueError("seq_lens and query_start_loc must be contiguous")
    if seq_lens.dtype != torch.int32 or query_start_loc.dtype != torch.int32:
        raise ValueError(f"seq_lens and query_start_loc must be int32 tensors, got {seq_lens.dtype}, "
                         f"{query_start_loc.dtype}")
    if query_start_loc.shape[0] != seq_lens.shape[0] + 1 or block_tables.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"{seq_lens.shape[0]} seq_lens need {seq_lens.shape[0] + 1} query_start_loc entries "
                         f"and as many block table rows, got {query_start_loc.shape[0]} and {block_tables.shape[0]}")
    for name, n in (("tile_n", tile_n), ("num_splits", num_splits)):
        if n < 1 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two, got {n}")
    if tile_n < 16:
        raise ValueError(f"tile_n must be at least 16 (tl.dot's minimum), got {tile_n}")
