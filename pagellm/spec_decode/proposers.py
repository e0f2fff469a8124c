"""Proposers fill `request.spec_token_ids` for requests that are decoding, before the step is scheduled."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagellm.config import check_ngram_bounds
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.scheduler import ScheduledRequest, SchedulerOutput
from pagellm.request import Request, request_of
from pagellm.sample.sampler import Sampler, SamplingRow, sampling_probs
from pagellm.spec_decode.ngram import propose_ngram

logger = logging.getLogger("pagellm")


class Proposer:
    def __init__(self, num_speculative_tokens: int, max_model_len: int):
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len

    def budget(self, req: Request) -> int:
        """Drafts worth proposing: the step adds accepted drafts + 1, which must respect max_tokens and
        max_model_len; beam search and unfinished prefills don't speculate."""
        p = req.params
        if p.use_beam_search or req.num_tokens - req.num_computed_tokens != 1:
            return 0
        room = self.max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        return max(0, min(self.k, room))

    def propose(self, running: list[Request]) -> None:
        raise NotImplementedError

    def retain(self, live: set[str]) -> None:
        """Forget every sequence not in `live` (what a proposer keeps per sequence, e.g. a draft model's KV)."""


class NgramProposer(Proposer):
    def __init__(self, num_speculative_tokens: int, max_model_len: int, n_min: int, n_max: int):
        super().__init__(num_speculative_tokens, max_model_len)
        check_ngram_bounds(n_min, n_max)
        self.n_min, self.n_max = n_min, n_max

    def propose(self, running: list[Request]) -> None:
        for req in running:
            k = self.budget(req)
            req.spec_token_ids = propose_ngram(req.all_token_ids, k, self.n_min, self.n_max) if k else []


@dataclass
class _DraftSeq:
    """The draft model's view of a request: the same tokens plus drafts, and its own KV progress."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _no_drafts(req: Request, e: Exception) -> None:
    # Drafting is an optimisation: a request whose parameters break it is verified without (more) drafts,
    # and if those parameters also break the target's sampling, engine/isolation.py fails it alone.
    logger.warning("draft model: request %s drafts no further (%s: %s)", request_of(req.request_id),
                   type(e).__name__, e)


class DraftModelProposer(Proposer):
    """A smaller model with the same vocabulary drafts k tokens autoregressively, in its own paged KV
    cache. Its KV for accepted tokens is kept; for rejected ones it is rolled back."""

    def __init__(self, executor, sampler: Sampler, kv_cache: KVCacheManager, num_speculative_tokens: int,
                 max_model_len: int):
        super().__init__(num_speculative_tokens, max_model_len)
        self.executor = executor  # in this process: pagellm.executor.UniprocExecutor around the draft's runner
        self.sampler = sampler  # the target's logits processing, applied to the draft's logits too
        self.kv = kv_cache
        self.seqs: dict[str, _DraftSeq] = {}
        self.said_full = False

    def retain(self, live: set[str]) -> None:
        for rid in [rid for rid in self.seqs if rid not in live]:
            self._drop(rid)

    def propose(self, running: list[Request]) -> None:
        self.retain({r.request_id for r in running})
        active: list[tuple[Request, _DraftSeq]] = []
        for req in running:
            req.clear_spec()
            if self.budget(req) > 0:
                try:
                    active.append((req, self._sync(req)))
                except Exception as e:  # its own parameters (e.g. the seed): it goes on without drafts
                    _no_drafts(req, e)
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in active}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in active}
        failed: set[str] = set()
        for step in range(self.k):
            batch = [(req, seq) for req, seq in active
                     if step < self.budget(req) and req.request_id not in failed]
            scheduled = []
            for _, seq in batch:
                n = seq.num_tokens - seq.num_computed_tokens
                if self.kv.allocate_slots(seq, n) is None:  # draft cache full: this one doesn't speculate
                    if not self.said_full:  # said once: it costs speed, and the remedy is an option
                        self.said_full = True
                        logger.warning("the draft model's KV cache (%d blocks) is full: requests past it decode "
                                       "without drafts; raise --draft-kv-cache-memory", self.kv.num_blocks)
                    continue
                scheduled.append(ScheduledRequest(seq, n, self.kv.block_table(seq.request_id)))
            if not scheduled:
                break
            done, logits = self.executor.execute(SchedulerOutput(scheduled))
            by_id = {req.request_id: req for req, _ in batch}
            for j, s in enumerate(done):
                req, seq = by_id[s.request.request_id], s.request
                seq.num_computed_tokens += s.num_new_tokens
                try:
                    token, q = self._draw(req, seq, logits[j:j + 1], drafts[req.request_id])
                except Exception as e:  # one request's sampling parameters: it keeps the drafts it has
                    failed.add(req.request_id)
                    _no_drafts(req, e)
                    continue
                drafts[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
                seq.all_token_ids.append(token)
        for req, _ in active:
            req.spec_token_ids = drafts[req.request_id]
            if probs[req.request_id]:
                req.spec_draft_probs = torch.stack(probs[req.request_id])

    def _sync(self, req: Request) -> _DraftSeq:
        """Bring the draft's copy up to the verified tokens, keeping the KV of the common prefix."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            gen = None
            if req.params.seed is not None:
                seed = req.params.seed + 1 if req.params.seed + 1 < 2**64 else 0  # the largest seed wraps
                gen = torch.Generator(device=self.executor.runner.device).manual_seed(seed)
            seq = self.seqs[req.request_id] = _DraftSeq(req.request_id, [], generator=gen)
        common = 0
        limit = min(len(seq.all_token_ids), req.num_tokens)
        while common < limit and seq.all_token_ids[common] == req.all_token_ids[common]:
            common += 1
        if common < len(seq.all_token_ids):  # its own drafts were rejected: the workers' copy is stale
            self.executor.forget(req.request_id)
        seq.all_token_ids = list(req.all_token_ids)
        # The last token always runs, its logits drawing the first draft: where the target accepted every draft
        # this step verified (the budget may cut them) and its own token is the one the draft drew next, the
        # draft has computed it already (a forward of no tokens then failed the whole step).
        seq.num_computed_tokens = min(seq.num_computed_tokens, common, req.num_tokens - 1)
        return seq

    def _draw(self, req: Request, seq: _DraftSeq, logits: torch.Tensor, drafted: list[int]):
        row = SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids + drafted, seq.generator)
        x = self.sampler.process(logits, [row])
        if req.params.greedy:
            return int(x.argmax(dim=-1)), None
        q = sampling_probs(x, [row])[0]
        return int(torch.multinomial(q, 1, generator=seq.generator)), q

    def _drop(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id)
        self.kv.free(seq)
        self.executor.forget(request_id)
