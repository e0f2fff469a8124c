"""Per-sequence grammar state, and the token bitmasks one step's logits rows get from it."""

from __future__ import annotations

import torch

from pagellm.request import request_of


class GrammarError(RuntimeError):
    """A sequence's tokens left its grammar (e.g. allowed_token_ids or bad_words left no token the grammar
    allows). It concerns that request alone: `request_id` says which."""

    def __init__(self, request_id: str, message: str):
        super().__init__(f"request {request_of(request_id)}: {message}")
        self.request_id = request_id


class GrammarState:
    """One sequence's xgrammar matcher, kept equal to the sequence's output tokens.

    The matcher is never advanced by the caller: `sync` accepts whatever output tokens it has not seen
    (and rolls back any that were removed), so tokens are accepted exactly once however the engine got
    them (sampled, accepted drafts, a beam's extra token), and a preempted sequence that recomputes its
    prompt keeps a valid state: the output is kept, so there is nothing to redo."""

    def __init__(self, matcher, stop_token_ids: frozenset[int], extra_mask: torch.Tensor | None = None,
                 num_accepted: int = 0):
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.extra_mask = extra_mask  # a bitmask row ANDed into every mask (see manager.json_token_mask)
        self.num_accepted = num_accepted  # output tokens the matcher has consumed

    def fork(self) -> GrammarState:
        """An independent copy (a beam continuing from this one)."""
        return GrammarState(self.matcher.fork(), self.stop_token_ids, self.extra_mask, self.num_accepted)

    def sync(self, output_token_ids: list[int], request_id: str) -> None:
        n = len(output_token_ids)
        if n < self.num_accepted:
            self.matcher.rollback(self.num_accepted - n)
            self.num_accepted = n
        for tok in output_token_ids[self.num_accepted:]:
            if self.matcher.is_terminated() and tok in self.stop_token_ids:
                self.num_accepted += 1  # a dead beam's filler after the end (see fill)
                continue
            if not self.matcher.accept_token(tok):
                raise GrammarError(request_id, f"token {tok} at output position {self.num_accepted} is not "
                                               "allowed by the grammar")
            self.num_accepted += 1

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int, request_id: str) -> None:
        if self.matcher.is_terminated():
            # Only beam search continues a sequence past its end: a beam that ended on EOS may be kept
            # (scored -1e9, transformers' semantics) when too few others are left. It may only stop again.
            bitmask[row] = 0
            for tok in self.stop_token_ids:
                bitmask[row, tok // 32] |= _bit(tok % 32)
            return
        self._fill(bitmask, row)

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask

    def fill_drafts(self, drafts: list[int], bitmask: torch.Tensor, row: int, request_id: str) -> int:
        """Masks for a speculating sequence's 1 + len(drafts) rows: row j gets the state after drafts[:j].
        Stops at the first draft the grammar rejects (its row's mask already rejects it, so verification
        never reads the rows after it); the matcher is rolled back. Returns the drafts it accepted."""
        self.fill(bitmask, row, request_id)
        accepted = 0
        for tok in drafts:
            if not self.matcher.accept_token(tok):
                break
            accepted += 1
            if self.matcher.is_terminated():  # a stop token: nothing comes after it
                break
            self._fill(bitmask, row + accepted)
        if accepted:
            self.matcher.rollback(accepted)
        return accepted

    def valid_prefix(self, tokens: list[int]) -> tuple[int, bool]:
        """How many of `tokens` the grammar accepts in a row from the current state (left unchanged), and
        whether it rejects the next one (False where they all pass or a stop token ends them)."""
        if self.matcher.is_terminated():
            return 0, False
        n, rejected = 0, False
        for tok in tokens:
            if not self.matcher.accept_token(tok):
                rejected = True
                break
            n += 1
            if self.matcher.is_terminated():
                break
        if n:
            self.matcher.rollback(n)
        return n, rejected


def _bit(i: int) -> int:
    """Bit i of an int32 word, as a signed value (bit 31 is negative)."""
    return (1 << i) - (1 << 32 if i == 31 else 0)


def apply_grammar_masks(scheduled, logits: torch.Tensor, new_state) -> None:
    """Mask (in place, to -inf) every logits row of a sequence with a grammar to the tokens it allows.

    `scheduled` are the step's sampling ScheduledRequests in row order, each owning 1 + len(drafts) rows;
    `new_state(spec)` makes a sequence's GrammarState the first time it is needed. Only rows that have a
    grammar are filled or touched: a batch without one costs a loop over its requests."""
    rows: list[int] = []
    row = 0
    work = []
    for s in scheduled:
        n = 1 + len(s.spec_token_ids)
        if s.request.params.structured_outputs is not None:
            work.append((s, row))
            rows.extend(range(row, row + n))
        row += n
    if not work:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[1])
    for s, first in work:
        req = s.request
        if req.grammar is None:
            req.grammar = new_state(req.params.structured_outputs)
        req.grammar.sync(req.output_token_ids, req.request_id)
        if s.spec_token_ids:
            req.grammar.fill_drafts(s.spec_token_ids, bitmask, first, req.request_id)
        else:
            req.grammar.fill(bitmask, first, req.request_id)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), indices=rows)


def trim_drafts(requests, new_state) -> None:
    """Cut each constrained sequence's speculative drafts before the first one its grammar rejects, so
    no verification row is spent past it (verification would reject it anyway). A draft model's drafts
    (with their probabilities q) keep that first rejected one: rejection sampling must then draw from the
    residual (p - q)+, which the target's p alone would not give (the output leaned away from what q
    favours: a probe measured P(" is yes") 0.373 plain vs 0.277 speculative at temperature 1). Point-mass
    drafts (n-gram, greedy) lose nothing by the cut: their residual is p."""
    for req in requests:
        if not req.spec_token_ids or req.params.structured_outputs is None:
            continue
        try:
            if req.grammar is None:
                req.grammar = new_state(req.params.structured_outputs)
            req.grammar.sync(req.output_token_ids, req.request_id)
        except GrammarError:
            req.clear_spec()  # sampling meets the same error and fails this request alone
            continue
        keep, rejected = req.grammar.valid_prefix(req.spec_token_ids)
        if rejected and req.spec_draft_probs is not None:
            keep += 1  # verification rejects it (its row's mask does) and draws from the residual
        if keep < len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:keep]
            if req.spec_draft_probs is not None:
                req.spec_draft_probs = req.spec_draft_probs[:keep]
