"""SchedulerOutput -> flat input tensors -> one forward over the mixed batch -> logits rows.

The runner owns the KV cache (allocated by the platform) and, where the platform offers one, a compiled
few-row forward (the CPU's one-call native decoder) that it uses instead of the module path for steps it
serves. Sampling happens after, in pagellm/sample.
"""

from __future__ import annotations

import torch

from pagellm.core.kv_cache_manager import BlockCopies
from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.model.attention import AttentionBackend, AttentionMetadata
from pagellm.quant.kv_cache import kv_row_width
from pagellm.request import Request
from pagellm.sample.prompt_logprobs import PromptLogprobRow, prompt_logprob_rows

# Prompt positions whose logits are materialized at once: 128 x 49,152 float32 logits is 24 MiB.
_PROMPT_LOGITS_ROWS = 128


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, platform, num_host_blocks: int = 0):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sliding_window = cfg.sliding_window
        # The last dimension is head_dim, or head_dim + 2 for int8 rows with their in-band scale, so every
        # block copy below (swap, copy-on-write) carries the scales with the values.
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, kv_row_width(cfg.head_dim, kv_dtype))
        self.kv_caches = [platform.allocate_kv(shape, kv_dtype) for _ in range(cfg.num_hidden_layers)]
        # Swap space: one host tensor for all layers, [layers, 2, host_blocks, block_size, kv_heads, row width].
        host_shape = (cfg.num_hidden_layers, 2, num_host_blocks, *shape[2:])
        self.host_cache = platform.allocate_swap(host_shape, kv_dtype) if num_host_blocks else None
        # Built once the weights are final (they are: the loader ran); holds raw pointers into the model.
        self.compiled_decoder = platform.compile_decoder(model, backend.name, kv_dtype)

    def _prepare(self, out: SchedulerOutput):
        # Plain Python lists, one tensor each: a decode step has a handful of rows, and a dozen small
        # torch ops here cost more than the lists (~0.25 ms of a ~9 ms single-stream step).
        ids, positions, slots, row_req, starts, seq_lens = [], [], [], [], [0], []
        bs = self.block_size
        for i, s in enumerate(out.scheduled):
            start = s.request.num_computed_tokens
            end = start + s.num_new_tokens
            ids.extend(s.request.all_token_ids[start:end])
            ids.extend(s.spec_token_ids)  # drafts to verify sit after the known tokens
            positions.extend(range(start, end))
            slots.extend(s.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            row_req.extend([i] * s.num_new_tokens)
            starts.append(starts[-1] + s.num_new_tokens)
            seq_lens.append(end)
        max_blocks = max(len(s.block_ids) for s in out.scheduled)
        table = [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in out.scheduled]

        def tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        pos = tensor(positions)
        meta = AttentionMetadata(
            slot_mapping=tensor(slots), block_tables=tensor(table), query_start_loc=starts, seq_lens=seq_lens,
            block_size=bs, sliding_window=self.sliding_window, row_seq=tensor(row_req), positions=pos)
        return tensor(ids), pos, meta

    @torch.inference_mode()
    def forward_hidden(self, out: SchedulerOutput) -> tuple[torch.Tensor, AttentionMetadata]:
        """One forward over the step's batch (block copies first): final normed hidden states [T, hidden],
        the rows of each request contiguous, in batch order (meta.query_start_loc)."""
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        input_ids, positions, meta = self._prepare(out)
        compiled = self.compiled_decoder
        if compiled is not None and compiled.serves(input_ids.shape[0], meta.query_start_loc):
            return compiled.forward(input_ids, positions, self.kv_caches, meta), meta
        return self.model(input_ids, positions, self.kv_caches, meta, self.backend), meta

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """One forward over the step's batch; logits [rows, vocab] for the requests that sample, in
        batch order, 1 + len(spec_token_ids) rows each (the positions that score drafts, then the next).
        Requests asking for prompt logprobs get them appended to `request.prompt_logprob_rows`."""
        if out.is_empty:
            if out.block_copies:
                self._copy_blocks(out.block_copies)
            return [], torch.empty(0)
        hidden, meta = self.forward_hidden(out)
        if any(_wants_prompt_logprobs(s.request) for s in out.scheduled):
            self._prompt_logprobs(out, hidden, meta)
        sampling = [(i, s) for i, s in enumerate(out.scheduled) if s.samples]
        rows = [r for i, s in sampling
                for r in range(meta.query_start_loc[i + 1] - 1 - len(s.spec_token_ids), meta.query_start_loc[i + 1])]
        if not rows:
            return [], torch.empty(0)
        hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        return [s for _, s in sampling], self.model.compute_logits(hidden)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor, meta: AttentionMetadata) -> None:
        """Logits of this chunk's prompt positions, in the same forward as the prefill. Position p scores
        prompt token p + 1; the last prompt position scores the first output token (the sampler's row).
        Rows already computed are skipped, so a request recomputed after preemption never gets them twice;
        once a request has output tokens its rows are complete (forks and beams start past the prompt)."""
        wanted: list[tuple[Request, int, int]] = []  # (request, first position, end position)
        rows: list[int] = []
        for i, s in enumerate(out.scheduled):
            req = s.request
            if not _wants_prompt_logprobs(req) or req.output_token_ids:
                continue
            start = req.num_computed_tokens
            first = len(req.prompt_logprob_rows)
            end = min(start + s.num_new_tokens, req.num_prompt_tokens - 1)
            if first < start or first >= end:  # nothing new, or KV came from elsewhere (no logits for it)
                continue
            wanted.append((req, first, end))
            rows.extend(range(meta.query_start_loc[i] + first - start, meta.query_start_loc[i] + end - start))
        if not rows:
            return
        index = torch.tensor(rows, device=self.device)
        next_ids = torch.tensor([t for req, first, end in wanted for t in req.prompt_token_ids[first + 1:end + 1]],
                                device=self.device)
        top_n = [req.params.prompt_logprobs for req, _, _ in wanted]
        results: list[PromptLogprobRow] = []
        k = max(top_n)
        for lo in range(0, len(rows), _PROMPT_LOGITS_ROWS):  # bounds the [rows, vocab] float32 buffers
            sl = slice(lo, lo + _PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden.index_select(0, index[sl]))
            results.extend(prompt_logprob_rows(logits, next_ids[sl], k))
        pos = 0
        for (req, first, end), n in zip(wanted, top_n, strict=True):
            req.prompt_logprob_rows.extend(
                r if n == k else r._replace(top_ids=r.top_ids[:n], top_logprobs=r.top_logprobs[:n])
                for r in results[pos:pos + end - first])
            pos += end - first

    def _copy_blocks(self, copies: BlockCopies) -> None:
        """Swap out, swap in, then copy-on-write, all before the forward writes any new KV."""
        if copies.swap_out:
            dev, host = (torch.tensor(x) for x in zip(*copies.swap_out, strict=True))
            for layer, cache in enumerate(self.kv_caches):
                self.host_cache[layer][:, host] = cache[:, dev.to(self.device)].cpu()
        if copies.swap_in:
            host, dev = (torch.tensor(x) for x in zip(*copies.swap_in, strict=True))
            dev = dev.to(self.device)
            for layer, cache in enumerate(self.kv_caches):
                cache[:, dev] = self.host_cache[layer][:, host].to(self.device, non_blocking=True)
        if copies.cow:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*copies.cow, strict=True))
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]


def _wants_prompt_logprobs(req) -> bool:
    # A draft model's runner sees its own sequence objects, never the user's Request: no prompt logprobs.
    return isinstance(req, Request) and req.params.prompt_logprobs is not None
