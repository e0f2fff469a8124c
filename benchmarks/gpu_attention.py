"""Attention alone on one CUDA GPU (issue #17: the attention paths "measured against each other, keep what
pays"), at Llama-3 8B's attention shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, a paged cache of
16-token blocks in shuffled order. Two cases: (a) a decode batch, 64 requests x 1,024 keys (one new token
each); (b) one 2,048-token prompt. Run by benchmarks/gpu_check.py in a process of its own
(`gpu_check.py attention --json PATH`), which adds each figure's fraction of the measured limits.

Per path, ms per call (median of CUDA-event timings of a loop of calls) and the achieved rate: decode as KV
bytes read per second (every cached key and value once: what bounds decode), the prompt as causal attention
TFLOP/s (4 x heads x head_dim per (query, key) pair, as gpu_check.workload_flops counts):
- triton_paged: the backend's forward (Triton KV write of the new tokens, one launch of paged attention);
- triton_paged_qkv_fused / triton_paged_qkv_unfused: from the qkv projection's output, forward_qkv with
  rope_write_kv (rotary and KV write in one kernel) against torch's RotaryEmbedding followed by forward;
- torch_sdpa_batched: the backend's forward (torch KV write; decode rows: a gather of their blocks into a
  padded copy, one SDPA call; a prompt: the gather and one causal SDPA, the reference path);
- flex_attention: torch's compiled FlexAttention reading the paged cache in place through a BlockMask built
  from the block table, laid out as vLLM's FlexAttention backend does (all query rows as one sequence, the
  cache's slots as the keys, KV blocks of the cache's 16 slots, a mask_mod from a slot to its request and
  position; query blocks of 16 rows for decode, 128 for the prompt; kernel tiles of those sizes x 16);
  attention only, the mask built once outside the timing (its build time recorded);
- sdpa_dense: SDPA over contiguous K/V of the same sizes (no paging, no write): what a paged kernel aims at.
Each path's output is compared with torch_sdpa_batched's (max_abs_diff, bf16). A path that fails records its
error string and the others still run; the JSON is rewritten after every path (a timeout keeps what ran).
"""

from __future__ import annotations

import inspect
import json
import time
import traceback

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
CASES = {"decode_64x1024": ([1] * 64, [1024] * 64, 16), "prefill_2048": ([2048], [2048], 128)}


def make_case(new: list[int], lens: list[int], device, dtype, seed: int = 0):
    """qkv [T, (H + 2 KV) * D] of the new tokens, their positions, a cache of random keys and values whose blocks
    are shuffled across requests, and the step's metadata."""
    import torch

    from pagellm.model.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    per_req = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_req) + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    pad, owned = perm[0], perm[1:]  # block tables are padded with a block no request owns
    width = max(per_req)
    tables, slots, positions, rows, starts = [], [], [], [], [0]
    for i, (n_new, n, nb) in enumerate(zip(new, lens, per_req, strict=True)):
        blocks, owned = owned[:nb], owned[nb:]
        tables.append(blocks + [pad] * (width - nb))
        positions += range(n - n_new, n)
        slots += [blocks[p // BLOCK] * BLOCK + p % BLOCK for p in range(n - n_new, n)]
        rows += [i] * n_new
        starts.append(starts[-1] + n_new)

    def tensor(values):
        return torch.tensor(values, dtype=torch.int64, device=device)

    torch.manual_seed(seed)
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(dtype)
    qkv = torch.randn(starts[-1], (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=device).to(dtype)
    meta = AttentionMetadata(slot_mapping=tensor(slots), block_tables=tensor(tables), query_start_loc=starts,
                             seq_lens=list(lens), block_size=BLOCK, row_seq=tensor(rows), positions=tensor(positions))
    return qkv, tensor(positions), cache, meta


def split_qkv(qkv):
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    return q.view(-1, HEADS, HEAD_DIM), k.view(-1, KV_HEADS, HEAD_DIM), v.view(-1, KV_HEADS, HEAD_DIM)


def flex_block_mask(meta, positions, q_block: int, num_slots: int, device):
    """A BlockMask over (query rows, cache slots) from the block table: per block of q_block query rows, the
    cache blocks its requests' rows may see (full where every row sees every slot, so the kernel skips the
    mask there), and a mask_mod that maps a slot to its request and position through the inverse table."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    tables = meta.block_tables.tolist()
    num_blocks = num_slots // BLOCK
    owner, logical = [-1] * num_blocks, [0] * num_blocks
    for r, n in enumerate(meta.seq_lens):
        for j in range(-(-n // BLOCK)):
            owner[tables[r][j]], logical[tables[r][j]] = r, j
    row_req = meta.row_seq.tolist()
    row_pos = positions.tolist()
    num_rows = len(row_req)
    kv_partial, kv_full = [], []
    for first in range(0, num_rows, q_block):
        group = range(first, min(first + q_block, num_rows))
        reqs = {row_req[i] for i in group}
        partial, full = [], []
        for r in sorted(reqs):
            mine = [row_pos[i] for i in group if row_req[i] == r]
            for j in range(max(mine) // BLOCK + 1):
                every_row_sees_it = len(reqs) == 1 and len(mine) == len(group) and (j + 1) * BLOCK - 1 <= min(mine)
                (full if every_row_sees_it else partial).append(tables[r][j])
        kv_partial.append(partial)
        kv_full.append(full)

    def indices(lists):  # rows padded to every KV block, as create_block_mask lays them out
        counts = torch.tensor([len(x) for x in lists], dtype=torch.int32, device=device)
        idx = torch.tensor([x + [0] * (num_blocks - len(x)) for x in lists], dtype=torch.int32, device=device)
        return counts[None, None], idx[None, None]

    owner_t = torch.tensor(owner, dtype=torch.int64, device=device)
    logical_t = torch.tensor(logical, dtype=torch.int64, device=device)
    row_req_t, row_pos_t = meta.row_seq, positions

    def mask_mod(b, h, q_idx, kv_idx):
        block = kv_idx // BLOCK
        key_pos = logical_t[block] * BLOCK + kv_idx % BLOCK
        return (owner_t[block] == row_req_t[q_idx]) & (key_pos <= row_pos_t[q_idx])

    kwargs = dict(BLOCK_SIZE=(q_block, BLOCK), mask_mod=mask_mod)
    if any(kv_full):
        kwargs["full_kv_num_blocks"], kwargs["full_kv_indices"] = indices(kv_full)
    params = inspect.signature(BlockMask.from_kv_blocks).parameters
    if "seq_lengths" in params:
        kwargs["seq_lengths"] = (num_rows, num_slots)
    if "compute_q_blocks" in params:  # the backward pass's index, not needed for inference (torch 2.9+)
        kwargs["compute_q_blocks"] = False
    return BlockMask.from_kv_blocks(*indices(kv_partial), **kwargs)


def run_paths(name: str, time_fn, device: str = "cuda", result: dict | None = None, save=lambda: None) -> dict:
    """Every path on one case into `result` (saved after each); `time_fn(fn)` gives seconds per fn() call."""
    import torch
    import torch.nn.functional as F

    from pagellm.model.attention.base import AttentionBackend
    from pagellm.model.attention.selector import get_attention_backend
    from pagellm.model.attention.torch_sdpa_batched import TorchSdpaBatchedAttention
    from pagellm.model.layers.rotary import RotaryEmbedding
    from pagellm.platforms import get_platform

    new, lens, q_block = CASES[name]
    decode = sum(new) == len(lens)
    dtype, scale = torch.bfloat16, HEAD_DIM**-0.5
    qkv, positions, cache, meta = make_case(new, lens, device, dtype)
    q, k, v = split_qkv(qkv)
    rotary = RotaryEmbedding(HEAD_DIM, max(lens) + 1, 500000.0).to(device)  # plain torch: forward_native
    pairs = sum(n_new * (n - n_new) + n_new * (n_new + 1) // 2 for n_new, n in zip(new, lens, strict=True))
    kv_bytes = 2 * sum(lens) * KV_HEADS * HEAD_DIM * cache.element_size()
    flops = 4 * HEADS * HEAD_DIM * pairs
    result = {} if result is None else result
    result.update(requests=len(lens), new_tokens=sum(new), keys_per_request=lens[0], kv_bytes_read=kv_bytes,
                  attention_flops=flops, paths={})
    sdpa = TorchSdpaBatchedAttention()
    baseline = sdpa.forward(q, k, v, cache, meta, scale)

    def record(path: str, setup, reference=None):
        """setup() -> fn; times fn and compares its first output with `reference`; returns that output."""
        entry = result["paths"][path] = {}
        try:
            t = time.perf_counter()
            fn = setup()
            out = fn()
            if device == "cuda":
                torch.cuda.synchronize()
            entry["setup_s"] = round(time.perf_counter() - t, 2)  # compilation and the mask build, if any
            if reference is not None:
                entry["max_abs_diff"] = float((out.float() - reference.float()).abs().max())
            seconds = time_fn(fn)
            entry["ms"] = 1e3 * seconds
            if decode:
                entry["kv_GBps"] = kv_bytes / seconds / 1e9
            else:
                entry["TFLOPs"] = flops / seconds / 1e12
            return out
        except Exception as e:  # a path that fails is a result: its error goes in the JSON, the others run
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            entry["traceback_tail"] = traceback.format_exc()[-2000:]
            return None
        finally:
            save()

    try:
        triton = get_attention_backend("triton_paged", get_platform(device), dtype, dtype)
    except Exception as e:  # no triton here, or a device it refuses
        result["paths"]["triton_paged"] = {"error": f"{type(e).__name__}: {e}"}
        triton = None
    if triton is not None:
        record("triton_paged", lambda: lambda: triton.forward(q, k, v, cache, meta, scale), baseline)

        def from_qkv(fused: bool):
            # on copies: every call rotates qkv in place (the timing does not care at which angle) and writes
            # rotated keys, which the other paths must not read
            buf, kv = qkv.clone(), cache.clone()
            args = (positions, rotary, dtype, HEADS, KV_HEADS, HEAD_DIM, kv, meta, scale)
            if fused:
                return lambda: triton.forward_qkv(buf, *args)
            return lambda: AttentionBackend.forward_qkv(triton, buf, *args)

        unfused = record("triton_paged_qkv_unfused", lambda: from_qkv(False))
        record("triton_paged_qkv_fused", lambda: from_qkv(True), unfused)
    record("torch_sdpa_batched", lambda: lambda: sdpa.forward(q, k, v, cache, meta, scale), baseline)

    def flex_setup():
        from torch.nn.attention.flex_attention import flex_attention

        mask = flex_block_mask(meta, positions, q_block, cache.shape[1] * BLOCK, device)
        keys, values = (cache[i].view(-1, KV_HEADS, HEAD_DIM).permute(1, 0, 2).unsqueeze(0) for i in (0, 1))
        query = q.permute(1, 0, 2).unsqueeze(0)  # [1, H, T, D]: every request's rows as one sequence
        kw = dict(block_mask=mask, scale=scale, enable_gqa=True)
        attend = flex_attention  # eager (a slow reference) off a GPU, to try this code on a CPU
        if device == "cuda":
            attend = torch.compile(flex_attention, fullgraph=True, dynamic=False)
            # kernel tiles within the mask's blocks; the main kernel for decode rows too (vLLM's choice)
            kw["kernel_options"] = {"BLOCK_M": min(q_block, 64), "BLOCK_N": BLOCK, "FORCE_USE_FLEX_ATTENTION": True}
        return lambda: attend(query, keys, values, **kw)[0].permute(1, 0, 2)

    record("flex_attention", flex_setup, baseline)

    def dense_setup():
        b, n = (len(lens), lens[0]) if decode else (1, lens[0])
        keys, values = (torch.randn(b, KV_HEADS, n, HEAD_DIM, device=device).to(dtype) for _ in range(2))
        query = q.reshape(b, -1, HEADS, HEAD_DIM).transpose(1, 2)  # decode [B, H, 1, D]; the prompt [1, H, T, D]
        return lambda: F.scaled_dot_product_attention(query, keys, values, is_causal=not decode, scale=scale,
                                                      enable_gqa=True)

    record("sdpa_dense", dense_setup)  # other keys: nothing to compare with
    return result


def main(json_path: str, time_fn, device: str = "cuda") -> None:
    """Both cases into one JSON at json_path, rewritten as each path finishes."""
    import torch

    report: dict = {"torch": torch.__version__, "shapes": {"heads": HEADS, "kv_heads": KV_HEADS,
                    "head_dim": HEAD_DIM, "block_size": BLOCK, "dtype": "bfloat16"}}

    def save():
        with open(json_path, "w") as f:
            json.dump(report, f, indent=1)

    for name in CASES:
        report[name] = {}
        run_paths(name, time_fn, device, report[name], save)
        if device == "cuda":
            torch.cuda.empty_cache()
