"""Helpers shared by the MoE tests: a FusedMoE filled with random experts, and the same
experts copied out of transformers' own MoE blocks."""

from __future__ import annotations

import functools

import torch

from quire.layers.fused_moe import FusedMoE, softmax_topk, topk_softmax


def random_moe(num_experts=6, top_k=2, hidden=64, inter=32, bias=False, activation="silu",
               quant_config=None, seed=0, dtype=torch.float32, keep_canonical=False, **kw):
    """A FusedMoE with random experts (loaded expert by expert, as from a checkpoint) and its
    float weights: (layer, {"w1": [E, I, H], "w3": ..., "w2": [E, H, I], biases})."""
    g = torch.Generator().manual_seed(seed)
    router = (functools.partial(topk_softmax, top_k=top_k) if activation == "swigluoai"
              else functools.partial(softmax_topk, top_k=top_k, renormalize=True))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = FusedMoE(num_experts, top_k, hidden, inter, router, bias=bias,
                         activation=activation, quant_config=quant_config,
                         prefix="layers.0.mlp.experts", **kw)
    finally:
        torch.set_default_dtype(old)
    layer.keep_canonical = keep_canonical
    full = {"w1": torch.randn(num_experts, inter, hidden, generator=g) * 0.2,
            "w3": torch.randn(num_experts, inter, hidden, generator=g) * 0.2,
            "w2": torch.randn(num_experts, hidden, inter, generator=g) * 0.2}
    if bias:
        full.update(b1=torch.randn(num_experts, inter, generator=g),
                    b3=torch.randn(num_experts, inter, generator=g),
                    b2=torch.randn(num_experts, hidden, generator=g))
    load_into(layer, full, dtype)
    return layer, full


def load_into(layer, full, dtype=torch.float32) -> None:
    params = dict(layer.named_parameters())
    w13 = params.get("w13_weight")
    if w13 is None:  # quantized checkpoint tensors are not what these helpers write
        raise ValueError("load_into writes float weights")
    for e in range(layer.num_experts):
        for shard in ("w1", "w3"):
            layer.weight_loader(w13, full[shard][e].to(dtype), e, shard)
    if layer.w13_bias is not None:
        layer.weight_loader(layer.w13_bias, full["b1"].to(dtype), None, "w1")
        layer.weight_loader(layer.w13_bias, full["b3"].to(dtype), None, "w3")
        layer.weight_loader(layer.w2_bias, full["b2"].to(dtype), None, "w2")
    for e in range(layer.num_experts):
        layer.weight_loader(params["w2_weight"], full["w2"][e].to(dtype), e, "w2")


def routed(num_tokens, num_experts, hidden=64, seed=1, dtype=torch.float32):
    """Random tokens, and router logits that spread them over every expert."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, hidden, generator=g).to(dtype),
            torch.randn(num_tokens, num_experts, generator=g).to(dtype))


MOE_FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")


def tiny_moe_config(family: str, **overrides):
    """8 experts, top-2, hidden 64, 3 layers; Qwen3-MoE with a dense layer (mlp_only_layers);
    gpt-oss with 32-token windows on its sliding layers (0 and 2), under the prompts' 300."""
    import transformers
    common = dict(vocab_size=49152, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  initializer_range=0.08, bos_token_id=1, eos_token_id=2,
                  num_experts_per_tok=2)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(**common, num_local_experts=8, intermediate_size=32)
    elif family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=32,
                                          intermediate_size=96, mlp_only_layers=[1],
                                          norm_topk_prob=True)
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(**common, num_local_experts=8, intermediate_size=32,
                                        sliding_window=32)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def save_tiny_moe(path: str, config, tokenizer, seed: int = 0) -> str:
    """A random model of `config` saved as transformers saves it, with its norms, biases and
    attention sinks randomized too (they start at one, zero and near zero); a router's bias
    stays small, so that the tokens' own logits still pick the experts."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("router.bias"):
                p.normal_(0, 0.05)
            elif name.endswith(("bias", "sinks")):
                p.normal_(0, 0.1 if name.endswith("bias") else 1.0)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
