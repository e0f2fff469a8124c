"""One step's logits rows -> one SampledToken per request: plain sampling, draft verification (rejection
sampling) and beam candidates, with logprobs where asked.

Rows come from ModelRunner.forward_logits: for each request that samples, in batch order,
1 + len(spec_token_ids) rows (the positions that score its drafts, then the next token).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.core.scheduler import ScheduledRequest
from pagellm.platforms.base import to_device
from pagellm.sample.beam import beam_candidates
from pagellm.sample.logprobs import argmax_rows, log_softmax
from pagellm.sample.rejection import verify, verify_by_draws, verify_greedy
from pagellm.sample.sampler import (
    Sampler,
    SamplingRow,
    dead_rows,
    draw_rows,
    logprob_ranks,
    no_token_allowed,
    sampling_probs,
)
from pagellm.structured_output import StructuredOutputManager, apply_grammar_masks


@dataclass
class SampledToken:
    token_id: int | None  # None for a beam-search row, which returns candidates instead
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    rank: int | None = None  # the token's rank among the raw logprobs, when logprobs are asked for
    beam_candidates: list[tuple[int, float]] | None = None  # (token, logprob), best first
    accepted: list[SampledToken] = field(default_factory=list)  # verified draft tokens before this one

    @property
    def tokens(self) -> list[SampledToken]:
        return [*self.accepted, self]


class StepSampler:
    def __init__(self, sampler: Sampler, device: torch.device,
                 structured_output: StructuredOutputManager | None = None):
        self.sampler = sampler
        self.device = device  # where per-request seeded generators live (the logits' device)
        self.structured_output = structured_output

    @torch.inference_mode()
    def __call__(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledToken]:
        """A token for each scheduled request (those whose chunk reached its last known token)."""
        if not scheduled:
            return {}
        if self.structured_output is not None:  # grammars mask their rows before any other processing
            apply_grammar_masks(scheduled, logits, self.structured_output.new_state)
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
            cands = beam_candidates(logits[beam], [reqs[j].params for j in beam], len(self.sampler.eos_token_ids))
            sampled.update({reqs[j].request_id: SampledToken(None, beam_candidates=c)
                            for j, c in zip(beam, cands, strict=True)})
            if len(beam) == len(reqs):
                return sampled
            keep = [j for j in range(len(reqs)) if j not in set(beam)]
            logits = logits[keep]
            reqs = [reqs[j] for j in keep]
        result = self.sampler(logits, [self.sampling_row(req) for req in reqs])
        for j, req in enumerate(reqs):
            sampled[req.request_id] = SampledToken(
                result.token_ids[j],
                result.logprobs[j] if result.logprobs is not None else None,
                result.top_logprobs[j] if result.top_logprobs is not None else None,
                result.ranks[j] if result.ranks is not None else None)
        return sampled

    def _verify(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> dict[str, SampledToken]:
        """Rejection-sample each speculating request's drafts against its k + 1 rows of target logits. Greedy
        requests are processed together (processing is row by row) and their argmaxes read in one copy."""
        work, row = [], 0  # (ScheduledRequest, its rows of logits, their SamplingRows)
        for s in scheduled:
            n = 1 + len(s.spec_token_ids)
            if s.spec_token_ids:
                req, spec = s.request, s.spec_token_ids
                base = self.sampling_row(req)
                rows = [SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids + spec[:j],
                                    base.generator) for j in range(n)]
                work.append((s, range(row, row + n), rows))
            row += n
        greedy = [w for w in work if w[0].request.params.greedy]
        argmax: dict[str, tuple[list[int], list[bool] | None]] = {}
        if greedy:
            idx = [r for w in greedy for r in w[1]]
            greedy_rows = [r for w in greedy for r in w[2]]
            # (every row greedy and unprocessed, as in a plain n-gram run: read the logits without a copy)
            x = logits if len(idx) == logits.shape[0] else logits[to_device(idx, logits.device)]  # (idx ascending)
            if not self.sampler.untouched(x, greedy_rows):
                x = self.sampler.process(x, greedy_rows)
            best, dead = argmax_rows(x).tolist(), dead_rows(x, greedy_rows)
            at = 0
            for s, rows, _ in greedy:
                argmax[s.request.request_id] = (best[at:at + len(rows)],
                                                None if dead is None else dead[at:at + len(rows)])
                at += len(rows)
        out = {}
        for s, rows, sampling_rows in work:  # in batch order: unseeded draws share the global RNG
            req, spec = s.request, s.spec_token_ids
            x = logits[rows.start:rows.stop]
            if req.params.greedy:
                best, dead = argmax[req.request_id]
            else:
                processed = self.sampler.process(x, sampling_rows)
                dead = dead_rows(processed, sampling_rows)
            if dead is not None and True in dead:
                # A row whose masks leave no token (a grammar, bad_words, allowed_token_ids after the drafts
                # before it): the drafts are verified only up to the row before it, which is lossless; the
                # first row itself is this request's next position, where nothing may follow.
                cut = dead.index(True)
                if cut == 0:
                    raise no_token_allowed(sampling_rows[0])
                spec = spec[:cut - 1]
            if req.params.greedy:
                tokens = verify_greedy(best[:len(spec) + 1], spec)
            else:
                gen = sampling_rows[0].generator
                if s.draft_probs is None:  # each position's token as a plain step draws it
                    tokens = verify_by_draws(lambda i, u, x=processed, r=sampling_rows: int(
                        draw_rows(x[i:i + 1], r[i:i + 1], u, writable=False)[0]), spec, gen, processed.device)
                else:
                    n = len(spec) + 1
                    tokens = verify(sampling_probs(processed[:n], sampling_rows[:n]), spec,
                                    s.draft_probs.to(self.device), gen)
            out[req.request_id] = self._with_logprobs(req, x, tokens)
        return out

    @staticmethod
    def _with_logprobs(req, logits: torch.Tensor, tokens: list[int]) -> SampledToken:
        want = req.params.logprobs
        if want is None:
            results = [SampledToken(t) for t in tokens]
        else:  # one copy to the host for each of the chosen and top logprobs (not one per token)
            lp = log_softmax(logits[:len(tokens)])
            picked = lp.gather(1, to_device(tokens, lp.device)[:, None])
            chosen, ranks = picked.squeeze(1).tolist(), logprob_ranks(lp, picked)
            top = lp.topk(want, dim=-1) if want else None
            top_ids, top_lps = (top.indices.tolist(), top.values.tolist()) if top is not None else (None, None)
            results = [SampledToken(t, chosen[j], list(zip(top_ids[j], top_lps[j], strict=True))
                                    if top is not None else [], ranks[j])
                       for j, t in enumerate(tokens)]
        last = results[-1]
        last.accepted = results[:-1]
        return last

    def sampling_row(self, req) -> SamplingRow:
        if req.sampling_state is None and req.params.seed is not None:
            req.sampling_state = torch.Generator(device=self.device).manual_seed(req.params.seed)
        return SamplingRow(req.params, req.prompt_token_ids, req.output_token_ids, req.sampling_state)


def _row_owner(scheduled: list[ScheduledRequest]) -> list[ScheduledRequest]:
    """The scheduled request each logits row belongs to."""
    return [s for s in scheduled for _ in range(1 + len(s.spec_token_ids))]
