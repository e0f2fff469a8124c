"""The step a GPU engine profiles before sizing its KV cache: the biggest batch the scheduler can send.

One forward over `num_tokens` prompt tokens (max_num_batched_tokens: whole prompts of at most max_len
tokens from position 0, the widest attention), the logits of the rows a step samples and a sampling pass
over them (top-p on float32 copies of those logits: the sampler's temporaries). The caller measures the
peak of what torch allocates (Platform.peak_memory_of); whatever the device has left after the weights
and that peak holds KV blocks (engine/gpu_memory.py). The KV it writes goes to a small throwaway cache.
"""

from __future__ import annotations

import torch

from pagellm.model.attention import AttentionBackend, AttentionMetadata
from pagellm.model.cuda_graphs import length_tensors
from pagellm.quant.kv_cache import kv_row_width
from pagellm.sample.sampler import Sampler, SamplingRow
from pagellm.sampling_params import SamplingParams


def profile_seq_lens(num_tokens: int, max_len: int) -> list[int]:
    """num_tokens split into whole prompts of at most max_len tokens (positions must stay below it)."""
    full, rest = divmod(num_tokens, max_len)
    return [max_len] * full + ([rest] if rest else [])


def profile_kv_caches(model, block_size: int, kv_dtype: torch.dtype, seq_lens: list[int], allocate) -> list:
    """A cache per layer with just the blocks the profiling batch writes."""
    cfg = model.config
    start, end = model.layer_range
    kv_heads = model.layers[start].self_attn.num_kv_heads
    blocks = sum(-(-n // block_size) for n in seq_lens)
    shape = (2, blocks, block_size, kv_heads, kv_row_width(cfg.head_dim, kv_dtype))
    return [allocate(shape, kv_dtype) for _ in range(end - start)]


@torch.inference_mode()
def profile_step(model, backend: AttentionBackend, kv_caches: list[torch.Tensor], block_size: int,
                 seq_lens: list[int], sample_rows: int, device: torch.device) -> None:
    ids, positions, slots, starts, tables, first = [], [], [], [0], [], 0
    vocab = model.config.vocab_size
    for n in seq_lens:
        blocks = list(range(first, first + -(-n // block_size)))
        first += len(blocks)
        ids.extend(p % vocab for p in range(n))  # any tokens: the cost does not depend on which
        positions.extend(range(n))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(n))
        starts.append(starts[-1] + n)
        tables.append(blocks)
    width = max(len(t) for t in tables)

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=device)

    pos = tensor(positions)
    meta = AttentionMetadata(
        slot_mapping=tensor(slots), block_tables=tensor([t + [0] * (width - len(t)) for t in tables]),
        query_start_loc=starts, seq_lens=seq_lens, block_size=block_size,
        sliding_window=model.config.sliding_window,
        row_seq=tensor([i for i, n in enumerate(seq_lens) for _ in range(n)]), positions=pos,
        **length_tensors(tensor(starts, torch.int32), tensor(seq_lens, torch.int32)))
    hidden = model(tensor(ids), pos, kv_caches, meta, backend)
    rows = min(sample_rows, hidden.shape[0])
    logits = model.compute_logits(hidden[-rows:])
    del hidden
    params = SamplingParams(temperature=1.0, top_p=0.9)
    Sampler([])(logits, [SamplingRow(params, [], [], None)] * rows)
