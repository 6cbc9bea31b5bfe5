"""Pipeline parallelism's bad input, each one line naming the field, before any process is
spawned; the layer partition; and the micro-batch cut of a step's chunks."""

from __future__ import annotations

import pytest

from quire import LLM
from quire.config import EngineArgs
from quire.distributed.headless import check_node_role
from quire.distributed.pipeline import split_micro_batches
from quire.parallel_state import partition_layers
from quire.step_batch import PromptLogprobsAsk, SequenceChunk
from quire.validation import QuireValidationError

from tp_helpers import worker_processes


@pytest.mark.parametrize("kwargs, field, words", [
    ({"pipeline_parallel_size": 0}, "pipeline_parallel_size", "an integer >= 1"),
    ({"nnodes": 0}, "nnodes", "an integer >= 1"),
    ({"nnodes": 2, "node_rank": 2}, "node_rank", "in [0, nnodes) = [0, 2)"),
    ({"node_rank": -1}, "node_rank", "in [0, nnodes)"),
    ({"pipeline_parallel_size": 3, "nnodes": 2}, "nnodes",
     "must divide the world: tensor_parallel_size (1) x pipeline_parallel_size (3) = 3"),
    ({"master_port": 65535}, "master_port", "the next port carries the steps"),
    ({"distributed_timeout": 0}, "distributed_timeout", "seconds >= 1"),
    ({"pipeline_layer_partition": "1,2"}, "pipeline_layer_partition",
     "needs pipeline_parallel_size > 1"),
    ({"pipeline_parallel_size": 2, "enable_lora": True}, "enable_lora",
     "not supported with pipeline_parallel_size > 1"),
    ({"pipeline_parallel_size": 2, "kv_offloading_size": 1.0,
      "enable_prefix_caching": True}, "pipeline_parallel_size", "KV offloading tiers"),
])
def test_bad_parallel_arguments_name_their_field(kwargs, field, words):
    with pytest.raises(QuireValidationError) as info:
        EngineArgs(model="m", **kwargs)
    assert info.value.field == field
    assert words in str(info.value)


@pytest.mark.parametrize("kwargs, field, words", [
    ({"pipeline_parallel_size": 4}, "pipeline_parallel_size",
     "pipeline_parallel_size (4) must be at most the model's number of layers (3)"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": "1,1"},
     "pipeline_layer_partition", "summing to the model's 3 layers"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": "two,one"},
     "pipeline_layer_partition", "comma-separated layer counts"),
    ({"pipeline_parallel_size": 2, "pipeline_layer_partition": "3,0"},
     "pipeline_layer_partition", "each >= 1"),
])
def test_stages_that_do_not_fit_the_model_fail_at_start_up_before_any_spawn(
        kwargs, field, words, tp_models):
    with pytest.raises(QuireValidationError) as info:
        LLM(tp_models["llama"], dtype="float32", **kwargs)  # 3 layers
    assert info.value.field == field
    assert words in str(info.value)
    assert worker_processes(__import__("os").getpid()) == []


def test_node_roles():
    two = dict(model="m", pipeline_parallel_size=2, nnodes=2)
    check_node_role(EngineArgs(**two), headless=False)
    check_node_role(EngineArgs(**two, node_rank=1), headless=True)
    with pytest.raises(ValueError, match="--node-rank 1 is not node 0: run it with --headless"):
        check_node_role(EngineArgs(**two, node_rank=1), headless=False)
    with pytest.raises(ValueError, match="--node-rank 0 is the node that serves the API"):
        check_node_role(EngineArgs(**two), headless=True)
    with pytest.raises(ValueError, match="needs --nnodes > 1"):
        check_node_role(EngineArgs(model="m"), headless=True)


def test_layer_partition_follows_vllm():
    assert partition_layers(32, 4) == [8, 8, 8, 8]
    assert partition_layers(30, 4) == [7, 8, 8, 7]  # the remainder before the last stage
    assert partition_layers(3, 2) == [2, 1]
    assert partition_layers(6, 2, "2,4") == [2, 4]


def _chunk(n, start=0, samples=1, **kw):
    return SequenceChunk(list(range(start, start + n)), start, 1000, start + n,
                         [0, 1, 2, 3], samples, **kw)


def test_micro_batches_cut_prompts_keep_order_and_sample_only_at_the_end():
    decodes = [_chunk(1, 50 + i) for i in range(4)]
    prompt = _chunk(60, 0, samples=1)
    parts = split_micro_batches(decodes + [prompt], 2)
    assert [sum(len(c.token_ids) for c in p) for p in parts] == [32, 32]
    flat = [c for p in parts for c in p]
    assert [t for c in flat for t in c.token_ids] == [
        t for c in decodes + [prompt] for t in c.token_ids]  # every token once, in order
    head, tail = flat[4], flat[5]
    assert (head.start, len(head.token_ids), head.num_samples) == (0, 28, 0)
    assert (tail.start, len(tail.token_ids), tail.num_samples) == (28, 32, 1)
    # decodes alone: split by rows; one token: one micro-batch
    assert [len(p) for p in split_micro_batches(decodes, 2)] == [2, 2]
    assert split_micro_batches([_chunk(1)], 2) == [[_chunk(1)]]


def test_a_chunk_that_asks_for_prompt_logprobs_is_never_cut():
    ask = PromptLogprobsAsk("s", 0, list(range(40)))
    whole = _chunk(40, 0, samples=0, prompt_logprobs=ask)
    parts = split_micro_batches([whole, _chunk(10, 100)], 2)
    assert parts[0] == [whole]
