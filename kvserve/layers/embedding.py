"""Token embedding and the LM head (which may share the embedding's weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve import distributed
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

    With tensor parallelism an untied head is split by vocabulary: each rank holds ceil(vocab / ranks) rows
    (the last rank's rows past the vocabulary are zeros), computes their logits, and the ranks gather every
    rank's columns, so that every rank samples from the same whole logits. A tied head stays whole.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        group = distributed.tp_group()
        self.tp_rank, self.tp_size = group.rank, group.size
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // self.tp_size)  # this rank's share of the vocabulary
        self.split = self.tp_size > 1  # (a tied head stays whole: tie_to)
        # Zeroed when split: the last rank's rows past the vocabulary are never loaded.
        alloc = torch.zeros if self.tp_size > 1 else torch.empty
        self.weight = nn.Parameter(alloc(self.rows, hidden_size, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]
        self.weight.shard_ids = (None,)  # type: ignore[attr-defined]

    def _load(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not self.split:
            default_weight_loader(param, loaded, shard_id)
            return
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(f"checkpoint shape {tuple(loaded.shape)} does not match the head's "
                             f"{(self.vocab_size, param.shape[1])}")
        start = self.tp_rank * self.rows
        count = max(min(self.rows, self.vocab_size - start), 0)  # 0: a last rank wholly past the vocabulary
        if count:
            default_weight_loader(param.narrow(0, 0, count), loaded.narrow(0, start, count))  # type: ignore[arg-type]

    def tie_to(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self.split = False

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The matmul runs in the model dtype, as in HF. Not widened here: at batch 64 a float32 copy of the
        # logits is ~60 MB of traffic per step that plain greedy sampling does not need.
        logits = ops.linear(hidden, self.weight)
        if not self.split:
            return logits
        gathered = distributed.all_gather(logits)  # [ranks, n, rows]
        whole = gathered.permute(1, 0, 2).reshape(hidden.shape[0], self.tp_size * self.rows)
        return whole if whole.shape[1] == self.vocab_size else whole[:, : self.vocab_size].contiguous()
