"""Lossless verification of proposed tokens (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
token is resampled from normalize(max(p_i - q_i, 0)); if every draft is accepted a bonus token is drawn
from p_{k+1}. The output is then distributed exactly as sampling from the target p alone. For a
proposer without probabilities (n-gram) q is a point mass on x_i. Greedy requests accept while the
draft equals the target's argmax and then take the argmax, which is the greedy chain itself. Every token
returned costs its request one uniform, as a plain step does (`verify`), so a seeded request's output does not
depend on how many drafts its steps verified.
"""

from __future__ import annotations

import torch

from pagellm.platforms.base import to_device
from pagellm.sample.draw import categorical, uniforms


def verify(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """target_probs: [k+1, V] (rows 0..k-1 score the drafts, row k is the bonus position);
    draft_probs: [k, V] or None for a point-mass proposer. Returns accepted drafts + one more token.

    One uniform per token returned, drawn as a plain sampling step draws its one: a seeded request's generator
    is then where the same request without drafts would have it, whatever number of drafts each step verified
    (the adaptive controller, the step budget and preemption all change that number). For a point-mass
    proposer (n-gram) each position's token is the plain inverse-CDF draw with its uniform, accepted while it
    equals the draft: P(accept) = p_i(x_i), the same as the ratio test, and the tokens are those plain decoding
    gives with the same uniforms. For a draft model, the ratio test's uniform, once rejected, is uniform above
    the ratio: rescaled, it draws the residual."""
    k = len(draft)
    device = target_probs.device
    if draft_probs is None:
        out: list[int] = []
        for i in range(k + 1):
            tok = _draw(target_probs[i], _uniform(generator, device))
            out.append(tok)
            if i == k or tok != draft[i]:
                return out
    # p_i(x_i) and q_i(x_i) of every draft in one copy to the host each (not a wait per draft on a GPU)
    idx = to_device(draft, device)[:, None]
    p_toks = target_probs[:k].gather(1, idx).squeeze(1).tolist()
    q_toks = draft_probs[:k].gather(1, idx).squeeze(1).tolist()
    out = []
    for i, tok in enumerate(draft):
        u = _uniform(generator, device)
        q_tok, p_tok = q_toks[i], p_toks[i]
        if q_tok > 0 and u * q_tok <= p_tok:  # u < p/q without dividing by a tiny q
            out.append(tok)
            continue
        ratio = p_tok / q_tok if q_tok > 0 else 0.0  # < 1 here; u >= ratio, uniform on [ratio, 1)
        u = min(max((u - ratio) / (1.0 - ratio), 0.0), _BELOW_ONE)
        residual = (target_probs[i] - draft_probs[i]).clamp_min_(0.0)
        total = float(residual.sum())
        residual = target_probs[i] if total <= 0.0 else residual / total  # p == q exactly: any draw from p is right
        out.append(_draw(residual, u))
        return out
    out.append(_draw(target_probs[k], _uniform(generator, device)))
    return out


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    out = []
    for tok, best in zip(draft, target_argmax, strict=False):
        if tok != best:
            break
        out.append(tok)
    out.append(target_argmax[len(out)])
    return out


_BELOW_ONE = 1.0 - 2.0 ** -53  # the largest float64 below 1: a rescaled uniform stays in [0, 1)


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    """The next uniform of this request, as a plain sampling step draws it (draw.uniforms)."""
    return float(uniforms([generator], device)[0])


def _draw(probs: torch.Tensor, u: float) -> int:
    return int(categorical(probs[None], torch.tensor([u], dtype=torch.float64, device=probs.device))[0])
