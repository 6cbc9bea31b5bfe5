"""Reads an adapter in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`
(or `adapter_model.bin`). Checks what quire can serve and names what it can't.

The result is per transformers module ("layers.3.self_attn.q_proj"): lora_A [r, in],
lora_B [out, r] and the scaling PEFT applies (lora_alpha / r, or lora_alpha / sqrt(r) with
rslora; `rank_pattern` / `alpha_pattern` per module). Packing these into our fused layers is
`layers.py`'s job.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

# PEFT's module names -> where they live in a transformers Llama layer
SUPPORTED_TARGETS = {
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\."
                  r"(\w+)\.lora_(A|B)(?:\.\w+)?\.weight$")


@dataclass
class ModuleLoRA:
    lora_a: torch.Tensor   # [r, in]
    lora_b: torch.Tensor   # [out, r]
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class PeftAdapter:
    name: str
    rank: int                          # the largest rank of any module
    modules: dict[str, ModuleLoRA]     # "layers.3.self_attn.q_proj" -> weights


def load_peft_adapter(name: str, path: str, max_lora_rank: int) -> PeftAdapter:
    config = _read_config(name, path)
    tensors = _read_tensors(name, path)
    _check_config(name, config, max_lora_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise ValueError(f"adapter {name!r} has weight {key!r}; quire serves LoRA on "
                             f"{', '.join(SUPPORTED_TARGETS)} of the decoder layers only")
        layer, block, module, ab = m.groups()
        if module not in SUPPORTED_TARGETS or SUPPORTED_TARGETS[module] != f"{block}.{module}":
            raise ValueError(f"adapter {name!r} targets {block}.{module}; quire serves LoRA "
                             f"on {', '.join(SUPPORTED_TARGETS)} only")
        pairs.setdefault(f"layers.{layer}.{block}.{module}", {})[ab] = tensor
    if not pairs:
        raise ValueError(f"adapter {name!r} at {path} holds no LoRA weights")
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter {name!r} has lora_{''.join(ab)} but not both A and B "
                             f"for {module}")
        a, b = ab["A"].float(), ab["B"].float()
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1]:
            raise ValueError(f"adapter {name!r}: {module} has lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)}, which do not make a rank-r pair")
        r = a.shape[0]
        if r > max_lora_rank:
            raise ValueError(f"adapter {name!r} has rank {r} at {module}, more than "
                             f"max_lora_rank ({max_lora_rank})")
        modules[module] = ModuleLoRA(a, b, _scaling(config, module, r))
    return PeftAdapter(name, max(m.rank for m in modules.values()), modules)


def _read_config(name: str, path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"adapter {name!r}: no adapter_config.json in {path!r} "
                         f"(expected a folder in PEFT's format)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:  # unreadable, not UTF-8, not JSON
        raise ValueError(f"adapter {name!r}: adapter_config.json is not readable JSON "
                         f"({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"adapter {name!r}: adapter_config.json must hold a JSON object")
    return config


def _read_tensors(name: str, path: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    bin_file = os.path.join(path, "adapter_model.bin")
    try:
        if os.path.isfile(st):
            from safetensors.torch import load_file
            return load_file(st)
        if os.path.isfile(bin_file):
            return torch.load(bin_file, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a corrupt or truncated file, whatever the reader says
        file = os.path.basename(st if os.path.isfile(st) else bin_file)
        raise ValueError(f"adapter {name!r}: {file} could not be read "
                         f"({type(e).__name__}: {e})") from None
    raise ValueError(f"adapter {name!r}: no adapter_model.safetensors (or .bin) in {path!r}")


def _check_config(name: str, config: dict, max_lora_rank: int) -> None:
    def bad(field: str, why: str):
        return ValueError(f"adapter {name!r}: adapter_config.json {field!r} {why}")

    if config.get("peft_type", "LORA") != "LORA":
        raise bad("peft_type", f"is {config.get('peft_type')!r}; only LORA is served")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise bad("r", f"must be a positive integer, got {r!r}")
    if r > max_lora_rank:
        raise bad("r", f"is {r}, more than max_lora_rank ({max_lora_rank})")
    alpha = config.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise bad("lora_alpha", f"must be a number, got {alpha!r}")
    if config.get("bias", "none") != "none":
        raise bad("bias", f"is {config.get('bias')!r}; only 'none' is served")
    if config.get("use_dora"):
        raise bad("use_dora", "is set; DoRA adapters are not served")
    if config.get("fan_in_fan_out"):
        raise bad("fan_in_fan_out", "is set; Llama's linears are not Conv1D")
    if config.get("modules_to_save"):
        raise bad("modules_to_save", f"is {config['modules_to_save']!r}; only LoRA weights "
                                     f"are served, not whole modules")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in SUPPORTED_TARGETS]
        if unknown:
            raise bad("target_modules", f"has {unknown}; quire serves LoRA on "
                                        f"{', '.join(SUPPORTED_TARGETS)}")
    for key, value in (config.get("rank_pattern") or {}).items():
        if isinstance(value, int) and value > max_lora_rank:
            raise bad("rank_pattern", f"gives {key!r} rank {value}, more than max_lora_rank "
                                      f"({max_lora_rank})")


def _pattern_value(patterns: dict, module: str):
    """PEFT's rule (peft.utils.other.get_pattern_key): a key matches a module whose name ends
    with it at a dot boundary."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _scaling(config: dict, module: str, r: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, f"model.{module}")
    if alpha is None:
        alpha = config.get("lora_alpha", config["r"])
    if config.get("use_rslora"):
        return alpha / math.sqrt(r)
    return alpha / r
