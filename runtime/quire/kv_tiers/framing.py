"""The self-checking record that disk files and remote values hold.

    magic (8) | fingerprint (32) | block hash (32) | payload length (8, little-endian)
    | SHA-256 of the payload (32) | payload

`unframe` returns the payload only when every field matches what the reader expects: another
model's file (fingerprint), a file renamed or copied over another (hash), a truncated or
flipped one (length, checksum) are all misses, never wrong K/V.
"""

from __future__ import annotations

import hashlib
import struct

MAGIC = b"QUIREKV1"
_HEADER = struct.Struct("<8s32s32sQ32s")
HEADER_SIZE = _HEADER.size


class FrameError(ValueError):
    """A record that must not be used; the message says which check failed."""


def frame(fingerprint: bytes, block_hash: bytes, payload: bytes) -> bytes:
    return _HEADER.pack(MAGIC, fingerprint, block_hash, len(payload),
                        hashlib.sha256(payload).digest()) + payload


def unframe(data: bytes, fingerprint: bytes, block_hash: bytes) -> bytes:
    if len(data) < HEADER_SIZE:
        raise FrameError(f"truncated header ({len(data)} bytes)")
    magic, fp, h, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("not a Quire KV record")
    if fp != fingerprint:
        raise FrameError("written for another model or configuration (fingerprint differs)")
    if h != block_hash:
        raise FrameError("holds another block (hash differs)")
    payload = data[HEADER_SIZE:]
    if len(payload) != length:
        raise FrameError(f"truncated payload ({len(payload)} of {length} bytes)")
    if hashlib.sha256(payload).digest() != digest:
        raise FrameError("checksum mismatch")
    return payload
