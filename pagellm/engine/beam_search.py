"""Beam search with transformers' semantics (generate(num_beams=k, do_sample=False, length_penalty=...)).

Each live beam is an ordinary Request. When every live beam of a group has produced the log-probs of
its next token, the group picks the next beams; each new beam forks its parent's block table (shared,
ref counted: the prompt is never copied) and the old beams' tables are dropped. A shared partial last
block is copied only when a new beam first writes into it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from pagellm.request import Request
from pagellm.sample.beam import beams_to_keep
from pagellm.sampling_params import SamplingParams

_NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class Hypothesis:
    score: float  # length-penalised
    token_ids: list[int]
    cumulative_logprob: float


@dataclass
class BeamSearchGroup:
    request_id: str
    params: SamplingParams
    prompt_len: int
    max_length: int  # prompt + max new tokens
    eos_token_ids: frozenset[int]
    beams: list[tuple[Request, float]] = field(default_factory=list)  # live beams and their logprob sums
    candidates: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    improvement_possible: bool = True
    done: bool = False
    num_expansions: int = 0

    @property
    def k(self) -> int:
        return self.params.beam_width

    def record(self, req: Request, candidates: list[tuple[int, float]]) -> None:
        self.candidates[req.request_id] = candidates

    def ready(self) -> bool:
        return not self.done and all(r.request_id in self.candidates for r, _ in self.beams)

    def advance(self) -> list[tuple[Request, int, float]]:
        """One beam-search step. Returns the next beams as (parent, token, score); [] when finished."""
        cur_len = self.beams[0][0].num_tokens
        n_keep = beams_to_keep(self.params, len(self.eos_token_ids))
        pool = [(score + lp, parent, tok) for parent, score in self.beams
                for tok, lp in self.candidates[parent.request_id]]
        top = heapq.nlargest(n_keep, pool, key=lambda c: c[0])
        self.candidates.clear()
        self.num_expansions += 1
        hits = [self._hits_stop(tok, cur_len) for _, _, tok in top]

        # Finished hypotheses: only among the best k candidates, and only while improvement is possible.
        if self.improvement_possible:
            penalty = (cur_len + 1 - self.prompt_len) ** self.params.length_penalty
            for j, (score, parent, tok) in enumerate(top[:self.k]):
                if hits[j]:
                    self.finished.append(Hypothesis(score / penalty, parent.output_token_ids + [tok], score))
            self.finished = heapq.nlargest(self.k, self.finished, key=lambda h: h.score)

        ranked = sorted(range(len(top)), key=lambda j: top[j][0] + (_NEG if hits[j] else 0.0), reverse=True)
        running = [(top[j][1], top[j][2], top[j][0] + (_NEG if hits[j] else 0.0)) for j in ranked[:self.k]]

        cur_len += 1
        if len(self.finished) == self.k:
            best = running[0][2] / ((cur_len - self.prompt_len) ** self.params.length_penalty)
            self.improvement_possible &= best > min(h.score for h in self.finished)
        if not self.improvement_possible or all(hits):
            self.done = True
            return []
        return running

    def _hits_stop(self, token: int, cur_len: int) -> bool:
        return cur_len + 1 >= self.max_length or (not self.params.ignore_eos and token in self.eos_token_ids)

    def best(self, n: int) -> list[Hypothesis]:
        return sorted(self.finished, key=lambda h: h.score, reverse=True)[:n]
