"""Lossless verification of proposed tokens (Leviathan et al. 2023; Chen et al. 2023).

Draft token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
token is resampled from normalize(max(p_i - q_i, 0)); if every draft is accepted a bonus token is drawn
from p_{k+1}. The output is then distributed exactly as sampling from the target p alone. Greedy requests
accept while the draft equals the target's argmax and then take the argmax, which is the greedy chain itself.

Every token returned costs its request one uniform, as a plain step does. For a proposer without
probabilities (n-gram: q a point mass on x_i) each position's token is the plain step's draw with its
uniform, accepted while it equals the draft (`verify_by_draws`): P(accept) = p_i(x_i), as the ratio test,
and a seeded request gives the tokens it gives without speculation, however many drafts its steps verified.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagellm.platforms.base import to_device
from pagellm.sample.draw import categorical, uniforms

_BELOW_ONE = 1.0 - 2.0 ** -53  # the largest float64 below 1: a rescaled uniform stays in [0, 1)


def verify_by_draws(draw: Callable[[int, torch.Tensor], int], draft: list[int], generator: torch.Generator | None,
                    device: torch.device | str) -> list[int]:
    """A point-mass proposer's drafts: position i's token is draw(i, u_i), u_i a [1] uniform drawn as a plain
    step draws its one; the drafts are accepted while they equal those tokens. Returns them + one more token."""
    out: list[int] = []
    for i in range(len(draft) + 1):
        tok = draw(i, uniforms([generator], device))
        out.append(tok)
        if i == len(draft) or tok != draft[i]:
            return out
    return out


def verify(target_probs: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None,
           generator: torch.Generator | None) -> list[int]:
    """target_probs: [k+1, V] (rows 0..k-1 score the drafts, row k is the bonus position);
    draft_probs: [k, V] or None for a point-mass proposer (then the inverse-CDF draw on target_probs, as
    verify_by_draws). Returns accepted drafts + one more token, one uniform spent per token. A draft model's
    rejected ratio test leaves its uniform uniform above the ratio: rescaled, it draws the residual."""
    k = len(draft)
    device = target_probs.device
    if draft_probs is None:
        return verify_by_draws(lambda i, u: int(categorical(target_probs[i][None], u)[0]), draft, generator, device)
    # p_i(x_i) and q_i(x_i) of every draft in one copy to the host each (not a wait per draft on a GPU)
    idx = to_device(draft, device)[:, None]
    p_toks = target_probs[:k].gather(1, idx).squeeze(1).tolist()
    q_toks = draft_probs[:k].gather(1, idx).squeeze(1).tolist()
    out: list[int] = []
    for i, tok in enumerate(draft):
        u = float(uniforms([generator], device)[0])
        q_tok, p_tok = q_toks[i], p_toks[i]
        if q_tok > 0 and u * q_tok < p_tok:  # u < p/q without dividing by a tiny q (p = 0 is never accepted)
            out.append(tok)
            continue
        ratio = p_tok / q_tok if q_tok > 0 else 0.0  # u >= ratio: uniform on [ratio, 1)
        # (u * q rounded may reach p = q with u < 1: then ratio is 1 and any u draws the same residual)
        u = min(max((u - ratio) / (1.0 - ratio), 0.0), _BELOW_ONE) if ratio < 1.0 else 0.0
        residual = (target_probs[i] - draft_probs[i]).clamp_min_(0.0)
        total = float(residual.sum())
        residual = target_probs[i] if total <= 0.0 else residual / total  # p == q exactly: any draw from p is right
        out.append(_draw(residual, u))
        return out
    out.append(int(categorical(target_probs[k][None], uniforms([generator], device))[0]))
    return out


def verify_greedy(target_argmax: list[int], draft: list[int]) -> list[int]:
    out = []
    for tok, best in zip(draft, target_argmax, strict=False):
        if tok != best:
            break
        out.append(tok)
    out.append(target_argmax[len(out)])
    return out


def _draw(probs: torch.Tensor, u: float) -> int:
    return int(categorical(probs[None], torch.tensor([u], dtype=torch.float64, device=probs.device))[0])
