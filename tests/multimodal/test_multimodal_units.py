"""The pieces without a model: image hashes, block hashes over image placeholders, the
encoder cache's LRU and counts, and a chunk's slice of its images' embeddings."""

from __future__ import annotations

import torch

from quire.engine.block_hash import (
    NO_EXTRA_KEYS,
    chain_root,
    extend_block_hashes,
    hash_block_tokens,
)
from quire.multimodal.images import image_hash
from quire.multimodal.inputs import ImageSpan
from quire.step_batch import SequenceChunk
from quire.worker.encoder_cache import EncoderCache
from quire.worker.multimodal_runner import MultiModalRunner

from mm_helpers import random_image

BLOCK = 4


def hashes(tokens, images=()):
    out: list[bytes] = []
    extend_block_hashes(out, tokens, BLOCK, len(tokens) // BLOCK, NO_EXTRA_KEYS, images)
    return out


def test_image_hash_is_of_the_pixels():
    a = random_image(1)
    assert image_hash(a) == image_hash(a.copy())
    assert image_hash(a) != image_hash(random_image(2))
    assert image_hash(a) != image_hash(a.convert("RGBA"))
    assert len(bytes.fromhex(image_hash(a))) == 32


def test_the_image_joins_the_hashes_of_its_blocks_only():
    tokens = list(range(100, 116))  # 4 blocks; the image's placeholders at 5..9
    a = ImageSpan(image_hash(random_image(1)), 5, 5)
    b = ImageSpan(image_hash(random_image(2)), 5, 5)
    text, with_a, with_b = hashes(tokens), hashes(tokens, [a]), hashes(tokens, [b])
    assert text[0] == with_a[0] == with_b[0]          # block 0 holds no placeholder
    assert with_a[1] != with_b[1] and with_a[1] != text[1]   # blocks 1 and 2 hold it
    assert with_a[2] != with_b[2]
    assert with_a[3] != with_b[3]                     # chained: everything after differs
    assert hashes(tokens, [a]) == with_a
    # a text block's hash is what it always was
    assert text[0] == hash_block_tokens(chain_root(), tokens[:4])


def test_encoder_cache_lru_by_bytes():
    cache = EncoderCache(max_bytes=3 * 64)       # three [4, 4] float32 entries
    for k in "abc":
        cache.put(k, torch.zeros(4, 4))
    assert cache.get("a") is not None             # a is now the most recent
    cache.put("d", torch.zeros(4, 4))             # evicts b, the least recent
    assert "b" not in cache and {"a", "c", "d"} <= {k for k in "abcd" if k in cache}
    assert cache.get("b") is None
    assert (cache.hits, cache.misses, cache.num_bytes) == (1, 1, 3 * 64)
    cache.put("big", torch.zeros(100, 100))       # larger than the budget: not kept
    assert "big" not in cache and len(cache) == 3


class _Encoder:
    """A stand-in model: an image's embeddings are its id repeated, one call per step."""

    def __init__(self):
        self.calls = []

    def encode_images(self, inputs):
        self.calls.append(len(inputs))
        return [x["pixel_values"].expand(6, 2).clone() for x in inputs]


def test_a_chunk_takes_the_rows_of_its_positions():
    model = _Encoder()
    runner = MultiModalRunner(model, torch.device("cpu"))
    im = ImageSpan("ab" * 32, offset=3, length=6)
    runner.add("r1", {im.hash: {"pixel_values": torch.tensor([[7.0]])}})
    first = SequenceChunk(list(range(5)), 0, 12, 12, [0], 0, images=[im])   # positions 0..4
    rows, embeds = runner.gather([first])
    assert rows.tolist() == [3, 4] and embeds.shape == (2, 2)
    second = SequenceChunk(list(range(7)), 5, 12, 12, [0], 1, images=[im])  # 5..11
    decode = SequenceChunk([1], 20, 12, 21, [0], 1)
    rows, embeds = runner.gather([decode, second])
    assert rows.tolist() == [1, 2, 3, 4]          # after the decode's one row
    assert model.calls == [1]                     # encoded once, the cache served the rest
    assert (runner.cache.hits, runner.cache.misses) == (1, 1)
    runner.release("r1")
    assert runner.num_pending == 0
