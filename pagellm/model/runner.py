"""StepMessage -> flat input tensors -> one forward over the mixed batch -> logits rows (a StepResult).

The runner owns the KV cache of its layers and heads (allocated by the platform), the persistent copy of
every running sequence (`WorkerBatch`: the message brings only what changed) and, where the platform offers
one and the model is whole, a compiled few-row forward (the CPU's one-call native decoder). Under pipeline
parallelism it also passes hidden states between stages (`pipeline`), in micro-batches so that stages
overlap. Sampling happens after, in the engine (pagellm/sample).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagellm.core.kv_cache_manager import BlockCopies
from pagellm.core.step_message import ScheduledRows, StepMessage, WorkerBatch
from pagellm.model.attention import AttentionBackend, AttentionMetadata
from pagellm.model.cuda_graphs import DecodeGraphRunner, length_tensors
from pagellm.model.kv_swap import HostSwap, PinnedSwap
from pagellm.model.layers.linear import Linear
from pagellm.platforms.base import to_device
from pagellm.quant.formats import PACKED_MAX_ROWS
from pagellm.quant.kv_cache import kv_row_width
from pagellm.quant.linear_method import drafts_in_step, in_prompt_step, path_rows, prompt_step, step_rows
from pagellm.sample.prompt_logprobs import PromptLogprobRow, prompt_logprob_rows

# Prompt positions whose logits are materialized at once: 128 x 49,152 float32 logits is 24 MiB.
_PROMPT_LOGITS_ROWS = 128


@dataclass
class StepResult:
    """sample_rows: indices into the message's rows that sample, in order; logits: their rows (1 +
    len(drafts) each), float32; prompt_logprobs: row index -> new PromptLogprobRows; hidden: final hidden
    states of every row (want "hidden"), or logits of every row (want "all_logits")."""

    sample_rows: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    prompt_logprobs: dict[int, list[PromptLogprobRow]] = field(default_factory=dict)
    hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, platform, num_host_blocks: int = 0,
                 pipeline=None, graph_sizes: tuple[int, ...] = (), max_model_len: int | None = None,
                 prefault_kv: bool = False):
        """graph_sizes: padded decode batch sizes to run as CUDA graphs (the platform's decode_graph_sizes;
        () for none), whose block tables span max_model_len. prefault_kv: make the KV cache's memory resident
        now (--prefault-kv-cache) instead of page by page as blocks are first written."""
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sliding_window = cfg.sliding_window
        self.pipeline = pipeline  # pagellm.distributed PipelineLink, or None: one stage
        start, end = model.layer_range
        kv_heads = model.layers[start].self_attn.num_kv_heads  # this rank's (tensor parallelism splits them)
        whole = getattr(model, "parallel", None) is None
        graphs = bool(graph_sizes) and whole
        # The last dimension is head_dim, or head_dim + 2 for int8 rows with their in-band scale, so every
        # block copy below (swap, copy-on-write) carries the scales with the values. With graphs, one block
        # more than the manager hands out: the padding rows of a graph's batch write there (cuda_graphs.py).
        shape = (2, num_blocks + graphs, block_size, kv_heads, kv_row_width(cfg.head_dim, kv_dtype))
        self.kv_caches = [platform.allocate_kv(shape, kv_dtype) for _ in range(end - start)]
        if prefault_kv:
            platform.prefault_kv(self.kv_caches)
        # Swap space in host memory; on a GPU pinned, copied asynchronously on a side stream (kv_swap.py).
        self.swap = None
        if num_host_blocks and device.type == "cuda":
            self.swap = PinnedSwap(self.kv_caches, num_host_blocks, platform.allocate_swap,
                                   torch.cuda.Stream(device))
        elif num_host_blocks:
            self.swap = HostSwap(self.kv_caches, num_host_blocks, platform.allocate_swap)
        # Built once the weights are final (they are: the loader ran); holds raw pointers into the model,
        # and runs every layer in one call: only for a whole model (no collectives between layers).
        self.compiled_decoder = platform.compile_decoder(model, backend.name, kv_dtype) if whole else None
        if graphs and self.compiled_decoder is None:  # captured now: the graphs hold the caches' addresses
            self.compiled_decoder = DecodeGraphRunner(model, backend, self.kv_caches, block_size, max_model_len,
                                                      graph_sizes, num_blocks, device, device.type == "cuda")
        # the platform's choices (every Linear got the same), for path_rows
        self._choices = next(m.quant_method.choices for m in model.modules() if isinstance(m, Linear))
        self.batch = WorkerBatch()
        self.pipeline_wait_seconds = 0.0  # time spent waiting for the previous stage (the bubble)

    def _prepare(self, rows: list[ScheduledRows]):
        # Plain Python lists, one tensor each: a decode step has a handful of rows, and a dozen small
        # torch ops here cost more than the lists (~0.25 ms of a ~9 ms single-stream step).
        ids, positions, slots, row_req, starts, seq_lens, drafts = [], [], [], [], [0], [], []
        bs, seqs = self.block_size, self.batch.seqs
        tables = []
        for i, r in enumerate(rows):
            seq = seqs[r.seq_id]
            start = r.num_computed_tokens
            end = start + r.num_new_tokens - len(r.spec_token_ids)
            ids.extend(seq.token_ids[start:end])
            ids.extend(r.spec_token_ids)  # drafts to verify sit after the known tokens
            drafts.append(len(r.spec_token_ids))
            end = start + r.num_new_tokens
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // bs] * bs + p % bs for p in range(start, end))
            row_req.extend([i] * r.num_new_tokens)
            starts.append(starts[-1] + r.num_new_tokens)
            seq_lens.append(end)
            tables.append(seq.block_ids)
        max_blocks = max(len(t) for t in tables)
        table = [t + [0] * (max_blocks - len(t)) for t in tables]

        def tensor(values):
            return to_device(values, self.device, torch.int64)

        pos = tensor(positions)
        # on a GPU, the int32 lengths the Triton backend reads, copied without a stream sync (it would copy
        # them itself, waiting for the GPU)
        lengths = {} if self.device.type == "cpu" else length_tensors(
            to_device(starts, self.device, torch.int32), to_device(seq_lens, self.device, torch.int32))
        meta = AttentionMetadata(
            slot_mapping=tensor(slots), block_tables=tensor(table), query_start_loc=starts, seq_lens=seq_lens,
            block_size=bs, sliding_window=self.sliding_window, row_seq=tensor(row_req), positions=pos,
            query_drafts=drafts if any(drafts) else None,
            # where prompt chunks take one-plane int8 (and so never the one-call decoder, which attends every row
            # through the decode kernel): attended through the prompt kernel at any row count
            query_prompt=[self._prompt_chunk(r) for r in rows] if self._choices.int8_many_rows else None, **lengths)
        return tensor(ids), pos, meta

    @torch.inference_mode()
    def execute(self, msg: StepMessage) -> StepResult | None:
        """One step: the message's state changes and block copies, then the forward. Returns the result on
        the last pipeline stage, None on the others."""
        if self.device.type == "cuda":  # the server steps in a worker thread, whose current device is GPU 0
            with torch.cuda.device(self.device):
                return self._execute(msg)
        return self._execute(msg)

    def _execute(self, msg: StepMessage) -> StepResult | None:
        self.batch.apply(msg)
        if msg.block_copies:
            self._copy_blocks(msg.block_copies)
        last = self.pipeline is None or self.pipeline.is_last
        if not msg.rows:
            return StepResult() if last else None
        parts: list[StepResult] = []
        sends = []
        groups = self._micro_batches(msg.rows, msg.want)
        int8_prompts = self._choices.int8_many_rows
        # decode rows pick two-plane int8 or bf16 paths by their batch's size (_batch_rows); on AVX2 their paths are
        # float32 (kernels or OpenBLAS: the rounding order differs), and they count their rows as elsewhere
        counts_batch = int8_prompts and self._choices.bf16_gemm
        for index, rows in groups:
            input_ids, positions, meta = self._prepare(rows)
            sampled = _sampled_rows(rows, meta)
            keep = sampled if _prunes(msg.want, rows, sampled, input_ids.shape[0]) else None
            drafts = sum(len(r.spec_token_ids) for r in rows)
            prompt = int8_prompts and any(meta.query_prompt)  # the runner's marks (_prepare), where prompts take int8
            # decode rows (a step of only them, or those of a step with prompt chunks, _decode_apart), their logits
            # too, pick their path by their batch's size; nor does pruning move them: the last layer's products
            # take the step's path for the kept rows
            forced = self._batch_rows(msg.num_running, input_ids.shape[0], drafts) if counts_batch and not prompt \
                else None
            counted = forced or (None if keep is None else input_ids.shape[0])
            with drafts_in_step(drafts):  # drafts never pick a path
                with step_rows(counted), prompt_step(prompt):
                    hidden = self._forward(input_ids, positions, meta, sends, keep)
                if last:
                    # a prompt chunk's logits too by the batch's size (how many prompts sample in a step differs
                    # between plain and speculative runs)
                    logits_rows = forced
                    if prompt and msg.num_running and counts_batch:
                        logits_rows = self._batch_rows(msg.num_running, len(sampled), 0)
                    with step_rows(logits_rows):
                        parts.append(self._outputs(msg.want, rows, index, hidden, meta, sampled, keep is not None))
        for work in sends:  # the next stage has received them before this step returns
            work.wait()
        return _merge(parts) if last else None

    def _micro_batches(self, rows: list[ScheduledRows], want: str = "logits") -> list[tuple[list[int],
                                                                                         list[ScheduledRows]]]:
        """(the rows' indices in the step, rows): the whole step, or under pipeline parallelism up to
        `pipeline.micro_batches` groups of whole sequences with about equal tokens, so that stage s works on
        group g + 1 while stage s + 1 works on group g; or the decode rows apart (_decode_apart)."""
        n = 1 if self.pipeline is None else min(self.pipeline.micro_batches, len(rows))
        if n <= 1:
            apart = self._decode_apart(rows, want) if self.pipeline is None else []
            return apart or [(list(range(len(rows))), rows)]
        total, groups, start, acc = sum(r.num_new_tokens for r in rows), [], 0, 0
        for i, r in enumerate(rows):
            acc += r.num_new_tokens
            # close a group once it holds its share, leaving at least one sequence for each group after it
            left = n - 1 - len(groups)  # groups still to open after this one
            if left > 0 and acc * n >= total * (len(groups) + 1) and len(rows) - i - 1 >= left:
                groups.append((list(range(start, i + 1)), rows[start:i + 1]))
                start = i + 1
        groups.append((list(range(start, len(rows))), rows[start:]))
        return [g for g in groups if g[1]]

    def _decode_apart(self, rows: list[ScheduledRows], want: str) -> list[tuple[list[int], list[ScheduledRows]]]:
        """Where prompt rows run on one-plane int8 (OpChoices.int8_many_rows; linear_method.prompt_step), a step
        that mixes prompt chunks with decode rows (one known token, and any drafts) forwards the decode rows
        first, on their own: they take the path a step of only them takes (two-plane int8 or vdpbf16ps), not
        int8, whose rounding would make a token depend on which prompts shared its step; speculative decoding
        stays lossless. Empty where nothing is split (only sampled logits are merged)."""
        if not self._choices.int8_many_rows or want != "logits":
            return []
        chunks = [i for i, r in enumerate(rows) if self._prompt_chunk(r)]
        if not chunks or len(chunks) == len(rows):
            return []
        taken = set(chunks)
        decode = [i for i in range(len(rows)) if i not in taken]
        return [(decode, [rows[i] for i in decode]), (chunks, [rows[i] for i in chunks])]

    def _batch_rows(self, num_running: int, rows: int, drafts: int) -> int:
        """The rows decode rows count when they pick their products' path (linear_method.step_rows) where prompt rows
        run on one-plane int8: the sequences running (StepMessage.num_running), drafts on top (path_rows takes them
        off), not the rows in the forward. Decode rows take the two-plane few-row kernels or vdpbf16ps by that count,
        and how many of a batch's sequences decode in a step, and beside which prompt chunks, differs between plain
        and speculative runs of the same requests; the batch does not until they finish apart. By the forward's rows,
        8 prompts of 300-700 tokens with n-gram drafts parted 2 of 8 from plain decoding (their rows in steps with
        prompt chunks had taken vdpbf16ps), by their own count 5-6 of 16 (benchmarks/NOTES.md, thirty-ninth session).
        Past the many-row decode path's limit (amx_max_rows) the count stops: those rows keep the one-call decoder,
        and its arithmetic is the module path's past it (vdpbf16ps at any count)."""
        if not num_running:
            return rows
        return max(rows, min(num_running, self._choices.amx_max_rows or num_running) + drafts)

    def _prompt_chunk(self, r: ScheduledRows) -> bool:
        """Whether these rows are positions of a prompt longer than a few-row step (or of a recomputed sequence),
        not one decode token and drafts: where the platform chose it, such prompts take one-plane int8 in every
        chunk, so their rows' arithmetic does not depend on how they were chunked; shorter ones keep the few-row
        path (two-plane int8), as decode rows."""
        prompt = self.batch.seqs[r.seq_id].num_prompt_tokens
        return prompt > (self._choices.packed_max_rows or PACKED_MAX_ROWS) and (
            r.num_new_tokens - len(r.spec_token_ids) > 1 or r.num_computed_tokens < prompt)

    def _forward(self, input_ids, positions, meta, sends, keep: list[int] | None) -> torch.Tensor | None:
        """The final hidden states of every row, or where `keep` is given of those rows only."""
        compiled, pipe = self.compiled_decoder, self.pipeline
        rows = None if keep is None else to_device(keep, self.device, torch.int64)
        # (prompt rows on one-plane int8 take the module path: the decoder has no such step)
        if compiled is not None and not in_prompt_step() and \
                compiled.serves(path_rows(input_ids.shape[0], self._choices), meta.query_start_loc):
            # every row through the last layer (the kept ones get the same bits as the pruned module path's)
            hidden = compiled.forward(input_ids, positions, self.kv_caches, meta)
            return hidden if rows is None else hidden.index_select(0, rows)
        if pipe is None:
            return self.model(input_ids, positions, self.kv_caches, meta, self.backend, keep=rows)
        intermediate = None
        if not pipe.is_first:
            t0 = time.perf_counter()
            x = pipe.recv_hidden(input_ids.shape[0], self.model.config.hidden_size, self._dtype())
            self.pipeline_wait_seconds += time.perf_counter() - t0
            intermediate = (x[0], x[1])
        out = self.model(input_ids, positions, self.kv_caches, meta, self.backend, intermediate, keep=rows)
        if pipe.is_last:
            return out
        sends.append(pipe.send_hidden(torch.stack(out).to(self._dtype())))  # the dtype the next stage expects
        return None

    def _dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def _outputs(self, want: str, rows: list[ScheduledRows], index: list[int], hidden: torch.Tensor,
                 meta: AttentionMetadata, sampled: list[int], pruned: bool) -> StepResult:
        """index: the rows' indices in the step; sampled: the rows whose logits are sampled (_sampled_rows);
        pruned: hidden holds only those."""
        sample_rows = [index[i] for i, row in enumerate(rows) if row.samples]
        if pruned:
            return StepResult(sample_rows=sample_rows, logits=self.model.compute_logits(hidden) if sampled else None)
        if want == "hidden":
            return StepResult(hidden=hidden)
        if want == "all_logits":
            return StepResult(hidden=self.model.compute_logits(hidden))
        result = StepResult()
        if any(r.prompt_logprobs is not None for r in rows):
            with drafts_in_step(0):  # prompt rows: no drafts among them
                result.prompt_logprobs = self._prompt_logprobs(rows, index, hidden, meta)
        result.sample_rows = sample_rows
        if sampled:
            result.logits = self.model.compute_logits(hidden.index_select(0, to_device(sampled, self.device)))
        return result

    def _prompt_logprobs(self, rows: list[ScheduledRows], index_in_step: list[int], hidden: torch.Tensor,
                         meta: AttentionMetadata) -> dict[int, list[PromptLogprobRow]]:
        """Logits of this chunk's prompt positions, in the same forward as the prefill. Position p scores
        prompt token p + 1; the last prompt position scores the first output token (the sampler's row).
        Rows the engine has already are skipped (its count comes in the message), so a request recomputed
        after preemption never gets them twice."""
        wanted: list[tuple[int, int, int, int]] = []  # (row index, first position, end position, top-k)
        index: list[int] = []
        for i, r in enumerate(rows):
            if r.prompt_logprobs is None:
                continue
            seq = self.batch.seqs[r.seq_id]
            start, (first, k) = r.num_computed_tokens, r.prompt_logprobs
            end = min(start + r.num_new_tokens, seq.num_prompt_tokens - 1)
            if first < start or first >= end:  # nothing new, or KV came from elsewhere (no logits for it)
                continue
            wanted.append((i, first, end, k))
            index.extend(range(meta.query_start_loc[i] + first - start, meta.query_start_loc[i] + end - start))
        if not index:
            return {}
        idx = torch.tensor(index, device=self.device)
        next_ids = torch.tensor([t for i, first, end, _ in wanted
                                 for t in self.batch.seqs[rows[i].seq_id].token_ids[first + 1:end + 1]],
                                device=self.device)
        k = max(w[3] for w in wanted)
        results: list[PromptLogprobRow] = []
        for lo in range(0, len(index), _PROMPT_LOGITS_ROWS):  # bounds the [rows, vocab] float32 buffers
            sl = slice(lo, lo + _PROMPT_LOGITS_ROWS)
            logits = self.model.compute_logits(hidden.index_select(0, idx[sl]))
            results.extend(prompt_logprob_rows(logits, next_ids[sl], k))
        out, pos = {}, 0
        for i, first, end, n in wanted:
            out[index_in_step[i]] = [r if n == k else r._replace(top_ids=r.top_ids[:n], top_logprobs=r.top_logprobs[:n])
                                  for r in results[pos:pos + end - first]]
            pos += end - first
        return out

    def _copy_blocks(self, copies: BlockCopies) -> None:
        """Swap out, swap in, then copy-on-write, all before the forward writes any new KV."""
        if copies.swap_out:
            self.swap.swap_out(copies.swap_out)
        if copies.swap_in:
            self.swap.swap_in(copies.swap_in)
        if self.swap is not None:
            self.swap.wait()  # the compute stream waits for what it reads or overwrites (a GPU's side stream)
        if copies.cow:
            src, dst = (to_device(x, self.device) for x in zip(*copies.cow, strict=True))
            for cache in self.kv_caches:
                cache[:, dst] = cache[:, src]


def _sampled_rows(rows: list[ScheduledRows], meta: AttentionMetadata) -> list[int]:
    """The step's rows whose logits are sampled, in order: each sampling request's last row and its drafts'."""
    starts = meta.query_start_loc
    return [r for i, row in enumerate(rows) if row.samples
            for r in range(starts[i + 1] - 1 - len(row.spec_token_ids), starts[i + 1])]


def _prunes(want: str, rows: list[ScheduledRows], sampled: list[int], num_rows: int) -> bool:
    """Whether the forward computes final hidden states for the sampled rows only: they are fewer than all
    (prefill chunks: only their last row samples) and nothing else reads the rest (hidden states, all logits,
    prompt logprobs)."""
    return (want == "logits" and len(sampled) < num_rows
            and all(r.prompt_logprobs is None for r in rows))


def _merge(parts: list[StepResult]) -> StepResult:
    if len(parts) == 1:
        return parts[0]
    out = StepResult()
    logits, hidden = [], []
    for p in parts:
        out.sample_rows.extend(p.sample_rows)
        out.prompt_logprobs.update(p.prompt_logprobs)
        if p.logits is not None:
            logits.append(p.logits)
        if p.hidden is not None:
            hidden.append(p.hidden)
    out.logits = torch.cat(logits) if logits else None
    out.hidden = torch.cat(hidden) if hidden else None
    return out
