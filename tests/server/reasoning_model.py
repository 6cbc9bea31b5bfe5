"""A tiny Qwen3-style reasoning model for the server tests: SmolLM2's tokenizer with `<think>`
and `</think>` as added (non-special) tokens, as Qwen3's, a compact chat template that honours
`enable_thinking` as Qwen3's does, and weights that make its answers a known alphabet.

The weights: every token embeds to the same vector, so every position's final hidden state is
the same h (attention over identical values returns that value, whatever the positions). The
output head maps h to the same large logit for each token of ALPHABET and 0 for the rest: a
seeded sample is a random string over ALPHABET, which holds the tags whole (`<think>`,
`</think>` as one token) and in pieces ("</", "think", ">"), and never ends early (EOS is not
in it). Qwen3ForCausalLM when the engine loads it, else Qwen2ForCausalLM (same tokenizer and
template: the reasoning format is the template's and the tokenizer's, not the layers').
"""

from __future__ import annotations

import copy
import logging

import torch

logger = logging.getLogger(__name__)

THINK_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{%- if m.role != 'system' %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")

ALPHABET = ["</think>", "<think>", "</", "think", ">", " a", " b", "\n", "<"]
LOGIT = 40.0  # the alphabet's logit; every other token's is 0


def engine_loads_qwen3() -> bool:
    try:
        from quire.models.registry import model_class
        model_class("Qwen3ForCausalLM")
        return True
    except Exception:  # noqa: BLE001 - not there yet, whatever the reason
        return False


def think_tokenizer():
    from tokenizers import AddedToken

    from server_harness import runtime_helpers
    tokenizer = copy.deepcopy(runtime_helpers().smollm2_tokenizer())
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in ("<think>", "</think>")])
    tokenizer.chat_template = THINK_TEMPLATE
    return tokenizer


def save_reasoning_model(path: str) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config
    tokenizer = think_tokenizer()
    qwen3 = engine_loads_qwen3()
    cls = Qwen3Config if qwen3 else Qwen2Config
    config = cls(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, max_position_embeddings=1024, tie_word_embeddings=False,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    alphabet = [tokenizer.encode(t, add_special_tokens=False) for t in ALPHABET]
    assert all(len(ids) == 1 for ids in alphabet), alphabet  # one token each
    alphabet = [ids[0] for ids in alphabet]
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.copy_(torch.randn(emb.shape[1]).expand_as(emb))
        hidden = model.model(input_ids=torch.tensor([[0, 1, 2, 3, 4]])).last_hidden_state[0]
        assert torch.allclose(hidden, hidden[:1].expand_as(hidden), atol=1e-5)
        h = hidden[-1]
        head = model.get_output_embeddings().weight
        head.zero_()
        head[alphabet] = h * (LOGIT / h.dot(h))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    logger.info("reasoning model (%s) saved in %s", type(config).__name__, path)
    return path
