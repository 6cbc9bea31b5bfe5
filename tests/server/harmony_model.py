"""A tiny gpt-oss for the harmony tests: SmolLM2's tokenizer with harmony's special tokens
added (the real o200k vocabulary can't be downloaded here), a compact chat template in
harmony's format (system and developer headers, tools as a `functions` namespace, calls and
their results in the history), and random weights; `<|return|>` and `<|call|>` end
generation, as in gpt-oss's generation config. Tests make the model speak harmony with a
grammar (`harmony_grammar`): its random weights would not."""

from __future__ import annotations

import copy
import json

import torch

SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
           "<|return|>", "<|call|>"]

HARMONY_TEMPLATE = (
    "{{- '<|start|>system<|message|>You are a helpful assistant.\\nReasoning: medium\\n\\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: "
    "\\'functions\\'.' }}{%- endif %}"
    "{{- '<|end|>' }}"
    "{%- set instructions = messages | selectattr('role', 'in', ['system', 'developer'])"
    " | list %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions[0].content }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}"
    "{{- '\\n// ' + (tool.function.description or '') + '\\ntype ' + tool.function.name"
    " + ' = (_: ' + (tool.function.parameters | tojson) + ') => any;\\n' }}"
    "{%- endfor %}{{- '\\n} // namespace functions' }}{%- endif %}"
    "{{- '<|end|>' }}{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' %}{{- '<|start|>user<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- for call in m.tool_calls %}"
    "{{- '<|start|>assistant to=functions.' + call.function.name + '<|channel|>commentary "
    "<|constrain|>json<|message|>' + (call.function.arguments if call.function.arguments "
    "is string else call.function.arguments | tojson) + '<|call|>' }}"
    "{%- endfor %}"
    "{%- elif m.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|start|>functions.' + (m.name or 'tool') + ' to=assistant<|channel|>commentary"
    "<|message|>' + m.content + '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}")


def harmony_tokenizer(base):
    from tokenizers import AddedToken
    tokenizer = copy.deepcopy(base)
    tokenizer.add_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL],
                         special_tokens=True)
    tokenizer.chat_template = HARMONY_TEMPLATE
    return tokenizer


def save_harmony_model(path: str, base_tokenizer) -> str:
    from transformers import AutoModelForCausalLM, GptOssConfig
    tokenizer = harmony_tokenizer(base_tokenizer)
    ends = tokenizer.convert_tokens_to_ids(["<|return|>", "<|call|>"])
    config = GptOssConfig(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=32, max_position_embeddings=1024,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=ends)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def harmony_grammar(*messages: tuple[str, str]) -> str:
    """A Lark grammar (llguidance: `<|name|>` is that special token) whose only sentence is
    the given messages, each (header after `<|channel|>`, body), the first one's
    `<|start|>assistant` being the prompt's; the last is ended by its end token (`<|call|>`
    after a call, else `<|return|>`), which stops generation."""
    parts = []
    for i, (header, body) in enumerate(messages):
        if i:
            parts.append('<|end|> <|start|> "assistant"')
        channel, _, rest = header.partition(" ")
        parts.append(f"<|channel|> {json.dumps(channel)}")
        if rest:
            recipient, _, constrain = rest.partition(" <|constrain|>")
            parts.append(json.dumps(" " + recipient.strip()))
            if constrain:
                parts.append(f'" " <|constrain|> {json.dumps(constrain)}')
        parts.append(f"<|message|> {json.dumps(body)}")
    last = messages[-1][0]
    parts.append("<|call|>" if "to=functions." in last else "<|return|>")
    return "start: " + " ".join(parts) + "\n"
