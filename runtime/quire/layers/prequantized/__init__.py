"""Checkpoints already quantized by the ecosystem's tools, kept quantized: config.json's
`quantization_config.quant_method` picks a format module (a registry line each), which reads
the file's own tensors and repacks them once into the canonical int4 / int8 / fp8 forms the
kernels take (base.py). Unsupported schemes are refused at load with one line naming the
scheme and what is supported; nothing falls back to float.

    compressed-tensors  compressed_tensors.py  int4/int8 weight-only, FP8 weights
    gptq                gptq.py                4 / 8 bits, act-order, sym or not
    awq                 awq.py                 4 bits, GEMM packing, zero points
    fp8                 fp8_blocks.py          Hugging Face fine-grained FP8 (block scales)
"""

from __future__ import annotations

import glob
import json
import os

from quire.layers.prequantized.awq import AwqConfig
from quire.layers.prequantized.base import PrequantizedConfig, UnsupportedScheme
from quire.layers.prequantized.compressed_tensors import CompressedTensorsConfig
from quire.layers.prequantized.fp8_blocks import Fp8BlockConfig
from quire.layers.prequantized.gptq import GptqConfig

FORMATS: dict[str, type[PrequantizedConfig]] = {
    "compressed-tensors": CompressedTensorsConfig,
    "gptq": GptqConfig,
    "awq": AwqConfig,
    "fp8": Fp8BlockConfig,
}

__all__ = ["FORMATS", "UnsupportedScheme", "checkpoint_quantization", "config_for"]


def checkpoint_quantization(folder: str) -> dict | None:
    """config.json's quantization_config (None: a float checkpoint)."""
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            qcfg = json.load(f).get("quantization_config")
    except (OSError, ValueError):
        return None  # the config loader reports an unreadable config
    return qcfg or None


def tensor_names(folder: str) -> set[str]:
    """Every tensor name of the folder's safetensors files (headers only)."""
    from safetensors import safe_open
    names: set[str] = set()
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            names.update(f.keys())
    return names


def config_for(folder: str, qcfg: dict, requested: str) -> PrequantizedConfig:
    """The QuantConfig for a checkpoint's quantization_config under --quantization
    `requested` (auto follows the checkpoint; a method's name must be the checkpoint's)."""
    method = str(qcfg.get("quant_method", "?")).lower()
    if method not in FORMATS:
        raise UnsupportedScheme(f"quantization_config.quant_method {method!r} is not "
                                f"supported; supported: {', '.join(FORMATS)}")
    if requested not in ("auto", method):
        raise UnsupportedScheme(f"--quantization {requested} contradicts the checkpoint, "
                                f"which is quantized with {method}; supported for it: auto or {method}")
    return FORMATS[method](qcfg, tensor_names(folder))
