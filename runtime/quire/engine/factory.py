"""The engine a model's args call for: LLMEngine (text generation) or PoolingEngine
(embeddings), by --runner / --convert and, for 'auto', the checkpoint's architecture."""

from __future__ import annotations

import dataclasses

from quire.collector import collector_paused
from quire.config import EngineArgs


def create_engine(args: EngineArgs, serving: bool = False):
    """Built with the collector paused (quire/collector.py: ~1 s of a SmolLM2 load)."""
    from quire.engine.engine import LLMEngine
    with collector_paused():
        runner = engine_runner(args)
        args = dataclasses.replace(args, runner=runner)  # build_model reads it, no second guess
        if runner == "pooling":
            from quire.pooling.engine import PoolingEngine
            return PoolingEngine(args, serving)
        return LLMEngine(args, serving)


def engine_runner(args: EngineArgs) -> str:
    """'generate' or 'pooling'. Only an 'auto' runner reads the checkpoint's config.json (a
    GGUF file is always a generation model)."""
    from quire.pooling.config import resolve_runner
    if args.runner == "auto" and args.convert != "embed":
        from quire.models.loader import load_hf_config, resolve_model
        source = resolve_model(args.model, args.revision, args.download_dir)
        if source.kind != "hf":
            return "generate"
        archs = getattr(load_hf_config(source, args.revision), "architectures", None) or []
        return resolve_runner(args, archs[0] if archs else "ForCausalLM")
    return "pooling" if args.convert == "embed" or args.runner == "pooling" else "generate"
