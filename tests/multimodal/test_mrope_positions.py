"""M-RoPE without the engine: a prompt's (t, h, w) triples are transformers' get_rope_index
to the element, the runner's per-chunk positions slice them wherever a chunk starts (chunked
prefill, a prefix hit mid-prompt, a recompute across the prompt's end), and the rotary's
cos/sin over them are transformers' Qwen2_5_VLRotaryEmbedding's to the bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quire.models.rope import MRotaryEmbedding
from quire.multimodal.mrope import prompt_positions
from quire.step_batch import SequenceChunk
from quire.worker.model_runner import mrope_positions

from mm_helpers import random_image
from qwen_vl_helpers import IMAGE

TEXT = f"USER: look at {IMAGE} and at {IMAGE} then say. ASSISTANT:"
GENERATED = 6


@pytest.fixture(scope="module")
def prompt(qwen_vl_oracle):
    """(processor outputs, our MRopePositions, transformers' triples of the prompt and of
    GENERATED tokens after it, [3, n + GENERATED])."""
    model, processor = qwen_vl_oracle
    images = [random_image(30, (140, 112)), random_image(31, (300, 200))]
    out = processor(text=TEXT, images=images, return_tensors="pt")
    want, delta = model.model.get_rope_index(
        out["input_ids"], mm_token_type_ids=out["mm_token_type_ids"],
        image_grid_thw=out["image_grid_thw"])
    n = out["input_ids"].shape[1]
    after = np.arange(n, n + GENERATED) + int(delta)  # as generate continues them
    full = np.concatenate([want[:, 0].numpy(), np.stack([after] * 3)], axis=1)
    return out, prompt_positions(model.config, out), full


def test_prompt_triples_are_transformers(prompt, qwen_vl_oracle):
    out, ours, full = prompt
    n = out["input_ids"].shape[1]
    assert ours.prompt.dtype == np.int64 and ours.prompt.shape == (3, n)
    assert np.array_equal(ours.prompt, full[:, :n])
    assert ours.delta == full[0, n] - n < 0  # images take fewer positions than tokens
    assert not np.array_equal(ours.prompt[0], ours.prompt[1])  # the image's rows differ
    model, processor = qwen_vl_oracle
    text_only = processor(text="no image here", return_tensors="pt")
    assert prompt_positions(model.config, text_only).delta == 0


def chunk(lo: int, hi: int, n: int, mrope) -> SequenceChunk:
    return SequenceChunk(token_ids=[0] * (hi - lo), start=lo, num_prompt_tokens=n,
                         num_tokens=max(hi, n), block_table=[0], num_samples=0, mrope=mrope)


def runner_positions(chunks):
    """What the model runner builds before it asks for the rotary's positions."""
    positions = np.concatenate([np.arange(c.start, c.start + len(c.token_ids))
                                for c in chunks]).astype(np.int64)
    qsl = np.concatenate([[0], np.cumsum([len(c.token_ids) for c in chunks])])
    return mrope_positions(chunks, positions, qsl)


def test_chunks_slice_the_stored_triples(prompt, qwen_vl_oracle):
    out, ours, full = prompt
    n = out["input_ids"].shape[1]
    image = out["input_ids"][0].tolist().index(qwen_vl_oracle[0].config.image_token_id)
    # prefill cut mid-image, a prefix hit that resumes mid-image, a text prompt's chunk
    cuts = [(0, image + 3), (image + 3, n - 4), (image + 7, n)]
    chunks = [chunk(lo, hi, n, ours) for lo, hi in cuts] + [chunk(0, 5, 5, None)]
    got = runner_positions(chunks)
    want = np.concatenate([full[:, lo:hi] for lo, hi in cuts]
                          + [np.stack([np.arange(5)] * 3)], axis=1)
    assert got.shape == want.shape and np.array_equal(got, want)
    # a recompute after preemption runs across the prompt's end into generated tokens
    assert np.array_equal(runner_positions([chunk(n - 3, n + 4, n, ours)]),
                          full[:, n - 3:n + 4])


def test_rows_past_every_prompt_are_one_shifted_row(prompt):
    """Decodes and verification rows: all three positions are p + delta, so the runner
    hands [T] (the plain table's rows, and what CUDA graphs replay)."""
    out, ours, full = prompt
    n = out["input_ids"].shape[1]
    chunks = [chunk(n + 2, n + 3, n, ours), chunk(9, 10, 9, None), chunk(n, n + 1, n, ours)]
    got = runner_positions(chunks)
    assert got.ndim == 1 and got.tolist() == [full[0, n + 2], 9, full[0, n]]
    assert runner_positions([chunk(0, 4, 4, None)]) is None  # text only: `positions` serve


def test_rotary_tables_are_transformers(prompt, qwen_vl_oracle):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding
    model, _ = qwen_vl_oracle
    text = model.config.text_config
    _, _, full = prompt
    hf_rope = Qwen2_5_VLRotaryEmbedding(text)
    positions = torch.from_numpy(full)
    want_cos, want_sin = hf_rope(torch.zeros(1), positions[:, None, :])
    rope = MRotaryEmbedding(16, 10000.0, None, text.max_position_embeddings, 1024,
                            torch.float32, torch.device("cpu"),
                            mrope_section=text.rope_parameters["mrope_section"])
    cos, sin = rope.cos_sin(positions)
    assert torch.equal(cos, want_cos[0]) and torch.equal(sin, want_sin[0])
    # equal rows: the plain table is the same
    flat = positions[0, -GENERATED:]
    cos1, sin1 = rope.cos_sin(flat)
    cos3, sin3 = rope.cos_sin(flat.expand(3, -1))
    assert torch.equal(cos1, cos3) and torch.equal(sin1, sin3)
    with pytest.raises(ValueError, match="must sum to 8"):
        MRotaryEmbedding(16, 10000.0, None, 1024, 1024, torch.float32, torch.device("cpu"),
                         mrope_section=[2, 2, 2])

