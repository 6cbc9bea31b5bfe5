"""Pre-quantized checkpoints of a tiny random Llama, written by the ecosystem's own tools
(compressed-tensors' ModelCompressor, auto-round's GPTQ and AWQ exporters, transformers' own
FP8 block quantizer), and the same weights dequantized by those libraries in float32 (the
oracle's weights). Where no tool writes a variant here (GPTQ act-order), `pack_gptq_reference`
packs it from the format's reference layout, named as such in the tests."""

from __future__ import annotations

import json
import os

import torch

from runtime_helpers import tiny_config

# hidden 128 / intermediate 256 / kv 128: every group size (32, 64, 128) and FP8's 128x128
# blocks divide every projection
TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=49152)


def tiny_float_model(dtype=torch.bfloat16, seed: int = 0):
    """The tiny Llama in `dtype` (bf16: the scales the tools write follow it, as in real
    checkpoints)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **TINY), dtype=torch.float32)
    return model.to(dtype)


# --- compressed-tensors ----------------------------------------------------------------------
def _weight_qparams(module, args):
    """min/max observer per the scheme's strategy (llm-compressor's MinMax, without it)."""
    from compressed_tensors.quantization.utils import calculate_qparams
    w = module.weight.detach().float()
    n, k = w.shape
    if args.strategy == "tensor":
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    elif args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    else:  # block
        bn, bk = args.block_structure
        b = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    return calculate_qparams(lo, hi, args)


def write_compressed_tensors(path: str, tokenizer, preset: str, fmt: str | None = None,
                             group_size: int | None = None) -> str:
    """A tiny Llama quantized with the preset scheme (W4A16, W4A16_ASYM, W8A16, FP8,
    FP8_DYNAMIC, FP8_BLOCK) by compressed-tensors itself, lm_head ignored."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    model = tiny_float_model()
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            s = getattr(module, "quantization_scheme", None)
            if s is None:
                continue
            scale, zp = _weight_qparams(module, s.weights)
            module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zp.reshape(module.weight_zero_point.shape))
            if hasattr(module, "input_scale"):  # static FP8 activations: any calibration
                module.input_scale.data.fill_(0.02)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)
    tokenizer.save_pretrained(path)
    return path


def _fp32_scales(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Scales widened to fp32 (exactly) so the libraries' own dequantization computes in
    fp32, one rounding per weight, instead of rounding each weight to bf16/fp16."""
    return {k: (v.float() if k.endswith(("_scale", "scales", "_scale_inv"))
                and v.is_floating_point() else v) for k, v in tensors.items()}


def _read(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def dequantized_compressed_tensors(path: str) -> dict[str, torch.Tensor]:
    """Each quantized module decompressed by compressed-tensors' own compressor for the
    format the config names (its model-free CompressedTensorsDequantizer re-infers the
    format and so skips naive-quantized int4), with the checkpoint's own scales: the library
    computes in their dtype (bf16 here: each weight rounded to bf16), as transformers' float32
    model does when it loads the checkpoint."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    with open(os.path.join(path, "config.json")) as f:
        qcfg = QuantizationConfig.model_validate(json.load(f)["quantization_config"])
    tensors = _read(path)
    (scheme,) = qcfg.config_groups.values()
    compressor = BaseCompressor.get_value_from_registry(scheme.format or qcfg.format)
    names = compressor.compression_param_names(scheme)
    out = {}
    for module in [n.removesuffix(".weight_scale") for n in tensors
                   if n.endswith(".weight_scale")]:
        state = {p: tensors.pop(f"{module}.{p}") for p in names
                 if f"{module}.{p}" in tensors}
        tensors.pop(f"{module}.input_scale", None)
        out[f"{module}.weight"] = compressor.decompress(state, scheme)["weight"].float()
    out.update({k: v.float() for k, v in tensors.items()})
    return out


# --- auto-round: GPTQ and AWQ ----------------------------------------------------------------
def write_auto_round(path: str, tokenizer, fmt: str, bits: int = 4, group_size: int = 32,
                     sym: bool = True) -> str:
    """auto-round's round-to-nearest (iters=0: no calibration data) exported as `fmt`
    (auto_gptq or auto_awq); the folder it writes."""
    import logging

    from auto_round import AutoRound
    logging.getLogger("auto_round").setLevel(logging.WARNING)
    model = tiny_float_model()
    ar = AutoRound(model, tokenizer, bits=bits, group_size=group_size, sym=sym, iters=0,
                   device_map="cpu", disable_opt_rtn=True)
    ar.quantize_and_save(path, format=fmt)
    found = [os.path.join(path, d) for d in os.listdir(path)
             if os.path.isdir(os.path.join(path, d))]
    return found[0] if found and not os.path.exists(os.path.join(path, "config.json")) else path


def dequantized_gptq(path: str) -> dict[str, torch.Tensor]:
    """auto-round's own GPTQ layer (auto_round_extension's torch QuantLinear) multiplies an
    identity: its weight, as it computes it, with fp32 scales."""
    from auto_round_extension.torch.qlinear_torch_zp import QuantLinear
    with open(os.path.join(path, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    tensors = _fp32_scales(_read(path))
    out = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        scales = tensors.pop(f"{module}.scales")
        k, n = tensors[name].shape[0] * 32 // qcfg["bits"], scales.shape[1]
        # its g_idx branch slices output columns by K (wrong where N != K): the plain-order
        # branch, with the file's g_idx checked to be that order
        g_idx = tensors.pop(f"{module}.g_idx")
        assert torch.equal(g_idx.long(), torch.arange(k) // qcfg["group_size"]), module
        layer = QuantLinear(qcfg["bits"], qcfg["group_size"], k, n, bias=False)
        layer.qweight = tensors.pop(name)
        layer.qzeros = tensors.pop(f"{module}.qzeros")
        layer.scales = scales
        with torch.no_grad():
            out[f"{module}.weight"] = layer(torch.eye(k)).T.contiguous()
    out.update({k: v.float() for k, v in tensors.items()})
    return out


def dequantized_awq(path: str) -> dict[str, torch.Tensor]:
    from auto_round.export.export_to_awq.utils import dequantize_gemm
    with open(os.path.join(path, "config.json")) as f:
        qcfg = json.load(f)["quantization_config"]
    tensors = _fp32_scales(_read(path))
    out = {}
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        w = dequantize_gemm(tensors.pop(name), tensors.pop(f"{module}.qzeros"),
                            tensors.pop(f"{module}.scales"), qcfg["bits"], qcfg["group_size"])
        out[f"{module}.weight"] = w.T.float().contiguous()
    out.update({k: v.float() for k, v in tensors.items()})
    return out


# --- Hugging Face fine-grained FP8 -----------------------------------------------------------
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_hf_fp8(path: str, tokenizer, block=(128, 128)) -> str:
    """transformers' own FP8 block quantizer (integrations.finegrained_fp8.Fp8Quantize, what
    it runs when it quantizes on load on a GPU) applied to each linear's weight; the config
    as transformers writes it for FineGrainedFP8Config."""
    from safetensors.torch import save_file
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    model = tiny_float_model()
    qconfig = FineGrainedFP8Config(weight_block_size=list(block))
    op = Fp8Quantize(FineGrainedFP8HfQuantizer(qconfig))
    model.save_pretrained(path)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in LINEARS:
            tensors.update(op._quantize_one(name, t.float()))
        else:
            tensors[name] = t.contiguous()
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig.to_dict()
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(path)
    return path


def dequantized_hf_fp8(path: str) -> dict[str, torch.Tensor]:
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )
    with open(os.path.join(path, "config.json")) as f:
        block = json.load(f)["quantization_config"]["weight_block_size"]
    dq = FP8BlockDequantizer.from_pretrained(path, weight_block_size=tuple(block),
                                             dtype=torch.float32)
    return {k: v.float() for k, v in dq.process(_read(path)).items()}


# --- GPTQ act-order: a reference packer (no tool here writes desc_act) ------------------------
def write_gptq_act_order_reference(path: str, tokenizer, group_size: int = 32,
                                   seed: int = 1) -> str:
    """A GPTQ v1 checkpoint with act-order (desc_act), packed by this test from the format's
    reference layout (AutoGPTQ's QuantLinear.pack): each layer input's columns are ranked by
    a random "importance" order (one per input: q/k/v and gate/up share theirs, as GPTQ's
    shared Hessian gives), g_idx[k] = rank(k) // G, then per group asymmetric 4-bit min/max
    with fp16 scales; qweight packs 8 values a word along K, qzeros (z - 1) along N."""
    from safetensors.torch import save_file
    model = tiny_float_model()
    model.save_pretrained(path)
    gen = torch.Generator().manual_seed(seed)
    orders: dict[str, torch.Tensor] = {}
    tensors = {}
    for name, t in model.state_dict().items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rsplit(".", 1)[-1] not in LINEARS:
            tensors[name] = t.contiguous()
            continue
        w = t.float()
        n, k = w.shape
        shared = module.rsplit(".", 1)[0] + ("/attn_in" if module.endswith(("q_proj", "k_proj", "v_proj"))
                                             else "/mlp_in" if module.endswith(("gate_proj", "up_proj"))
                                             else module)
        if shared not in orders:
            orders[shared] = torch.randperm(k, generator=gen)
        rank = torch.empty(k, dtype=torch.long)
        rank[orders[shared]] = torch.arange(k)
        g_idx = rank // group_size
        groups = k // group_size
        scales = torch.empty(groups, n)
        zeros = torch.empty(groups, n, dtype=torch.int32)
        q = torch.empty(k, n, dtype=torch.int32)
        for g in range(groups):
            cols = torch.nonzero(g_idx == g).flatten()
            wg = w[:, cols]
            lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8).half().float()
            z = torch.round(-lo / s).clamp(1, 15).to(torch.int32)  # v1 stores z - 1 >= 0
            scales[g], zeros[g] = s, z
            q[cols] = (torch.round(wg / s[:, None]) + z[:, None]).clamp(0, 15).T.to(torch.int32)
        tensors[f"{module}.qweight"] = _pack_rows(q)                  # [K / 8, N]
        tensors[f"{module}.qzeros"] = _pack_rows((zeros - 1).T).T.contiguous()  # [S, N / 8]
        tensors[f"{module}.scales"] = scales.half()
        tensors[f"{module}.g_idx"] = g_idx.to(torch.int32)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.remove(os.path.join(path, f))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4,
                                     "group_size": group_size, "desc_act": True, "sym": False,
                                     "checkpoint_format": "gptq", "lm_head": False}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tokenizer.save_pretrained(path)
    return path


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 4-bit values -> int32 [R / 8, C], value j of each word in bits 4j..4j+3."""
    r, c = values.shape
    v = values.to(torch.int64).reshape(r // 8, 8, c)
    words = sum(v[:, j] << (4 * j) for j in range(8))
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement int32


def dequantized_gptq_reference(path: str) -> dict[str, torch.Tensor]:
    """GPTQ's reference dequantization (GPTQModel's, which auto-round's GGUF converter copies):
    scales[g_idx] * (q - (qzeros + 1)[g_idx]), in fp32."""
    tensors = _read(path)
    out = {}
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    for name in [n for n in tensors if n.endswith(".qweight")]:
        module = name.removesuffix(".qweight")
        qw, qz = tensors.pop(name), tensors.pop(f"{module}.qzeros")
        scales = tensors.pop(f"{module}.scales").float()
        g_idx = tensors.pop(f"{module}.g_idx").long()
        q = ((qw[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qw.shape[1])
        z = ((qz[:, :, None] >> shifts) & 15).reshape(qz.shape[0], -1) + 1
        out[f"{module}.weight"] = (scales[g_idx] * (q - z[g_idx]).float()).T.contiguous()
    out.update({k: v.float() for k, v in tensors.items()})
    return out
