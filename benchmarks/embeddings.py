"""Embeddings: Quire's pooling runner beside sentence-transformers on the same model and
texts, batch 32, in one run. Prints embeddings/s for each (and the largest difference
between their embeddings, a check that both computed the same thing).

Without --model it writes a small random Qwen3 embedding checkpoint with
sentence-transformers (last-token pooling, normalized), so it runs anywhere; give a real one
(a Qwen3-Embedding folder) for figures that mean something.

    python benchmarks/embeddings.py
    python benchmarks/embeddings.py --model /models/Qwen3-Embedding-0.6B --num-texts 512
    python benchmarks/embeddings.py --plot     # and plots/embeddings.png
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from machine import StealMeter, describe_machine, machine_caption
from plotting import add_plot_flag, grouped_bars

WORDS = ("the model reads every passage and returns one vector per text so that retrieval "
         "can rank documents by their cosine similarity to a query").split()


def random_texts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=words)) for _ in range(n)]


def small_checkpoint(folder: str, hidden: int, layers: int) -> str:
    """A random Qwen3 embedding checkpoint written by sentence-transformers."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from quire.models.loader import load_tokenizer, materialize, resolve_model
    config = transformers.Qwen3Config(
        vocab_size=49152, hidden_size=hidden, intermediate_size=3 * hidden,
        num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128), head_dim=64, max_position_embeddings=4096)
    torch.manual_seed(0)
    base = transformers.AutoModel.from_config(config, dtype=torch.float32)
    tokenizer = load_tokenizer(materialize(resolve_model(None)), None)  # SmolLM2's
    tokenizer.chat_template = None  # plain texts, not chats
    base.save_pretrained(folder + "/base")
    tokenizer.save_pretrained(folder + "/base")
    transformer = Transformer(folder + "/base")
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(
        folder + "/st")
    return folder + "/st"


def run_quire(model: str, texts: list[str], batch: int, args) -> tuple[float, list]:
    from quire import LLM
    kw = {"num_threads": args.num_threads} if args.num_threads else {}
    llm = LLM(model, runner="pooling", dtype=args.dtype, device=args.device, **kw)
    llm.embed(texts[:batch], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    with StealMeter() as steal:
        vectors = [o.outputs.embedding for i in range(0, len(texts), batch)
                   for o in llm.embed(texts[i:i + batch], use_tqdm=False)]
    rate = len(texts) / (time.perf_counter() - start)
    print(f"quire:                 {rate:8.1f} embeddings/s ({steal})")
    return rate, vectors


def run_sentence_transformers(model: str, texts: list[str], batch: int, args):
    import torch
    from sentence_transformers import SentenceTransformer
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    st = SentenceTransformer(model, device="cuda" if args.device == "cuda" else "cpu",
                             model_kwargs={"dtype": dtype} if dtype else None)
    st.encode(texts[:batch], batch_size=batch)  # warm-up
    start = time.perf_counter()
    with StealMeter() as steal:
        vectors = st.encode(texts, batch_size=batch, convert_to_tensor=True).float().cpu()
    rate = len(texts) / (time.perf_counter() - start)
    print(f"sentence-transformers: {rate:8.1f} embeddings/s ({steal})")
    return rate, vectors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a sentence-transformers embedding folder "
                    "(default: a small random Qwen3 one, written first)")
    ap.add_argument("--hidden-size", type=int, default=256, help="the random model's")
    ap.add_argument("--num-layers", type=int, default=4, help="the random model's")
    ap.add_argument("--num-texts", type=int, default=256)
    ap.add_argument("--words-per-text", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16",
                                                          "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    add_plot_flag(ap, "embeddings")
    args = ap.parse_args()
    print(describe_machine(args.num_threads))
    import torch
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or small_checkpoint(tmp, args.hidden_size, args.num_layers)
        texts = random_texts(args.num_texts, args.words_per_text)
        st_rate, st_vectors = run_sentence_transformers(model, texts, args.batch_size, args)
        q_rate, q_vectors = run_quire(model, texts, args.batch_size, args)
    diff = (torch.tensor(q_vectors) - st_vectors).abs().max().item()
    print(f"{args.num_texts} texts of {args.words_per_text} words, batch {args.batch_size}: "
          f"quire / sentence-transformers = {q_rate / st_rate:.2f}x; largest embedding "
          f"difference {diff:.2e}")
    if args.plot:
        grouped_bars(args.plot, f"embeddings/s, batch {args.batch_size}", "embeddings/s",
                     ["embeddings/s"], {"quire": [q_rate], "sentence-transformers": [st_rate]},
                     caption=machine_caption(args.num_threads))


if __name__ == "__main__":
    main()
