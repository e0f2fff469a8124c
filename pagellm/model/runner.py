"""SchedulerOutput -> flat input tensors -> one forward over the mixed batch -> sampled tokens."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass, field

import torch

from pagellm.core.kv_cache_manager import BlockCopies
from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.engine.beam_search import beams_to_keep
from pagellm.model.attention import AttentionBackend, AttentionMetadata
from pagellm.model.sampler import Sampler, SamplingRow, sampling_probs
from pagellm.spec_decode.rejection import verify, verify_greedy


@dataclass
class SampledToken:
    token_id: int | None  # None for a beam-search row, which returns candidates instead
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    beam_candidates: list[tuple[int, float]] | None = None  # (token, logprob), best first
    accepted: list[SampledToken] = field(default_factory=list)  # verified draft tokens before this one

    @property
    def tokens(self) -> list[SampledToken]:
        return [*self.accepted, self]


def zeros_on_touch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on the CPU backed by anonymous memory the OS hands out page by page on first write, so
    a KV cache costs resident memory only for the blocks requests have used (torch.zeros writes every
    byte up front: the whole --kv-cache-memory was resident from the start)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    if numel == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, numel * dtype.itemsize)  # anonymous mapping: reads as zeros, untouched pages cost nothing
    return torch.frombuffer(buf, dtype=dtype).view(shape)  # the tensor keeps buf alive


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                 device: torch.device, backend: AttentionBackend, sampler: Sampler, num_host_blocks: int = 0):
        cfg = model.config
        self.model = model
        self.device = device
        self.block_size = block_size
        self.backend = backend
        self.sampler = sampler
        self.sliding_window = cfg.sliding_window
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [zeros_on_touch(shape, kv_dtype, device) for _ in range(cfg.num_hidden_layers)]
        # Swap space: one host tensor for all layers, [layers, 2, host_blocks, block_size, kv_heads, head_dim].
        host_shape = (cfg.num_hidden_layers, 2, num_host_blocks, *shape[2:])
        if not num_host_blocks:
            self.host_cache = None
        elif device.type == "cuda":
            self.host_cache = torch.zeros(host_shape, dtype=kv_dtype, pin_memory=True)
        else:
            self.host_cache = zeros_on_touch(host_shape, kv_dtype, torch.device("cpu"))

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.kv_caches)

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
    def forward_logits(self, out: SchedulerOutput) -> tuple[list[ScheduledRequest], torch.Tensor]:
        """One forward over the step's batch; logits [rows, vocab] for the requests that sample, in
        batch order, 1 + len(spec_token_ids) rows each (the positions that score drafts, then the next)."""
        if out.block_copies:
            self._copy_blocks(out.block_copies)
        if out.is_empty:
            return [], torch.empty(0)
        input_ids, positions, meta = self._prepare(out)
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
        sampling = [(i, s) for i, s in enumerate(out.scheduled) if s.samples]
        rows = [r for i, s in sampling
                for r in range(meta.query_start_loc[i + 1] - 1 - len(s.spec_token_ids), meta.query_start_loc[i + 1])]
        if not rows:
            return [], torch.empty(0)
        hidden = hidden.index_select(0, torch.tensor(rows, device=self.device))
        return [s for _, s in sampling], self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Runs the step; returns a token for each request whose chunk reached its last known token."""
        scheduled, logits = self.forward_logits(out)
        if not scheduled:
            return {}
        sampled = {}
        if any(s.spec_token_ids for s in scheduled):
            sampled.update(self._verify(scheduled, logits))
            plain = [j for j, s in enumerate(_row_owner(scheduled)) if not s.spec_token_ids]
            scheduled = [s for s in scheduled if not s.spec_token_ids]
            if not scheduled:
                return sampled
            logits = logits[plain]
        reqs = [s.request for s in scheduled]
        beam = [j for j, req in enumerate(reqs) if req.params.use_beam_search]
        if beam:
            sampled.update(self._beam_candidates(logits, [reqs[j] for j in beam], beam))
            if len(beam) == len(reqs):
                return sampled
            keep = [j for j in range(len(reqs)) if j not in set(beam)]
            logits = logits[keep]
            reqs = [reqs[j] for j in keep]
        result = self.sampler(logits, [self._sampling_row(req) for req in reqs])
        for j, req in enumerate(reqs):
            sampled[req.request_id] = SampledToken(
                result.token_ids[j],
                result.logprobs[j] if result.logprobs is not None else None,
                result.top_logprobs[j] if result.top_logprobs is not None else None)
        return sampled

    def _verify(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledToken]:
        """Rejection-sample each speculating request's drafts against its k + 1 rows of target logits."""
        out, row = {}, 0
        for s in scheduled:
            n = 1 + len(s.spec_token_ids)
            if not s.spec_token_ids:
                row += n
                continue
            req, spec = s.request, s.spec_token_ids
            x = logits[row:row + n]
            row += n
            base = self._sampling_row(req)
            rows = [SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids + spec[:j], base.generator)
                    for j in range(n)]
            processed = self.sampler.process(x, rows)
            if req.params.greedy:
                tokens = verify_greedy(processed.argmax(dim=-1).tolist(), spec)
            else:
                draft_probs = s.draft_probs.to(self.device) if s.draft_probs is not None else None
                tokens = verify(sampling_probs(processed, rows), spec, draft_probs, base.generator)
            out[req.request_id] = self._with_logprobs(req, x, tokens)
        return out

    def _with_logprobs(self, req, logits: torch.Tensor, tokens: list[int]) -> SampledToken:
        want = req.params.logprobs
        if want is None:
            results = [SampledToken(t) for t in tokens]
        else:
            lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
            top = lp.topk(want, dim=-1) if want else None
            results = [SampledToken(t, float(lp[j, t]),
                                    list(zip(top.indices[j].tolist(), top.values[j].tolist(), strict=True))
                                    if top is not None else [])
                       for j, t in enumerate(tokens)]
        last = results[-1]
        last.accepted = results[:-1]
        return last

    def _beam_candidates(self, logits, reqs, rows) -> dict[str, SampledToken]:
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        n = max(beams_to_keep(r.params, len(self.sampler.eos_token_ids)) for r in reqs)
        values, ids = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
        return {r.request_id: SampledToken(None, beam_candidates=list(zip(ids[i].tolist(), values[i].tolist(),
                                                                          strict=True)))
                for i, r in enumerate(reqs)}

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

    def _sampling_row(self, req) -> SamplingRow:
        if req.sampling_state is None and req.params.seed is not None:
            req.sampling_state = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.sampling_state)


def _row_owner(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The scheduled request each logits row belongs to."""
    return [s for s in scheduled for _ in range(1 + len(s.spec_token_ids))]
