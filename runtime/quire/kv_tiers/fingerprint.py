"""What decides a block's K/V bytes besides its tokens, as one digest: files and keys of
another model, dtype, block size, quantization or rank never match ours."""

from __future__ import annotations

import hashlib
import json

FORMAT_VERSION = 1  # bump when the payload layout changes


def kv_fingerprint(*, model: str, revision: str | None, dtype: str, kv_dtype: str,
                   block_size: int, quantization: str, num_layers: int, num_kv_heads: int,
                   head_dim: int, tp_rank: int = 0, tp_size: int = 1,
                   model_identity: str | None = None) -> bytes:
    """32 bytes. `model_identity`: what names the weights themselves (the config and weight
    files' sizes and times, or a Hub commit), so a changed checkpoint at the same path starts
    cold rather than reading stale K/V."""
    fields = {
        "v": FORMAT_VERSION, "model": model, "revision": revision, "dtype": dtype,
        "kv_dtype": kv_dtype, "block_size": block_size, "quantization": quantization,
        "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "tp_rank": tp_rank, "tp_size": tp_size, "identity": model_identity,
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(b"quire/kv-tier-fingerprint\0" + text.encode()).digest()
