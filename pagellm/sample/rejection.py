"""Lossless verification of proposed tokens (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
token is resampled from normalize(max(p_i - q_i, 0)); if every draft is accepted a bonus token is drawn
from p_{k+1}. The output is then distributed exactly as sampling from the target p alone. For a
proposer without probabilities (n-gram) q is a point mass on x_i. Greedy requests accept while the
draft equals the target's argmax and then take the argmax, which is the greedy chain itself.
"""

from __future__ import annotations

import torch

from pagellm.platforms.base import to_device
from pagellm.sample.draw import categorical, uniforms


def verify(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """target_probs: [k+1, V] (rows 0..k-1 score the drafts, row k is the bonus position);
    draft_probs: [k, V] or None for a point-mass proposer. Returns accepted drafts + one more token."""
    k = len(draft)
    device = target_probs.device
    uniforms = torch.rand(k + 1, generator=generator, device=generator.device if generator else device).tolist()
    # p_i(x_i) and q_i(x_i) of every draft in one copy to the host each (not a wait per draft on a GPU)
    idx = to_device(draft, device)[:, None]
    p_toks = target_probs[:k].gather(1, idx).squeeze(1).tolist()
    q_toks = [1.0] * k if draft_probs is None else draft_probs[:k].gather(1, idx).squeeze(1).tolist()
    out: list[int] = []
    for i, tok in enumerate(draft):
        p = target_probs[i]
        q_tok, p_tok = q_toks[i], p_toks[i]
        if q_tok > 0 and uniforms[i] * q_tok <= p_tok:  # u < p/q without dividing by a tiny q
            out.append(tok)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[tok] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min_(0.0)
        total = float(residual.sum())
        residual = p if total <= 0.0 else residual / total  # p == q exactly: any draw from p is right
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(target_probs[k], generator))
    return out


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    out = []
    for tok, best in zip(draft, target_argmax, strict=False):
        if tok != best:
            break
        out.append(tok)
    out.append(target_argmax[len(out)])
    return out


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(categorical(probs[None], uniforms([generator], probs.device))[0])
