import torch
from torch import nn


class VocabEmbedding(nn.Module):
    """Token embedding. When the checkpoint ties it to the LM head and the head keeps it as packed blocks,
    the loader may drop this float copy (`tied_head` is then set): lookups read the head's rows instead."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.tied_head: nn.Module | None = None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tied_head is not None:
            return self.tied_head.quant_method.embedding_rows(self.tied_head, input_ids)
        return nn.functional.embedding(input_ids, self.weight)
