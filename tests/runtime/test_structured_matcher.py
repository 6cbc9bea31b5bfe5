"""The grammar interface itself, on SmolLM2's tokenizer: masks, accept, fork, terminate, and
the resync after preemption (reset and replay gives the same state)."""

from __future__ import annotations

import pytest
import torch

from quire.engine.features.structured_output import GrammarState, StructuredOutput
from quire.engine.request import Request
from quire.sampling_params import SamplingParams
from quire.structured import GuidedDecodingParams
from quire.structured.backend import Backend
from quire.structured.bitmask import apply_token_bitmask

EOS = 2


@pytest.fixture(scope="module")
def backend(smollm_tokenizer):
    return Backend(smollm_tokenizer, 49152, frozenset({EOS}))


def _mask(backend, matcher) -> torch.Tensor:
    bitmask = torch.full((1, 1536), -1, dtype=torch.int32)
    backend.fill_bitmask([(matcher, 0)], bitmask)
    return apply_token_bitmask(torch.zeros(1, 49152), bitmask)[0] == 0


def _ids(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def test_mask_accept_fork_and_terminate(backend, smollm_tokenizer):
    compiled = backend.compile(GuidedDecodingParams(choice=["yes", "no"]))
    m = compiled.new_matcher()
    allowed = _mask(backend, m)
    yes, no = _ids(smollm_tokenizer, "yes"), _ids(smollm_tokenizer, "no")
    assert allowed[yes[0]] and allowed[no[0]] and not allowed[EOS]
    assert allowed.sum() < 20  # a handful of prefixes of "yes" / "no"
    fork = m.fork()
    for t in yes:
        assert m.accept(t)
    assert m.is_terminated() and not fork.is_terminated()  # the fork kept its own state
    for t in no:
        assert fork.accept(t)
    assert fork.is_terminated()
    assert not compiled.new_matcher().accept(EOS)  # EOS only where the grammar accepts


def test_resync_after_preemption_replays_kept_tokens(backend, smollm_tokenizer):
    manager = StructuredOutput(smollm_tokenizer, 49152, frozenset({EOS}))
    manager.compiler._backend = backend
    compiled = backend.compile(GuidedDecodingParams(regex=r"[a-z]{1,12}\.[0-9]{1,3}"))
    text_ids = _ids(smollm_tokenizer, "hello.42")
    req = Request("r", [1, 2, 3], SamplingParams(), frozenset({EOS}), 16)
    state = manager.states[req.request_id] = GrammarState(None, compiled.new_matcher())
    for t in text_ids[:2]:
        req.append_token(t)
        manager.advance([req])
    expected = _mask(backend, state.matcher)
    manager.preempted([req])  # in step: nothing to do
    assert torch.equal(_mask(backend, state.matcher), expected)
    state.num_accepted = 0  # out of step: reset and replay the kept tokens
    manager.preempted([req])
    assert state.num_accepted == 2
    assert torch.equal(_mask(backend, state.matcher), expected)
