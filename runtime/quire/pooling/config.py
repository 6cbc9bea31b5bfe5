"""Which runner a model gets, and how an embedding model pools, read the way
sentence-transformers reads its checkpoint: modules.json lists the modules, the Pooling
module's config.json says how (Quire pools the last token, as Qwen3-Embedding does), a
Normalize module means unit vectors, and config_sentence_transformers.json holds the prompts
(the default one is put before every text prompt, as SentenceTransformer.encode does).
Matryoshka checkpoints say so in config.json (`is_matryoshka`, `matryoshka_dimensions`), as
vLLM reads them."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

from quire.config import EngineArgs
from quire.validation import QuireValidationError

logger = logging.getLogger(__name__)

# sentence-transformers' Pooling config keys -> the mode each names
_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}
_ST6_MODES = {"lasttoken": "last", "mean": "mean", "cls": "cls", "max": "max",
              "mean_sqrt_len_tokens": "mean_sqrt_len", "weightedmean": "weightedmean"}
SUPPORTED_POOLING = ("last",)


@dataclass(frozen=True)
class PoolerConfig:
    pooling: str = "last"              # which position's hidden state is the embedding
    normalize: bool = True             # unit vectors (a Normalize module, or the default)
    hidden_size: int = 0               # the embedding's full size
    default_prompt: str = ""           # put before every text prompt
    prompts: tuple[tuple[str, str], ...] = ()  # the checkpoint's named prompts
    is_matryoshka: bool = False        # `dimensions` may truncate it
    matryoshka_dimensions: tuple[int, ...] | None = None  # ... to one of these, if listed

    def check_dimensions(self, dimensions: int | None, field: str = "dimensions") -> None:
        """QuireValidationError naming `field` unless this model can give that size."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise QuireValidationError(
                field, "this model does not support matryoshka representation: changing its "
                "output dimensions would give poor embeddings; leave dimensions out",
                dimensions)
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or \
                not 1 <= dimensions <= self.hidden_size:
            raise QuireValidationError(
                field, f"dimensions must be an integer in [1, {self.hidden_size}], got "
                f"{dimensions!r}", dimensions)
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise QuireValidationError(
                field, f"dimensions must be one of this model's matryoshka dimensions "
                f"{list(self.matryoshka_dimensions)}, got {dimensions}", dimensions)


# architectures with an LM head (vision-language models end in ForConditionalGeneration)
_GENERATING = ("ForCausalLM", "ForConditionalGeneration")


def resolve_runner(args: EngineArgs, architecture: str) -> str:
    """'generate' or 'pooling' for a checkpoint of this architecture and these args (vLLM's
    --runner / --convert)."""
    if args.convert == "embed" or args.runner == "pooling":
        return "pooling"
    generates = architecture.endswith(_GENERATING)
    if args.runner == "generate":
        if not generates:
            raise QuireValidationError(
                "runner", f"{architecture} is a base model without an LM head: it can't "
                "generate; serve it with runner 'pooling'", args.runner)
        return "generate"
    return "generate" if generates else "pooling"


def load_pooler_config(path: str, hf_config) -> PoolerConfig:
    """The checkpoint folder's sentence-transformers files (defaults without them: last-token
    pooling, normalized, no prompt)."""
    hidden = hf_config.hidden_size
    matryoshka = bool(getattr(hf_config, "is_matryoshka", False)
                      or getattr(hf_config, "matryoshka_dimensions", None))
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    base = dict(hidden_size=hidden, is_matryoshka=matryoshka,
                matryoshka_dimensions=tuple(dims) if dims else None)
    modules = _read_json(path, "modules.json")
    if not isinstance(modules, list):
        return PoolerConfig(**base)
    pooling, normalize = "last", False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            pooling = _pooling_mode(_read_json(os.path.join(path, module.get("path", "")),
                                               "config.json") or {})
        elif kind.endswith("Normalize"):
            normalize = True
    if pooling not in SUPPORTED_POOLING:
        raise ValueError(f"the checkpoint pools by {pooling!r} (its Pooling config); Quire's "
                         f"pooling runner supports {', '.join(SUPPORTED_POOLING)} pooling")
    st = _read_json(path, "config_sentence_transformers.json") or {}
    prompts = st.get("prompts") or {}
    default = prompts.get(st.get("default_prompt_name") or "", "")
    return PoolerConfig(pooling=pooling, normalize=normalize, default_prompt=default,
                        prompts=tuple(prompts.items()), **base)


def _pooling_mode(cfg: dict) -> str:
    """sentence-transformers 6's `pooling_mode: "lasttoken"`, or the older booleans."""
    mode = cfg.get("pooling_mode")
    if isinstance(mode, str):
        return _ST6_MODES.get(mode, mode)
    modes = [mode for key, mode in _POOLING_MODES.items() if cfg.get(key)]
    return modes[0] if len(modes) == 1 else "+".join(modes) or "last"


def _read_json(folder: str, name: str):
    try:
        with open(os.path.join(folder, name)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
