"""What a multimodal prompt is once processed: plain data for the scheduler, pixels for the
executor.

Public interface:
    ImageSpan(hash, offset, length)   one image's placeholder run in a prompt (plain data)
    ProcessedPrompt(token_ids, images, pixels, positions)
                                      the processor step's result for one prompt

The scheduler, the KV-cache manager and the batch builder see only ImageSpans (hash and
positions); the pixel inputs travel by hash to the executor (`Executor.add_images`), which
encodes them when a chunk first needs them and caches the embeddings by the same hash.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ImageSpan:
    hash: str      # sha256 hex of the image's content (images.image_hash)
    offset: int    # its first placeholder token's position in the prompt
    length: int    # placeholder tokens: the rows of its embeddings

    @property
    def digest(self) -> bytes:
        """The 32 bytes that join the block hashes of the blocks it lies in."""
        return bytes.fromhex(self.hash)

    def overlap(self, start: int, end: int) -> tuple[int, int] | None:
        """The positions of [start, end) it covers, or None."""
        first, last = max(start, self.offset), min(end, self.offset + self.length)
        return (first, last) if first < last else None


@dataclass
class ProcessedPrompt:
    token_ids: list[int]                 # with each image's placeholders expanded
    images: list[ImageSpan]              # in prompt order
    # image hash -> the processor's tensors for that image alone (the family's encoder reads
    # them: LLaVA's pixel_values [1, 3, H, W]; Qwen2.5-VL's patches [t*h*w, dim] and
    # image_grid_thw [1, 3])
    pixels: dict[str, dict] = field(default_factory=dict)
    # positions when the family's are not 0..n-1: Qwen2.5-VL's M-RoPE triples and delta
    # (quire.multimodal.mrope.MRopePositions); None for LLaVA and Gemma 3
    positions: object = None
