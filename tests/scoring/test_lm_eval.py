"""lm-evaluation-harness itself against a live `quire serve`: a small multiple-choice task
(written here, no hub) through `local-completions` gives the same per-request loglikelihoods
(within 1e-4, float32) and accuracy as lm-eval's `hf` backend on the same tiny model; a
generate_until task through `local-chat-completions` gives the same answers and score."""

from __future__ import annotations

import json
import random

import pytest

from scoring_server import running_server, scoring_server_args
from server_harness import tiny_model

TOL = 1e-4
SERVED = "tiny-scoring"
WORDS = ["red", "green", "blue", "cat", "dog", "river", "stone", "cloud", "apple", "seven"]


@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    for var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        mp.setenv(var, "1")
    mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
    mp.setenv("OPENAI_API_KEY", "unused")
    yield
    mp.undo()


@pytest.fixture(scope="module")
def srv():
    with running_server("lm-eval", [*scoring_server_args(), "--served-model-name",
                                     SERVED]) as s:
        yield s


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Two tasks over local JSON lines: 'quire_mc' (multiple choice, acc) and 'quire_gen'
    (generate_until, exact_match)."""
    root = tmp_path_factory.mktemp("lm-eval-tasks")
    rng = random.Random(0)
    mc = [{"question": " ".join(rng.choices(WORDS, k=rng.randint(3, 30))),
           "choices": [" ".join(rng.choices(WORDS, k=rng.randint(1, 4))) for _ in range(3)],
           "answer": rng.randrange(3)} for _ in range(8)]
    gen = [{"question": " ".join(rng.choices(WORDS, k=rng.randint(2, 8))),
            "answer": rng.choice(WORDS)} for _ in range(4)]
    (root / "mc.jsonl").write_text("".join(json.dumps(d) + "\n" for d in mc))
    (root / "gen.jsonl").write_text("".join(json.dumps(d) + "\n" for d in gen))
    (root / "quire_mc.yaml").write_text(f"""task: quire_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "mc.jsonl"}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    (root / "quire_gen.yaml").write_text(f"""task: quire_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {root / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Say one word after: {{{{question}}}}"
doc_to_target: answer
generation_kwargs:
  until: ["\\n\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""")
    return str(root)


def _evaluate(tasks_dir: str, task: str, model: str, model_args: dict, **kw) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=[task],
        task_manager=TaskManager(include_path=tasks_dir, include_defaults=False),
        log_samples=True, batch_size=1, device="cpu", random_seed=0, numpy_random_seed=0,
        torch_random_seed=0, fewshot_random_seed=0, **kw)


def _hf_args() -> dict:
    return {"pretrained": tiny_model(), "dtype": "float32"}


def _api_args(srv, path: str) -> dict:
    return {"model": SERVED, "base_url": srv.url + path, "tokenizer_backend": "huggingface",
            "tokenizer": tiny_model(), "num_concurrent": 1, "max_retries": 1,
            "tokenized_requests": path.endswith("/v1/completions")}


def _by_doc(results: dict, task: str) -> dict[int, dict]:
    return {s["doc_id"]: s for s in results["samples"][task]}


def test_multiple_choice_through_local_completions_matches_hf(srv, tasks):
    served = _evaluate(tasks, "quire_mc", "local-completions",
                       _api_args(srv, "/v1/completions"))
    hf = _evaluate(tasks, "quire_mc", "hf", _hf_args())
    mine, theirs = _by_doc(served, "quire_mc"), _by_doc(hf, "quire_mc")
    assert mine.keys() == theirs.keys() and len(mine) == 8
    for doc_id, sample in mine.items():
        ours = [ll for ll, _ in sample["filtered_resps"]]
        ref = [ll for ll, _ in theirs[doc_id]["filtered_resps"]]
        assert len(ours) == 3
        assert all(abs(a - b) < TOL for a, b in zip(ours, ref)), (doc_id, ours, ref)
        assert [g for _, g in sample["filtered_resps"]] == \
            [g for _, g in theirs[doc_id]["filtered_resps"]]
        assert sample["acc"] == theirs[doc_id]["acc"]
    assert served["results"]["quire_mc"]["acc,none"] == hf["results"]["quire_mc"]["acc,none"]


def test_generate_until_through_local_chat_completions_matches_hf(srv, tasks):
    served = _evaluate(tasks, "quire_gen", "local-chat-completions",
                       _api_args(srv, "/v1/chat/completions"), apply_chat_template=True)
    hf = _evaluate(tasks, "quire_gen", "hf", _hf_args(), apply_chat_template=True)
    mine, theirs = _by_doc(served, "quire_gen"), _by_doc(hf, "quire_gen")
    assert mine.keys() == theirs.keys() and len(mine) == 4
    assert any(sample["resps"][0][0].strip() for sample in mine.values())  # words came back
    for doc_id, sample in mine.items():
        assert sample["resps"] == theirs[doc_id]["resps"], doc_id
    assert served["results"]["quire_gen"]["exact_match,none"] == \
        hf["results"]["quire_gen"]["exact_match,none"]
