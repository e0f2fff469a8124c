"""Prompt logprobs as users see them: the runner's rows (pagellm/sample/prompt_logprobs.py) turned into
vLLM's shape, one dict per prompt token (None for the first, which has no context).

Where they come from: the runner scores every prompt position of a request with `prompt_logprobs` set in
the prefill's own forward, chunk by chunk. Such a request skips the prefix-cache lookup (cached KV keeps
no logits), so it recomputes its prompt; it still publishes its blocks for others. n > 1 siblings fork
after the first sequence computed the prompt, so the rows are computed once, on that sequence, and every
sample reports the same list.
"""

from __future__ import annotations

from pagellm.outputs import Logprob
from pagellm.request import Request
from pagellm.tokenizer import Tokenizer

PromptLogprobs = list[dict[int, Logprob] | None]


class PromptLogprobsState:
    """Converts a request's rows as they arrive (each token decoded once, not at every output)."""

    def __init__(self, source: Request, tokenizer: Tokenizer):
        self.source = source  # the sequence that computes the prompt (the first sample, or beam leader)
        self.tokenizer = tokenizer
        self.entries: PromptLogprobs = [None]

    def output(self) -> PromptLogprobs:
        rows = self.source.prompt_logprob_rows
        prompt = self.source.prompt_token_ids
        decode = self._decode
        for j in range(len(self.entries) - 1, len(rows)):
            row, token = rows[j], prompt[j + 1]
            entry = {tid: Logprob(lp, rank + 1, decode(tid))
                     for rank, (tid, lp) in enumerate(zip(row.top_ids, row.top_logprobs, strict=True))}
            if token in entry:
                entry[token].rank = row.rank  # equal logprobs: topk's order may differ from the true rank
            else:
                entry = {token: Logprob(row.logprob, row.rank, decode(token)), **entry}
            self.entries.append(entry)
        return self.entries

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
