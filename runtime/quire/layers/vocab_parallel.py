"""The vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
vocabulary's rows (the last slice padded with zero rows when the size does not divide).

Embedding: a rank looks up the ids in its slice, writes zeros for the others, and the
all-reduce sums the one non-zero row per token (exact). LM head: each rank computes the logits
of its slice; rank 0 gathers them (only it samples). A tied LM head reads the embedding's
weight; packing it for bf16 then keeps the plain table too, since lookups need it.

A quantized table (a GGUF's Q8_0 `token_embd`: int8, groups of 32) keeps the canonical
tensors (quant_formats.py); a lookup dequantizes only the rows it reads, and a tied LM head
is then an int8 linear over the very same tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quire import parallel_state as ps
from quire.layers import quant_formats as qf
from quire.layers.quantization import NO_QUANT, FloatLinearMethod, LinearMethod, QuantConfig
from quire.layers.weights import materialize, narrow, shape_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int,
                 quant_config: QuantConfig | None = None, prefix: str = "embed_tokens") -> None:
        super().__init__()
        self.tp_rank, self.tp_size = ps.tp_rank(), ps.tp_size()
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_rank
        self.prefix = prefix
        self.model_dtype = torch.get_default_dtype()  # the model is built under its dtype
        # a quantized table (None: float); the LM head (a subclass) sets its own method
        self.table_method: LinearMethod | None = None
        if type(self) is VocabParallelEmbedding:
            self.table_method = (quant_config or NO_QUANT).embedding_method(prefix)
        if self.table_method is not None:
            self.table_method.create_weights(self, hidden_size, self.rows_per_rank, None)
        else:
            self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size),
                                       requires_grad=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.table_method is None:
            return F.embedding(ids, self.weight)
        rows = [getattr(self, n)[ids] for n in self.table_method.tensor_names]
        dequantize = {qf.INT8: qf.dequantize_int8, qf.INT4: qf.dequantize_int4}
        return dequantize[self.table_method.kind](*rows).to(self.model_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = self.lookup(local.masked_fill(outside, 0))
        x.masked_fill_(outside[:, None], 0)
        return ps.all_reduce(x)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id=None) -> None:
        rows = shape_of(loaded)[0]
        if rows != self.vocab_size or shape_of(loaded)[1] != param.shape[1]:
            raise ValueError(f"weight {self.prefix} has shape {shape_of(loaded)}, "
                             f"the config implies ({self.vocab_size}, {param.shape[1]})")
        n = max(0, min(self.rows_per_rank, rows - self.vocab_start))
        if n < self.rows_per_rank:
            param.data.zero_()  # the padding rows past the vocabulary
        if n:
            param.data[:n].copy_(materialize(narrow(loaded, 0, self.vocab_start, n)))


class ParallelLMHead(VocabParallelEmbedding):
    def __init__(self, vocab_size: int, hidden_size: int,
                 quant_config: QuantConfig | None = None, prefix: str = "lm_head") -> None:
        super().__init__(vocab_size, hidden_size, prefix=prefix)
        del self.weight
        self.quant_method = (quant_config or NO_QUANT).method_for(self, prefix)
        self.quant_method.create_weights(self, hidden_size, self.rows_per_rank,
                                         torch.get_default_dtype())
        self.tied = False

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (same shard: the same vocabulary slice); a quantized
        table makes this head a linear of the same format over the same tensors."""
        self.tied = True
        if embedding.table_method is not None:
            for name, _ in list(self.named_parameters(recurse=False)):
                delattr(self, name)
            self.quant_method = embedding.table_method
            self.quant_group = embedding.quant_group
            self.keep_canonical = True  # lookups read them
            for name in self.quant_method.tensor_names:
                setattr(self, name, getattr(embedding, name))
            return
        if not isinstance(self.quant_method, FloatLinearMethod):
            raise ValueError("a tied LM head over a float embedding must be float too")
        self.weight = embedding.weight
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
