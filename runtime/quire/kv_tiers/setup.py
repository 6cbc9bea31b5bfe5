"""Builds the engine's tier chain and KV-events recorder from its arguments (engine.py calls
`build_kv_tiers` once, after the KV pool is sized)."""

from __future__ import annotations

import logging
import os

from quire.kv_tiers.chain import TierChain
from quire.kv_tiers.fingerprint import kv_fingerprint

logger = logging.getLogger(__name__)


def build_kv_tiers(args, *, model_path: str, dtype, kv_dtype, num_layers: int,
                   num_kv_heads: int, head_dim: int, tp_rank: int = 0):
    """(TierChain or None, KVEventRecorder or None) for these EngineArgs."""
    recorder = None
    events = args.kv_events  # parsed once, with the other args
    if events is not None:
        from quire.kv_events.publisher import ZmqEventPublisher
        from quire.kv_events.recorder import KVEventRecorder
        recorder = KVEventRecorder(ZmqEventPublisher(events), args.block_size)
    config = args.kv_offload
    if not config.enabled:
        return None, recorder
    fingerprint = kv_fingerprint(
        model=os.path.basename(os.path.normpath(model_path)), revision=args.revision,
        dtype=str(dtype), kv_dtype=str(kv_dtype), block_size=args.block_size,
        quantization=args.quantization, num_layers=num_layers, num_kv_heads=num_kv_heads,
        head_dim=head_dim, tp_rank=tp_rank, tp_size=args.tensor_parallel_size,
        model_identity=model_identity(model_path))
    tiers = []
    if config.host_bytes:
        from quire.kv_tiers.host import HostTier
        tiers.append(HostTier(config.host_bytes))
    if config.disk_path:
        from quire.kv_tiers.disk import DiskTier
        tiers.append(DiskTier(config.disk_path, config.disk_bytes, fingerprint))
    if config.remote_url:
        from quire.kv_tiers.remote import RemoteTier
        tiers.append(RemoteTier(config.remote_url, fingerprint))
    logger.info("KV tiers: %s", ", ".join(_describe(t) for t in tiers))
    return TierChain(tiers, recorder), recorder


def model_identity(path: str) -> str:
    """The weights' and config's names, sizes and modification times: a checkpoint replaced
    at the same path gets another fingerprint (its old blocks are never read)."""
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path)
        if f.endswith((".safetensors", ".bin", ".gguf", ".json")))
    parts = []
    for f in files:
        try:
            st = os.stat(f)
        except OSError:
            continue
        parts.append(f"{os.path.basename(f)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)


def _describe(tier) -> str:
    if tier.name == "host":
        return f"host {tier.capacity_bytes / 2**30:.2f} GiB"
    if tier.name == "disk":
        return f"disk {tier.root} {tier.capacity_bytes / 2**30:.2f} GiB"
    return f"remote {tier.url}"
