"""gpt-oss: attention with a learned sink logit per head (in the softmax's denominator, no
value), q/k/v/o biases, sliding-window and full layers alternating (`layer_types`), yarn
rope; every MLP a mixture of experts: a router with a bias, top-k of its logits then a
softmax over those k, experts with biases and the clamped SwiGLU ((up + 1) * gate *
sigmoid(1.702 gate), gate and up clamped to the limit).

Its checkpoints store the experts stacked and transposed, gate and up interleaved by column:
`mlp.experts.gate_up_proj` [E, H, 2I] (+ `_bias` [E, 2I]), `mlp.experts.down_proj` [E, I, H]
(+ `_bias` [E, H]). The experts keep that memory layout (FusedMoE(transposed=True): float32
sums as transformers'); gate and up are de-interleaved on load so each rank's slice of the
intermediate size is one block. The published checkpoints' MXFP4 experts are refused.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from quire.layers.fused_moe import topk_softmax
from quire.layers.fused_moe.activation import SWIGLU_OAI
from quire.layers.weights import materialize, narrow, shape_of
from quire.models.llama import LlamaForCausalLM
from quire.models.moe import MoECausalLM, MoEDecoderLayer
from quire.native.fused_ops import rope


class GptOssDecoderLayer(MoEDecoderLayer):
    def __init__(self, cfg, backend, quant_config, prefix, moe) -> None:
        super().__init__(cfg, backend, quant_config, prefix, moe, router_bias=True)
        # this rank's heads' sinks, float32 whatever the model's dtype (backends take them so)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                  requires_grad=False)
        self.sinks.loads_itself = True

    def _attention(self, h, t, cos, sin, k_cache, v_cache, meta):
        qkv = self.qkv_proj(h)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        o = self.backend.forward(q, k, v.view(t, self.num_kv_heads, self.head_dim),
                                 k_cache, v_cache, meta, self.k_scale, self.v_scale,
                                 sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))


class GptOssForCausalLM(MoECausalLM):
    _PLAIN = {**LlamaForCausalLM._PLAIN, "mlp.router": "router"}

    def moe_layer(self, index):
        hf = self.cfg.hf
        return dict(num_experts=hf.num_local_experts, top_k=hf.num_experts_per_tok,
                    intermediate_size=hf.intermediate_size, bias=True,
                    activation=SWIGLU_OAI, swiglu_alpha=hf.swiglu_alpha,
                    swiglu_limit=hf.swiglu_limit, transposed=True,
                    router=functools.partial(topk_softmax, top_k=hf.num_experts_per_tok))

    def make_layer(self, index, quant_config):
        return GptOssDecoderLayer(self.cfg, self.backend(self.window(index)), quant_config,
                                  f"layers.{index}", self.moe_layer(index))

    def load_weights(self, weights):
        self._sinks_loaded: set[int] = set()
        super().load_weights(weights)
        lacking = [i for i in self.stage_layers if i not in self._sinks_loaded]
        if lacking:
            raise ValueError(f"the checkpoint lacks the attention sinks of layers {lacking}")

    def _load_special(self, name, tensor):
        short = name.removeprefix("model.")
        if short.startswith("layers.") and short.endswith(".self_attn.sinks"):
            if not self.stage.owns(int(short.split(".")[1])):
                return True  # another pipeline stage's
            layer = self.layers[int(short.split(".")[1])]
            n = layer.num_heads
            first = layer.qkv_proj.tp_rank * n
            if shape_of(tensor)[0] != n * layer.qkv_proj.tp_size:
                raise ValueError(f"weight {name} has shape {shape_of(tensor)}, the config "
                                 f"implies ({n * layer.qkv_proj.tp_size},)")
            layer.sinks.data.copy_(materialize(narrow(tensor, 0, first, n)).float())
            self._sinks_loaded.add(int(short.split(".")[1]))
            return True
        return super()._load_special(name, tensor)

    def load_experts(self, experts, rest, tensor, name):
        if rest.endswith(("_blocks", "_scales")):
            raise ValueError(f"{name}: gpt-oss's MXFP4 experts are not supported; load a "
                             "bfloat16 or float32 checkpoint of it (--quantization int8 or "
                             "int4 then quantizes its experts on load)")
        if rest not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
            raise ValueError(f"{name}: not a gpt-oss expert tensor")
        t = materialize(tensor)  # stacked: read whole, then each rank keeps its part
        if rest == "gate_up_proj":    # [E, H, 2I], gate and up interleaved by column
            for shard, first in (("w1", 0), ("w3", 1)):
                experts.weight_loader(experts.w13_weight, t[:, :, first::2].transpose(1, 2),
                                      None, shard)
        elif rest == "gate_up_proj_bias":
            for shard, first in (("w1", 0), ("w3", 1)):
                experts.weight_loader(experts.w13_bias, t[:, first::2], None, shard)
        elif rest == "down_proj":     # [E, I, H]
            experts.weight_loader(experts.w2_weight, t.transpose(1, 2), None, "w2")
        else:
            experts.weight_loader(experts.w2_bias, t, None, "w2")
