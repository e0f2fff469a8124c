"""Paged attention through the native CPU kernel: each query row reads its request's KV blocks in
place (no gather into a padded copy), all rows of the step in one call, parallel over rows and heads.

Requests with many new rows (long prefill chunks) go elsewhere: the kernel scores one query row at a time,
which flash attention's blocking beats once rows are many. Under `--dtype auto` (`bf16_prefill`, the platform's
choice) they attend in bf16: through the own bf16 flash-attention kernel ("kernel": its products on AMX tiles
where the CPU has them, 1.4-2.0x faster than torch's bf16 SDPA over the gathered cache on the Xeon VM at 512-2,048
tokens, benchmarks/microbench_prefill_attention.py; with AVX-512 BF16 alone on `vdpbf16ps`, 3-5x torch's float32
SDPA on a 2,048-token prompt, benchmarks/NOTES.md), or, on an AMX CPU whose build lacks the tile kernel, through
torch's SDPA on bf16 inputs ("sdpa": oneDNN's AMX tiles); otherwise (None) through the reference SDPA path in
float32.
"""

from __future__ import annotations

import torch

from pagellm.kernels import ops
from pagellm.model.attention.base import AttentionBackend, AttentionMetadata
from pagellm.model.attention.torch_sdpa_reference import TorchSdpaReferenceAttention

# Under "sdpa", requests attending to fewer keys than this take the own kernel where the build has it (the Xeon
# VM, per layer: 128 x 128 0.28 vs 0.22 ms, 256 x 256 0.71 vs 0.66, 384 x 384 0.75 vs 1.28;
# benchmarks/microbench_prefill_attention.py's "path" columns)
SDPA_MIN_KEYS = 256


class CpuPagedAttention(AttentionBackend):
    name = "cpu_paged"
    max_native_queries = ops.PAGED_ATTENTION_MAX_QUERIES  # new rows per request up to which the kernel serves it

    def __init__(self, bf16_prefill: str | None = None, paged_prompts: bool = False):
        self._reference = TorchSdpaReferenceAttention()
        self.bf16_prefill = bf16_prefill  # "sdpa", "kernel" or None (platforms/cpu.py bf16_prefill_attention)
        self.paged_prompts = paged_prompts  # marked prompt chunks through this kernel (_paged_prompts)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        if q.shape[-1] % 8:  # the kernel works in 8-float vectors (the platform chose it for the dtypes)
            return self._reference.forward(q, k, v, kv_cache, meta, scale)
        ops.write_kv(k, v, kv_cache, meta.slot_mapping)
        starts = meta.query_start_loc
        drafts = meta.query_drafts
        # (a verification request's drafts do not count: its rows get the decode kernel, as in plain decoding,
        # however many drafts it has; a chunk of a prompt takes the bf16 prompt kernel at any row count, so that
        # its rows get the same bits however the prompt was chunked)
        prompt, paged = self._prompt_marks(meta), self._paged_prompts(meta)

        def many_rows(i: int) -> bool:
            return starts[i + 1] - starts[i] - (drafts[i] if drafts else 0) > self.max_native_queries

        long = [i for i in range(meta.num_reqs)
                if (prompt and prompt[i]) or (many_rows(i) and not (paged and paged[i]))]
        if not long:
            return ops.paged_attention(q, kv_cache, meta.block_tables, meta.row_seq, meta.positions,
                                       meta.sliding_window, scale)
        out = self._long_requests(q, kv_cache, meta, scale, long)
        short = [r for i in range(meta.num_reqs) if i not in long for r in range(starts[i], starts[i + 1])]
        if short and short[-1] - short[0] == len(short) - 1 and out.dtype == torch.float32 and out.is_contiguous():
            # one run of rows (the scheduler puts the decodes first): read and written in place
            a, b = short[0], short[-1] + 1
            ops.paged_attention(q[a:b], kv_cache, meta.block_tables, meta.row_seq[a:b], meta.positions[a:b],
                                meta.sliding_window, scale, out=out[a:b])
        elif short:
            rows = torch.tensor(short)
            o = ops.paged_attention(q.index_select(0, rows), kv_cache, meta.block_tables,
                                    meta.row_seq.index_select(0, rows), meta.positions.index_select(0, rows),
                                    meta.sliding_window, scale)
            out.index_copy_(0, rows, o)
        return out

    def forward_rows(self, q, k, v, kv_cache, meta: AttentionMetadata, scale: float, keep: torch.Tensor):
        """Only the rows `keep` attend (a step's last layer, whose other rows' outputs nobody reads), each over its
        request's keys in the cache through the decode kernel, one query row at a time (a marked prompt's through the
        prompt kernel, as forward gives them): a prefill chunk's last row costs what a decode row does, and the
        chunk's flash attention is not run."""
        if q.shape[-1] % 8:
            return super().forward_rows(q, k, v, kv_cache, meta, scale, keep)
        ops.write_kv(k, v, kv_cache, meta.slot_mapping)
        if not keep.numel():
            return q[:0]
        rows, seqs = q.index_select(0, keep), meta.row_seq.index_select(0, keep)
        positions = meta.positions.index_select(0, keep)
        out = ops.paged_attention(rows, kv_cache, meta.block_tables, seqs, positions, meta.sliding_window, scale)
        prompt = self._prompt_marks(meta)
        if prompt is not None:  # a prompt's kept rows as forward gives them: the prompt kernel, a row at a time
            chunks = [(j, 1, p + 1, i) for j, (i, p) in enumerate(zip(seqs.tolist(), positions.tolist(), strict=True))
                      if prompt[i]]
            if chunks:
                ops.prefill_attention_bf16_batch(rows, kv_cache, meta.block_tables, chunks, scale, out)
        return out

    def _prompt_marks(self, meta: AttentionMetadata) -> list[bool] | None:
        """Which requests' rows are a prompt's chunk that the prompt kernel takes at any row count (the runner's
        marks, AttentionMetadata.query_prompt), where this backend runs that kernel; None where none does."""
        if self.bf16_prefill != "kernel" or meta.sliding_window is not None:
            return None
        return meta.query_prompt

    def _paged_prompts(self, meta: AttentionMetadata) -> list[bool] | None:
        """Which requests' rows are a marked prompt chunk that this kernel takes at any row count, where prompts are
        marked (one-plane int8 prompt rows) but no bf16 prompt kernel runs (AVX2): float32 SDPA's rounding depends
        on the chunk's shape, and int8's rounding of the next products turns such float32-level differences into
        steps of 1/127 (a token's logprob moved ~0.01-0.07 nats between plain and speculative runs, whose prompts
        are chunked apart; 2 of 16 sequences parted: benchmarks/NOTES.md, forty-first session). Row by row, a
        prompt's rows get the same bits however it was chunked. Only where asked (`paged_prompts`: --dtype auto on a
        CPU without bf16 products); an AVX-512 BF16 CPU whose cache the bf16 prompt kernel does not read (fp8) keeps
        SDPA, 2-3x faster there."""
        if not self.paged_prompts or self.bf16_prefill is not None:
            return None
        return meta.query_prompt

    def _long_requests(self, q, kv_cache, meta: AttentionMetadata, scale: float, long: list[int]) -> torch.Tensor:
        """The output rows of the requests in `long` (other rows left unset): the own bf16 kernel for those it
        takes, SDPA for the rest (in bf16 under "sdpa", else in q's dtype)."""
        mode = self.bf16_prefill
        kernel = mode is not None and meta.sliding_window is None  # the kernel has no sliding window
        out = torch.empty_like(q)
        starts = meta.query_start_loc
        # under "sdpa" (AMX) the kernel keeps only requests over few keys: SDPA's gather and casts cost more
        take = [i for i in long if kernel and (mode == "kernel" or meta.seq_lens[i] < SDPA_MIN_KEYS)]
        # all in one call, written in place (a shape, KV dtype or build the kernel does not take: none)
        chunks = [(starts[i], starts[i + 1] - starts[i], meta.seq_lens[i], i) for i in take]
        if take and ops.prefill_attention_bf16_batch(q, kv_cache, meta.block_tables, chunks, scale, out):
            rest = [i for i in long if i not in take]
        else:
            rest = long
        if not rest:
            return out
        if mode == "sdpa":  # on bf16 copies of q and of the gathered keys and values
            ref = self._reference.attend(q.to(torch.bfloat16), kv_cache, meta, scale, rest).float()
        else:
            ref = self._reference.attend(q, kv_cache, meta, scale, rest)
        if len(rest) == len(long):
            return ref
        for i in rest:
            out[starts[i]:starts[i + 1]] = ref[starts[i]:starts[i + 1]]
        return out
