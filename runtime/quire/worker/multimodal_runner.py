"""The step's image embeddings: the pixels of the images in flight (by hash), the encoder
run for those a step needs that the encoder cache lacks (batched: one call per step), and
each chunk's slice of its images' embeddings at the flat batch's placeholder rows.

Public interface:
    MultiModalRunner(model, device, cache_bytes)
    add(owner, pixels)      a request's images' processor tensors, {hash: {name: tensor}}
    release(owner)          the request is done: its images' pixels may go
    gather(chunks) -> (rows [K] int64 numpy, embeddings [K, hidden]) or None
    cache                   the EncoderCache (hits and misses for metrics)
    images_encoded, encoder_seconds   lifetime totals of the encoder's work (for metrics)

The model family provides `encode_images(list of per-image tensor dicts) -> list of
[tokens, hidden] tensors`. A chunk that cuts through an image's placeholder run takes only
the rows of its positions (vLLM's way: the encoder runs with the first chunk that needs the
image, the cache serves the rest).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from quire.step_batch import SequenceChunk
from quire.worker.encoder_cache import DEFAULT_MAX_BYTES, EncoderCache


class MultiModalRunner:
    def __init__(self, model, device: torch.device, cache_bytes: int = DEFAULT_MAX_BYTES
                 ) -> None:
        self.model = model
        self.device = device
        self.cache = EncoderCache(cache_bytes)
        self._pixels: dict[str, dict] = {}         # hash -> processor tensors
        self._owners: dict[str, set[str]] = {}     # hash -> the requests holding it
        self._owned: dict[str, list[str]] = {}     # request -> its hashes
        self.images_encoded = 0
        self.encoder_seconds = 0.0

    def add(self, owner: str, pixels: dict[str, dict]) -> None:
        for h, tensors in pixels.items():
            self._pixels.setdefault(h, tensors)
            self._owners.setdefault(h, set()).add(owner)
        self._owned.setdefault(owner, []).extend(pixels)

    def release(self, owner: str) -> None:
        for h in self._owned.pop(owner, ()):
            holders = self._owners.get(h)
            if holders is None:
                continue
            holders.discard(owner)
            if not holders:
                del self._owners[h]
                self._pixels.pop(h, None)

    @property
    def num_pending(self) -> int:
        """Images whose pixels are held (their requests have not finished)."""
        return len(self._pixels)

    def gather(self, chunks: list[SequenceChunk]):
        """The flat batch's rows that are image placeholders, and their embeddings (chunks in
        the order the batch lays them out), or None when no chunk holds any."""
        if not any(c.images for c in chunks):
            return None
        needed = {im.hash for c in chunks for im in c.images}
        embeds = self._embeddings(needed)
        rows, parts, end = [], [], 0
        for c in chunks:
            first, end = end, end + len(c.token_ids)
            for im in c.images:
                if embeds[im.hash].shape[0] != im.length:  # processor and encoder disagree
                    raise RuntimeError(f"image {im.hash[:12]} has {im.length} placeholders "
                                       f"but {embeds[im.hash].shape[0]} embeddings")
                lo, hi = im.overlap(c.start, c.start + len(c.token_ids))
                rows.append(np.arange(lo, hi, dtype=np.int64) - c.start + first)
                parts.append(embeds[im.hash][lo - im.offset:hi - im.offset])
        return np.concatenate(rows), torch.cat(parts)

    def _embeddings(self, hashes: set[str]) -> dict[str, torch.Tensor]:
        found, missing = {}, []
        for h in sorted(hashes):
            value = self.cache.get(h)
            if value is None:
                missing.append(h)
            else:
                found[h] = value
        if missing:
            inputs = []
            for h in missing:
                tensors = self._pixels.get(h)
                if tensors is None:
                    raise RuntimeError(f"image {h[:12]} is needed but its pixels are gone")
                inputs.append({k: v.to(self.device) for k, v in tensors.items()})
            start = time.perf_counter()
            encoded = self.model.encode_images(inputs)
            if self.device.type == "cuda":  # the time is the encoder's, not the launch's
                torch.cuda.synchronize(self.device)
            self.encoder_seconds += time.perf_counter() - start
            self.images_encoded += len(missing)
            for h, value in zip(missing, encoded):
                self.cache.put(h, value)
                found[h] = value
        return found
