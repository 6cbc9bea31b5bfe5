"""Shared by the quantization tests: error bounds, tiny models written back for transformers."""

from __future__ import annotations

import torch

EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def matmul_error_bound(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype,
                       weight_rounding: float = 0.0) -> torch.Tensor:
    """Elementwise bound on |kernel - x @ w.T| when both sum the same fp32 products in a
    different order: Higham's gamma_K = K u / (1 - K u) times sum_k |x_k w_k| for each side
    (so 2 gamma_K), plus the output's rounding to out_dtype (one half-ulp of |y|, taken as a
    full ulp), plus `weight_rounding` (relative) where a kernel rounds the weight or its scale
    before the product (torch's ops: scales in bf16)."""
    k = x.shape[1]
    u = 2.0 ** -24
    gamma = k * u / (1 - k * u)
    mag = x.abs().double() @ w.abs().double().T
    y = (x.double() @ w.double().T).abs()
    return (2 * gamma + weight_rounding * (1 + gamma)) * mag + EPS[out_dtype] * y + 1e-30


def dequantized_state_dict(model) -> dict[str, torch.Tensor]:
    """A Quire LlamaForCausalLM's weights as transformers names, every quantized layer as its
    fp32 dequantized weight: load it into an HF model to run transformers on the very values
    Quire multiplies by (the oracle for quantized runs)."""
    from quire.layers.quantization import FloatLinearMethod

    def weight(layer):
        method = layer.quant_method
        if isinstance(method, FloatLinearMethod):
            return layer.weight.detach().float()
        return method.dequantized(layer)

    out = {}
    emb = model.embed_tokens
    table = (emb.weight.detach().float() if emb.table_method is None
             else emb.table_method.dequantized(emb))
    out["model.embed_tokens.weight"] = table[: emb.vocab_size]
    if not model.lm_head.tied:
        out["lm_head.weight"] = weight(model.lm_head)[: model.lm_head.vocab_size]
    out["model.norm.weight"] = model.norm.weight.detach().float()
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = weight(layer.qkv_proj).split(layer.qkv_proj.output_sizes)
        gate, up = weight(layer.gate_up_proj).split(layer.gate_up_proj.output_sizes)
        out.update({p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                    p + "self_attn.v_proj.weight": v,
                    p + "self_attn.o_proj.weight": weight(layer.o_proj),
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": weight(layer.down_proj),
                    p + "input_layernorm.weight": layer.input_layernorm.weight.float(),
                    p + "post_attention_layernorm.weight":
                        layer.post_attention_layernorm.weight.float()})
        for name, lin in (("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"),
                          ("self_attn.v_proj", "v")):
            bias = layer.qkv_proj.bias
            if bias is not None:
                parts = dict(zip("qkv", bias.detach().float().split(
                    layer.qkv_proj.output_sizes)))
                out[p + name + ".bias"] = parts[lin]
    return out


def hf_with_weights(hf_model, state: dict[str, torch.Tensor]):
    """hf_model with `state` loaded (strictly: every name must exist in it)."""
    own = hf_model.state_dict()
    missing = set(state) - set(own)
    assert not missing, f"not in the transformers model: {sorted(missing)[:4]}"
    with torch.no_grad():
        for name, t in state.items():
            own[name].copy_(t)
    return hf_model


def agreement(reference: list[list[int]], got: list[list[int]]) -> tuple[int, float]:
    """(sequences identical end to end, mean position of the first divergence)."""
    firsts = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
              for r, g in zip(reference, got)]
    identical = sum(f == len(r) and len(r) == len(g) for f, r, g in zip(firsts, reference, got))
    return identical, sum(firsts) / len(firsts)
