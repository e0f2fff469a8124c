"""Batched logits processing and sampling, with vLLM's semantics.

The all-greedy batch without penalties, biases or logprobs is one argmax. Everything else is vectorised
over the batch; the only per-row Python work is reading each row's params into metadata lists.
Rows are processed in this order (vLLM's): logit_bias, min_tokens, repetition penalty, frequency and
presence penalties; greedy rows then take the argmax; random rows go on through temperature, top-k,
top-p, min-p and a categorical draw (one uniform per row, each seeded row's from its own generator).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from pagellm.platforms.base import to_device
from pagellm.sample.draw import categorical, softmax_categorical, uniforms
from pagellm.sample.logprobs import argmax_rows, log_softmax
from pagellm.sample.token_masks import apply_token_masks, has_masks
from pagellm.sampling_params import SamplingParams

_NEG_INF = float("-inf")

# top-p searches the nucleus among this many best tokens first (a partial topk instead of a vocab sort).
_TOP_P_CANDIDATES = 1024

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first


@dataclass
class SamplingRow:
    """One row of logits with what its processing reads (built by StepSampler and the draft proposer)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # generated so far: penalties and min_tokens read it
    generator: torch.Generator | None  # per request, seeded from params.seed; None draws from the global RNG


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float] | None  # raw logprob of each row's sampled token; None if no row asked
    top_logprobs: list[TopLogprobs | None] | None  # per row: top-N when params.logprobs is set
    ranks: list[int] | None = None  # the sampled token's rank among the raw logprobs (vLLM's: 1 + those above)


class Sampler:
    def __init__(self, eos_token_ids: set[int] | list[int]):
        self.eos_token_ids = sorted({int(t) for t in eos_token_ids})

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        masked = any(can_mask_every_token(r.params) for r in rows)
        if not want_logprobs and all(r.params.greedy and not self._needs_processing(r) for r in rows):
            # bf16/fp16 -> fp32 is exact, so the argmax of the raw logits is the fp32 argmax.
            tokens = argmax_rows(logits)
            if masked:  # a grammar's mask is in the logits already
                check_some_token_allowed(logits, tokens, rows)
            return SamplerOutput(tokens.tolist(), None, None)

        # Raw logprobs come from the model's logits before any processing (vLLM's default).
        raw_logprobs = log_softmax(logits) if want_logprobs else None
        # Rows without penalties, biases or masks read the logits as they are (no float32 copy; nothing below
        # writes to x then: _sample copies where it filters).
        untouched = self.untouched(logits, rows)
        x = logits if untouched else self.process(logits, rows)
        greedy = [r.params.greedy for r in rows]
        if all(greedy):
            tokens = argmax_rows(x)
        elif not any(greedy):
            tokens = _sample(x, rows, writable=not untouched)
        else:
            tokens = argmax_rows(x)
            rand = [i for i, g in enumerate(greedy) if not g]
            rand_idx = to_device(rand, x.device)
            tokens[rand_idx] = _sample(x[rand_idx], [rows[i] for i in rand])  # indexing copies
        if masked:
            check_some_token_allowed(x, tokens, rows)

        token_ids = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_ids, None, None)
        chosen = raw_logprobs.gather(1, tokens[:, None])
        return SamplerOutput(token_ids, chosen.squeeze(1).tolist(), _top_logprobs(raw_logprobs, rows),
                             logprob_ranks(raw_logprobs, chosen))

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """fp32 copy of `logits` after logit_bias, min_tokens and penalties; the input is left untouched."""
        x = logits.to(torch.float32, copy=True)
        if any(has_masks(r.params) for r in rows):
            apply_token_masks(x, rows)  # allowed_token_ids, bad_words: -inf first, as vLLM
        _apply_logit_bias(x, rows)
        _apply_min_tokens(x, rows, self.eos_token_ids)
        _apply_penalties(x, rows)
        return x

    def untouched(self, logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
        """Whether process() would return an unchanged float32 copy: the logits can be read as they are."""
        return logits.dtype == torch.float32 and not any(self._needs_processing(r) for r in rows)

    def _needs_processing(self, row: SamplingRow) -> bool:
        p = row.params
        return (bool(p.logit_bias) or p.has_penalties or has_masks(p)
                or bool(_min_tokens_ids(row, self.eos_token_ids)))


NO_TOKEN_ALLOWED = "no token is allowed at output position"  # how its message starts (the server's 400)


class NoTokenAllowedError(ValueError):
    """A row whose masks (allowed_token_ids, bad_words, min_tokens, a grammar) leave no token at all: the
    request's own parameters contradict each other."""


def can_mask_every_token(params: SamplingParams) -> bool:
    return has_masks(params) or params.structured_outputs is not None


def check_some_token_allowed(x: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Raises NoTokenAllowedError for a row whose chosen token is -inf: every token was masked, and argmax or
    the sampling race returned an arbitrary banned id (the request then fails alone, naming why)."""
    banned = torch.isneginf(x.gather(1, tokens[:, None]).squeeze(1))
    if bool(banned.any()):
        raise no_token_allowed(rows[int(banned.nonzero()[0, 0])])


def no_token_allowed(row: SamplingRow) -> NoTokenAllowedError:
    return NoTokenAllowedError(f"{NO_TOKEN_ALLOWED} {len(row.output_token_ids)}: allowed_token_ids, bad_words, "
                               "min_tokens and the structured output's grammar together exclude every token")


def dead_rows(x: torch.Tensor, rows: list[SamplingRow]) -> list[bool] | None:
    """Per processed row, whether its masks left no token (every logit -inf); None where no row's could."""
    if not any(can_mask_every_token(r.params) for r in rows):
        return None
    return torch.isneginf(x).all(dim=-1).tolist()


def _min_tokens_ids(row: SamplingRow, eos_token_ids: list[int]) -> list[int]:
    """Ids banned for this row now: stop ids (and EOS unless ignore_eos) while output < min_tokens."""
    p = row.params
    if len(row.output_token_ids) >= p.min_tokens:
        return []
    return list(p.stop_token_ids) + ([] if p.ignore_eos else eos_token_ids)


def _apply_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = x.shape[1]
    r_idx, t_idx, bias = [], [], []
    for i, row in enumerate(rows):
        for tok, b in (row.params.logit_bias or {}).items():
            # Admission checks ids against the vocab; a stray one must not crash the whole batch here.
            if 0 <= int(tok) < vocab:
                r_idx.append(i)
                t_idx.append(int(tok))
                bias.append(float(b))
    if r_idx:
        dev = x.device
        x.index_put_((to_device(r_idx, dev), to_device(t_idx, dev)),
                     to_device(bias, dev), accumulate=True)


def _apply_min_tokens(x: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int]) -> None:
    vocab = x.shape[1]
    r_idx, t_idx = [], []
    for i, row in enumerate(rows):
        for tok in _min_tokens_ids(row, eos_token_ids):
            if 0 <= tok < vocab:
                r_idx.append(i)
                t_idx.append(tok)
    if r_idx:
        dev = x.device
        x.index_put_((to_device(r_idx, dev), to_device(t_idx, dev)),
                     torch.full((), _NEG_INF, device=dev))


def _token_counts(id_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[B, vocab] fp32 count of each id in each row's list, built in one scatter over the flattened ids."""
    counts = torch.zeros(len(id_lists), vocab, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in id_lists]
    if sum(lengths) == 0:
        return counts
    flat = to_device(list(itertools.chain.from_iterable(id_lists)), device, torch.long)
    row = torch.repeat_interleave(torch.arange(len(id_lists), device=device), to_device(lengths, device))
    counts.view(-1).index_put_((row * vocab + flat,), torch.ones_like(flat, dtype=torch.float32),
                               accumulate=True)
    return counts


def _apply_penalties(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    if not any(r.params.has_penalties for r in rows):
        return
    batch, vocab = x.shape
    dev = x.device
    params = [r.params for r in rows]
    out_counts = _token_counts([r.output_token_ids if r.params.has_penalties else [] for r in rows],
                               vocab, dev)
    out_seen = out_counts > 0

    if any(p.repetition_penalty != 1.0 for p in params):
        rep = to_device([p.repetition_penalty for p in params], dev)[:, None]
        prompt_seen = _token_counts(
            [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else [] for r in rows], vocab, dev) > 0
        # HF/vLLM: shrink a seen token's logit towards 0 whatever its sign, so it always gets less likely.
        penalised = torch.where(x > 0, x / rep, x * rep)
        x.copy_(torch.where(prompt_seen | out_seen, penalised, x))

    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        freq = to_device([p.frequency_penalty for p in params], dev)[:, None]
        pres = to_device([p.presence_penalty for p in params], dev)[:, None]
        x.sub_(freq * out_counts + pres * out_seen)


def _apply_top_k_top_p(x: torch.Tensor, ks: list[int], ps: list[float], n: int | None = None) -> None:
    """Mask all but each row's top k, then all but the nucleus of the survivors (top-p over top-k).

    Both filters cut at a value, so tokens tied with the last one kept survive too: the kept set then
    never depends on how topk orders equal logits, which may change with the batch. The nucleus is
    looked for among the best `n` tokens (a partial topk, far cheaper than sorting the vocab); only a
    row whose nucleus spills past them sends the batch through a full sort.
    """
    vocab = x.shape[1]
    dev = x.device
    top_p_only = any(p < 1.0 and k >= vocab for k, p in zip(ks, ps, strict=True))
    if n is None:
        n = max([k for k in ks if k < vocab], default=1)
        n = min(vocab, max(n, _TOP_P_CANDIDATES) if top_p_only else n)
    k = to_device(ks, dev)
    vals = x.topk(n, dim=-1, sorted=True).values
    kth = vals.gather(1, (k.clamp(max=n) - 1)[:, None]).masked_fill_((k >= vocab)[:, None], _NEG_INF)
    x.masked_fill_(x < kth, _NEG_INF)
    if not any(p < 1.0 for p in ps):
        return

    p = to_device(ps, dev)[:, None]
    vals.masked_fill_(vals < kth, _NEG_INF)
    probs = (vals - x.logsumexp(dim=-1, keepdim=True)).exp()
    # A token stays if the mass strictly above it is < p: the smallest prefix whose mass reaches p.
    # The shifted cumsum is exact (no cumsum - probs round-off) and so monotone: the kept part is a prefix.
    cum = probs.cumsum(dim=-1)
    mass_above = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    n_keep = (mass_above < p).sum(dim=-1, keepdim=True).clamp_(min=1)
    # p rounded to fp32 may reach 1.0: such rows keep everything.
    active = p < 1.0
    if n < vocab and bool((active & (n_keep == n) & (k >= vocab)[:, None]).any()):
        _apply_top_k_top_p(x, ks, ps, n=vocab)  # top-k is already applied; applying it again is a no-op
        return
    cutoff = vals.gather(1, n_keep - 1).masked_fill_(~active, _NEG_INF)
    x.masked_fill_(x < cutoff, _NEG_INF)


def _apply_min_p(x: torch.Tensor, min_p: torch.Tensor) -> None:
    # prob < min_p * max_prob, in log space: no softmax needed, and min_p == 0 gives a -inf threshold.
    threshold = x.amax(dim=-1, keepdim=True) + min_p.log()[:, None]
    x.masked_fill_(x < threshold, _NEG_INF)


def _sample(x: torch.Tensor, rows: list[SamplingRow], writable: bool = True) -> torch.Tensor:
    """Random rows only: temperature, top-k, top-p, min-p, then a categorical draw (sample/draw.py). x is
    modified unless the rows need no filter or writable is False."""
    return draw_rows(x, rows, uniforms([r.generator for r in rows], x.device), writable)


def draw_rows(x: torch.Tensor, rows: list[SamplingRow], u: torch.Tensor, writable: bool = True) -> torch.Tensor:
    """_sample with given uniforms: n-gram verification draws each position as a plain step would. Each row takes
    its own kind of draw (the fused softmax draw where temperature is its only filter, else the draw on filtered
    probabilities): the two round differently, so a seeded row's token must not depend on its neighbours' filters."""
    vocab = x.shape[1]
    fused = [not 0 < r.params.top_k < vocab and r.params.top_p >= 1.0 and r.params.min_p <= 0.0 for r in rows]
    if all(fused):
        return softmax_categorical(x, [r.params.temperature for r in rows], u)
    if not any(fused):
        return categorical(sampling_probs(x if writable else x.clone(), rows), u)
    one, other = [i for i, f in enumerate(fused) if f], [i for i, f in enumerate(fused) if not f]
    out = torch.empty(len(rows), dtype=torch.long, device=x.device)
    at, rest = to_device(one, x.device), to_device(other, x.device)  # (indexing copies x: writable either way)
    out[at] = softmax_categorical(x[at], [rows[i].params.temperature for i in one], u[at])
    out[rest] = categorical(sampling_probs(x[rest], [rows[i] for i in other]), u[rest])
    return out


def sampling_probs(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution random rows sample from: processed logits (modified in place) through temperature,
    top-k, top-p and min-p. Speculative decoding's rejection sampler compares these."""
    vocab = x.shape[1]
    dev = x.device
    params = [r.params for r in rows]
    x.div_(to_device([p.temperature for p in params], dev)[:, None])

    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if any(k < vocab for k in ks) or any(p.top_p < 1.0 for p in params):
        _apply_top_k_top_p(x, ks, [p.top_p for p in params])
    if any(p.min_p > 0.0 for p in params):
        _apply_min_p(x, to_device([p.min_p for p in params], dev))

    return x.softmax(dim=-1)


def logprob_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> list[int]:
    """Each row's chosen token's rank: 1 + the number of tokens with a larger logprob (chosen: [rows, 1])."""
    return ((logprobs > chosen).sum(dim=1) + 1).tolist()


def _top_logprobs(raw_logprobs: torch.Tensor, rows: list[SamplingRow]) -> list[TopLogprobs | None]:
    ns = [r.params.logprobs for r in rows]
    max_n = min(max(n or 0 for n in ns), raw_logprobs.shape[1])
    if max_n == 0:
        return [None if n is None else [] for n in ns]
    vals, ids = raw_logprobs.topk(max_n, dim=-1, sorted=True)
    vals, ids = vals.tolist(), ids.tolist()
    return [None if n is None else list(zip(ids[i][:n], vals[i][:n], strict=True)) for i, n in enumerate(ns)]
