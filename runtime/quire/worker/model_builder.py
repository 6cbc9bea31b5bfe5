"""Builds one rank's shard of the model and loads its weights: the same code in the engine
process (rank 0, and the whole model at tensor-parallel size 1) and in each worker."""

from __future__ import annotations

import logging

import torch

from quire import parallel_state as ps
from quire.attention.selector import attention_backend_class
from quire.config import EngineArgs
from quire.layers.quantization import describe
from quire.models import registry
from quire.models.config import ModelConfig
from quire.models.loader import ModelSource, default_dtype, iter_weights, quant_config
from quire.models.param_counts import ParameterCount
from quire.native import quant_matmul

logger = logging.getLogger(__name__)


def build_model(args: EngineArgs, source: ModelSource, cfg: ModelConfig, dtype: torch.dtype,
                device: torch.device, max_model_len: int, rank: int = 0,
                size: int = 1, stage: ps.PipelineStage | None = None) -> torch.nn.Module:
    """rank, size: the tensor-parallel shard; stage: the pipeline stage's layers (None: all)."""
    backend_cls = attention_backend_class(args.attention_backend, device)
    scale = cfg.head_dim ** -0.5
    num_heads = ps.heads_per_rank(cfg.num_heads, size)          # this rank's heads
    num_kv_heads = ps.kv_heads_per_rank(cfg.num_kv_heads, size)

    def make_backend(window, scale=scale, logit_softcap=None):
        extra = {} if logit_softcap is None else {"logit_softcap": logit_softcap}
        return backend_cls(num_heads, num_kv_heads, cfg.head_dim, scale, window, **extra)

    quant = quant_config(source, args.quantization, args.quantization_group_size)
    stage = stage or ps.PipelineStage()
    with ps.shard_as(rank, size), ps.stage_as(stage), default_dtype(dtype), device:
        model = registry.model_class(cfg.architecture)(cfg, make_backend, max_model_len, dtype, device, quant)
    if (args.runner == "pooling" or args.convert == "embed") and model.lm_head is not None:
        model.lm_head = None  # embeddings pool final hidden states (base checkpoints have none)
    counts = ParameterCount()  # from the checkpoint's shapes: the whole model's
    model.load_weights(counts.counted(iter_weights(source, cfg, args.quantization)))
    model.pack_weights()
    if device.type == "cpu":  # decode streams every packed weight: on huge pages
        packs = quant_matmul.packed_weights(model)
        if args.activation_quantization == "int8":
            rounded = sum(p.use_int8_activations() for p in packs)
            if rank == 0 and stage.is_first:
                (logger.info if rounded else logger.warning)(
                    "int8 activations for %d of %d packed weights (only int4 ones take them)",
                    rounded, len(packs))
        moved = quant_matmul.move_to_huge_pages(packs)
        if moved and rank == 0 and stage.is_first:
            logger.info("packed weights on huge pages: %.1f MB", moved / 1e6)
    elif args.activation_quantization == "int8" and rank == 0 and stage.is_first:
        logger.warning("--activation-quantization int8 is for the CPU's int4 kernels: the %s "
                       "kernels keep activations in %s", device.type, dtype)
    model.parameter_count = counts
    if rank == 0 and stage.is_first:
        logger.info("model: %s", counts.describe(model))
        logger.info("quantization %s: %s", args.quantization, describe(model))
    return model.eval()


def parameter_bytes(model: torch.nn.Module) -> int:
    """What this rank holds of the weights (a tied embedding counted once, packed copies
    included)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            total += packed.numel() * packed.element_size()
        for name in ("quant_kernel", "native_kernel"):  # a layer's packed copy (quantized,
            kernel = getattr(module, name, None)        # or a bf16 float weight's)
            if kernel is not None:
                total += kernel.extra_bytes()
        extra = getattr(module, "extra_weight_bytes", None)  # e.g. MoE experts' packed copies
        if extra is not None:
            total += extra()
    return total
