"""A tiny random Qwen3 embedding checkpoint written by sentence-transformers itself: the base
model (Qwen3Model), modules.json with a last-token Pooling module and Normalize, a default
'query' prompt, and matryoshka dimensions in config.json (as Qwen3-Embedding has)."""

from __future__ import annotations

import json
import os

import torch

from server_harness import runtime_helpers

QUERY_PROMPT = "Instruct: find the matching passage\nQuery: "
MATRYOSHKA_DIMENSIONS = [16, 32, 64]


def save_embedding_model(path: str) -> str:
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    helpers = runtime_helpers()
    config = helpers.tiny_config("qwen3")
    config.is_matryoshka = True
    config.matryoshka_dimensions = MATRYOSHKA_DIMENSIONS
    torch.manual_seed(0)
    base = transformers.AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # norms start at the identity; make them matter
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    tokenizer = helpers.smollm2_tokenizer()
    tokenizer.chat_template = None  # else sentence-transformers renders texts as chats
    raw = path + "-base"
    base.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    transformer = Transformer(raw)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    st = SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu",
                             prompts={"query": QUERY_PROMPT, "document": ""},
                             default_prompt_name="query")
    st.save(path)
    with open(os.path.join(path, "config_sentence_transformers.json")) as f:
        assert json.load(f)["default_prompt_name"] == "query"
    return path


def sentence_transformer(path: str):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(path, device="cpu")
