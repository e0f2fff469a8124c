import torch
from torch import nn


class VocabEmbedding(nn.Module):
    """Token embedding. When the checkpoint ties it to the LM head and the head keeps it as packed blocks,
    the loader may drop this float copy (`tied_head` is then set): lookups read the head's rows instead."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.tied_head: nn.Module | None = None
        # vocab-parallel (tensor parallelism): this rank's token ids [lo, hi) and the all-reduce that sums
        # the ranks' lookups (zeros for ids outside the range)
        self.vocab_range: tuple[int, int] | None = None
        self.reduce = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_range is None:
            return self._rows(input_ids)
        lo, hi = self.vocab_range
        outside = (input_ids < lo) | (input_ids >= hi)
        x = self._rows((input_ids - lo).masked_fill_(outside, 0))
        return self.reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tied_head is not None:
            return self.tied_head.quant_method.embedding_rows(self.tied_head, ids)
        return nn.functional.embedding(ids, self.weight)
