"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import ops
from kvserve.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """input_ids int64 [num_tokens] -> [num_tokens, hidden_size]; weight [vocab_size, hidden_size]."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(nn.Module):
    """hidden [n, hidden_size] -> logits [n, vocab_size] in the model dtype (the sampler widens them to
    float32 where it computes on them; greedy argmax reads them as they are).

    With tied embeddings, `tie_to(embedding)` makes the head use the embedding's weight (one tensor, loaded
    once from `embed_tokens`); the checkpoint then has no `lm_head.weight`.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype, as in HF. Not widened here: at batch 64 a float32 copy of the
        # logits is ~60 MB of traffic per step that plain greedy sampling does not need.
        return ops.linear(hidden, self.weight)
