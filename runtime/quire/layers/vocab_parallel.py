"""The vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary's rows (the last slice padded with zero rows when the size does not divide).

Embedding: a rank looks up the ids in its slice, writes zeros for the others, and the
all-reduce sums the one non-zero row per token (exact). LM head: each rank computes the logits
of its slice; rank 0 gathers them (only it samples). A tied LM head reads the embedding's
weight; packing it for bf16 then keeps the plain table too, since lookups need it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire.distributed import parallel_state as ps
from quire.layers.quantization import NO_QUANT, FloatLinearMethod, QuantConfig
from quire.layers.weights import materialize, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size),
                                   requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x.masked_fill_(outside[:, None], 0)
        return ps.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = shape_of(loaded)[0]
        if rows != self.vocab_size or shape_of(loaded)[1] != param.shape[1]:
            raise ValueError(f"weight {type(self).__name__} has shape {shape_of(loaded)}, "
                             f"the config implies ({self.vocab_size}, {param.shape[1]})")
        n = max(0, min(self.rows_per_rank, rows - self.vocab_start))
        if n < self.rows_per_rank:
            param.data.zero_()  # the padding rows past the vocabulary
        if n:
            param.data[:n].copy_(materialize(narrow(loaded, 0, self.vocab_start, n)))


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int,
                 quant_config: QuantConfig | None = None, prefix: str = "lm_head") -> None:
        super().__init__(vocab_size, hidden_size)
        self.prefix = prefix
        del self.weight
        self.quant_method = (quant_config or NO_QUANT).method_for(self, prefix)
        self.quant_method.create_weights(self, hidden_size, self.rows_per_rank,
                                         torch.get_default_dtype())
        self.tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (same shard: the same vocabulary slice)."""
        if not isinstance(self.quant_method, FloatLinearMethod):
            raise ValueError("a tied LM head needs the float method (it is the embedding)")
        self.weight = embedding.weight
        self.tied = True
        self.keep_plain_weight = True  # lookups read it

    def process_weights_after_loading(self) -> None:
        self.quant_method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the whole vocabulary on rank 0; None on the others."""
        logits = self.quant_method.apply(self, hidden, None)
        if self.tp_size == 1:
            return logits
        logits = ps.gather_last_dim(logits, self.tp_rank, self.tp_size)
        return None if logits is None else logits[..., : self.vocab_size]
