"""Beam-search candidates: each beam row's best continuations by logprob (the engine expands beams)."""

from __future__ import annotations

import torch

from pagellm.sample.logprobs import log_softmax
from pagellm.sampling_params import SamplingParams

_NEG_INF = float("-inf")


def beams_to_keep(params: SamplingParams, num_eos: int) -> int:
    """Candidates kept per step: enough that k beams survive even if some candidates end on EOS."""
    return max(2, 1 + (0 if params.ignore_eos else num_eos)) * params.beam_width


def beam_candidates(logits: torch.Tensor, params: list[SamplingParams], num_eos: int) -> list[list[tuple[int, float]]]:
    """logits [rows, vocab] -> per row (token, logprob) pairs, best first."""
    logprobs = log_softmax(logits)
    n = max(beams_to_keep(p, num_eos) for p in params)
    values, ids = logprobs.topk(min(n, logprobs.shape[-1]), dim=-1)
    # A masked token (a grammar's, -inf) is no candidate: a beam must never continue with it. One copy to
    # the host for the whole batch (a copy per row would wait for the GPU once per row).
    ids, values = ids.tolist(), values.tolist()
    return [[(t, v) for t, v in zip(ids[i], values[i], strict=True) if v != _NEG_INF] for i in range(len(params))]
