"""M-RoPE positions (Qwen2.5-VL): each prompt token's (temporal, height, width) triple, and
every later token's.

Public interface:
    MRopePositions(prompt, delta)     a prompt's [3, n] int64 triples and its delta
    MRopePositions.rows(start, end)   the triples of sequence positions [start, end): [3, k]
    MRopePositions.shifted(start, end) or None: the same as one row [k] when the range lies
                                      past the prompt (all three equal there)
    prompt_positions(hf_config, processed) -> MRopePositions, or None for a family whose
                                      positions are 0..n-1

The prompt's triples are transformers' own (`get_rope_index` of the family's model class, on
the processor's input ids, token types and image grids), so they are its to the bit. A
token at sequence position p >= n (generated, recomputed after preemption, proposed) has all
three = p + delta, delta = max triple + 1 - n, as transformers continues them. The triples
are plain data kept with the request: a chunk that starts mid-prompt (chunked prefill, a
prefix-cache hit, a recompute) slices them, never derives them from the chunk.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import numpy as np

# model_type -> transformers' model class whose get_rope_index makes the triples
_ROPE_INDEX = {
    "qwen2_5_vl": ("transformers.models.qwen2_5_vl.modeling_qwen2_5_vl", "Qwen2_5_VLModel"),
}


@dataclass(frozen=True, eq=False)
class MRopePositions:
    prompt: np.ndarray  # [3, n] int64: the prompt tokens' (t, h, w)
    delta: int          # position p >= n has (p + delta) x 3

    def rows(self, start: int, end: int) -> np.ndarray:
        n = self.prompt.shape[1]
        if end <= n:
            return self.prompt[:, start:end]
        after = np.arange(max(start, n), end, dtype=np.int64) + self.delta
        if start >= n:
            return np.broadcast_to(after, (3, len(after)))
        return np.concatenate([self.prompt[:, start:], np.broadcast_to(after, (3, len(after)))],
                              axis=1)

    def shifted(self, start: int, end: int) -> np.ndarray | None:
        """[end - start] positions when [start, end) lies past the prompt, else None."""
        if start < self.prompt.shape[1]:
            return None
        return np.arange(start, end, dtype=np.int64) + self.delta


def prompt_positions(hf_config, processed) -> MRopePositions | None:
    """The triples of a processed prompt (the processor's BatchFeature for one prompt), by
    transformers' get_rope_index for the config's family; None when the family is not
    M-RoPE."""
    where = _ROPE_INDEX.get(hf_config.model_type)
    if where is None:
        rope = getattr(hf_config.get_text_config(), "rope_parameters", None) or {}
        if rope.get("mrope_section"):
            raise ValueError(f"M-RoPE positions for model type {hf_config.model_type!r} are "
                             f"not supported; supported: {', '.join(_ROPE_INDEX)}")
        return None
    model_class = getattr(importlib.import_module(where[0]), where[1])
    ids = processed["input_ids"]
    types = processed.get("mm_token_type_ids")
    if types is None:  # a processor that doesn't return them: images are the only kind here
        types = (ids == hf_config.image_token_id).int()
    index = _RopeIndex(model_class, hf_config)
    positions, delta = index.get_rope_index(ids, mm_token_type_ids=types,
                                            image_grid_thw=processed.get("image_grid_thw"))
    return MRopePositions(positions[:, 0].numpy().astype(np.int64), int(delta.reshape(-1)[0]))


class _RopeIndex:
    """What transformers' get_rope_index reads of its model (the config, and the helper it
    calls), without building the model: its own functions run on this."""

    def __init__(self, model_class, config) -> None:
        self.config = config
        self.get_rope_index = model_class.get_rope_index.__get__(self)
        self.get_vision_position_ids = model_class.get_vision_position_ids.__get__(self)
