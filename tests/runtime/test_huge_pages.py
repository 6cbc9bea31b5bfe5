"""Packed weights on transparent huge pages (quire/native/huge_pages.py): the arena's copies
hold the same values in a mapping madvised MADV_HUGEPAGE, the packed weights moved there give
the same bits, each original is dropped as it is copied, and an engine on the CPU moves its
model's packed weights there (QUIRE_HUGE_PAGES=0: nowhere) with the same greedy output."""

from __future__ import annotations

import gc
import logging
import weakref

import pytest
import torch
from moe_helpers import save_tiny_moe, tiny_moe_config

from quire import LLM, SamplingParams
from quire.native import huge_pages, quant_matmul

from runtime_helpers import assert_no_blocks_in_use, random_prompts, save_tiny_model, tiny_config


def _thp_mode() -> str:
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        return f.read().split("[")[1].split("]")[0]


def _madvised_huge(address: int) -> bool:
    """Whether the mapping holding `address` carries MADV_HUGEPAGE ("hg" in its VmFlags)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    return False


def test_the_machine_offers_what_the_module_says():
    # this kernel's mode decides: `never` moves nothing, anything else moves
    assert huge_pages.available() == (_thp_mode() != "never")


@pytest.mark.parametrize("mode,expected", [("always [madvise] never", True),
                                           ("[always] madvise never", True),
                                           ("always madvise [never]", False)])
def test_the_kernels_mode_decides(tmp_path, monkeypatch, mode, expected):
    fake = tmp_path / "enabled"
    fake.write_text(mode + "\n")
    monkeypatch.setattr(huge_pages, "_THP_MODE", str(fake))
    assert huge_pages.available() is expected
    assert (huge_pages.arena(1 << 20) is None) is not expected
    monkeypatch.setattr(huge_pages, "_THP_MODE", str(tmp_path / "absent"))  # no THP at all
    assert not huge_pages.available()


def test_without_madvise_nothing_moves(monkeypatch):
    import mmap
    monkeypatch.delattr(mmap, "MADV_HUGEPAGE")
    assert not huge_pages.available() and huge_pages.arena(1 << 20) is None


def test_arena_copies_are_equal_aligned_and_madvised():
    tensors = [torch.randn(3, 5), torch.randint(0, 255, (7,), dtype=torch.uint8),
               torch.randn(16, 33).bfloat16(), torch.empty(0, dtype=torch.float16)]
    arena = huge_pages.Arena(huge_pages.footprint(tensors))
    copies = [arena.copy(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
        assert c.data_ptr() != t.data_ptr() or not t.numel()  # (empty ones point nowhere)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    assert all(c.data_ptr() % 64 == 0 for c in copies)
    assert _madvised_huge(copies[0].data_ptr())
    del arena  # the copies keep the mapping
    gc.collect()
    assert torch.equal(copies[2], tensors[2])


def test_arena_refuses_what_does_not_fit_or_is_not_contiguous():
    arena = huge_pages.Arena(64)
    with pytest.raises(ValueError, match="contiguous"):
        arena.copy(torch.randn(4, 4).t())
    arena.copy(torch.randn(16))  # exactly 64 bytes
    with pytest.raises(ValueError, match="do not fit"):
        arena.copy(torch.randn(1))


def test_turned_off_there_is_no_arena(monkeypatch):
    monkeypatch.setenv("QUIRE_HUGE_PAGES", "0")
    assert not huge_pages.available() and huge_pages.arena(1 << 20) is None
    packed = quant_matmul.pack_int8(torch.randint(-128, 128, (32, 64), dtype=torch.int8),
                                    torch.rand(32, 2), 32)
    before = packed.qweight.data_ptr()
    assert quant_matmul.move_to_huge_pages([packed]) == 0
    assert packed.qweight.data_ptr() == before


def _packs():
    g = torch.Generator().manual_seed(0)
    n, k = 48, 128
    q4 = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    d = torch.rand(n, k // 32, generator=g).half().float() * 0.01
    m = -torch.rand(n, k // 32, generator=g).half().float() * 0.1
    return [quant_matmul.pack_int4(q4, d, m + 8 * d, 32),
            quant_matmul.pack_int8(torch.randint(-128, 128, (n, k), dtype=torch.int8,
                                                 generator=g), torch.rand(n, k // 32), 32),
            quant_matmul.pack_bf16(torch.randn(n, k, generator=g).bfloat16())]


def test_moved_packed_weights_give_the_same_bits_and_drop_their_originals():
    packs = _packs()
    linears = [quant_matmul.int4_linear, quant_matmul.int8_linear, quant_matmul.bf16_linear]
    xs = [torch.randn(m, 128).to(dt) for m in (1, 3, 9) for dt in (torch.float32, torch.bfloat16)]
    before = [[f(x, p) for x in xs] for f, p in zip(linears, packs)]
    originals = [weakref.ref(t) for p in packs for t in p.tensors()]
    moved = quant_matmul.move_to_huge_pages(packs)
    gc.collect()
    if not huge_pages.available():
        assert moved == 0 and all(r() is not None for r in originals)
        return
    assert moved == sum(p.nbytes() for p in packs)
    assert all(r() is None for r in originals)  # nothing holds the old copies
    for p in packs:
        assert _madvised_huge(p.qweight.data_ptr())
        assert p._struct.q == p.qweight.data_ptr() and p._struct.scales == p.scales.data_ptr()
    after = [[f(x, p) for x in xs] for f, p in zip(linears, packs)]
    for b_rows, a_rows in zip(before, after):
        for b, a in zip(b_rows, a_rows):
            assert torch.equal(a, b)


_MOVED = "packed weights on huge pages"  # model_builder's log line when it moved them


def test_an_engine_keeps_its_packed_weights_on_huge_pages(tmp_path, smollm_tokenizer,
                                                          monkeypatch, caplog):
    # (whether memory torch allocated is madvised says nothing: oneDNN and others madvise
    # their own buffers, which malloc hands out again later; the log says what moved)
    path = save_tiny_model(str(tmp_path / "tiny"), tiny_config("llama"), smollm_tokenizer)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(4, lengths=[5, 17, 40, 90])]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    threads = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="quire.worker.model_builder"):
            llm = LLM(path, quantization="int4", dtype="bfloat16", kv_cache_memory=16 << 20)
        packs = quant_matmul.packed_weights(llm.engine.executor.model)
        assert len(packs) == 3 * 4 + 1  # 3 layers x qkv, o, gate_up, down; the LM head
        assert (_MOVED in caplog.text) == huge_pages.available()
        if huge_pages.available():
            assert all(_madvised_huge(p.qweight.data_ptr()) for p in packs)
        out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert_no_blocks_in_use(llm)
        caplog.clear()
        monkeypatch.setenv("QUIRE_HUGE_PAGES", "0")
        with caplog.at_level(logging.INFO, logger="quire.worker.model_builder"):
            plain = LLM(path, quantization="int4", dtype="bfloat16", kv_cache_memory=16 << 20)
        assert _MOVED not in caplog.text
        assert [o.outputs[0].token_ids
                for o in plain.generate(prompts, params, use_tqdm=False)] == out
    finally:
        torch.set_num_threads(threads)


def test_an_moe_engine_moves_its_experts_too(tmp_path, smollm_tokenizer):
    path = save_tiny_moe(str(tmp_path / "moe"), tiny_moe_config("mixtral"), smollm_tokenizer)
    threads = torch.get_num_threads()
    try:
        llm = LLM(path, quantization="int8", dtype="float32", kv_cache_memory=4 << 20)
        model = llm.engine.executor.model
        experts = [k.packed for m in model.modules()
                   for ks in (getattr(m, "expert_kernels", None) or {}).values() for k in ks]
        assert len(experts) == 3 * 2 * 8  # 3 layers x (w13, w2) x 8 experts
        packs = quant_matmul.packed_weights(model)
        assert {id(p) for p in experts} <= {id(p) for p in packs}
        if huge_pages.available():
            assert all(_madvised_huge(p.qweight.data_ptr()) for p in packs)
        out = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 8
        assert_no_blocks_in_use(llm)
    finally:
        torch.set_num_threads(threads)
