"""The scoring side of the OpenAI API on a real `sluice up` stack and the tiny model: prompt logprobs
(echo) against transformers' own forward, lm-eval's `local-completions` against its in-process `hf`
model on a multiple-choice task the test writes, n choices with seeds, logit_bias, cached tokens,
/tokenize, /detokenize and /v1/models. The tests of prompt logprobs, logit_bias and cached tokens need
the engine to honour those fields."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.e2e.conftest import Pipeline

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-4
TIMEOUT_S = 120.0
QUESTIONS = 12


def complete(pipeline: Pipeline, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{pipeline.http_url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def reference_logprobs(model_dir: Path, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i ≥ 1 from transformers' forward of the same model in fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]  # (T, V)
    logprobs = torch.log_softmax(logits[:-1].double(), dim=-1)  # (T - 1, V): row i predicts ids[i + 1]
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_echo_logprobs_equal_transformers(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompts = ["The quick brown fox jumps over the lazy dog", "Once upon a time " * 12]
    batch = [tokenizer(p).input_ids for p in prompts]
    reply = complete(
        pipeline, {"prompt": batch, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    )
    for ids, choice in zip(batch, sorted(reply["choices"], key=lambda c: c["index"]), strict=True):
        got = choice["logprobs"]["token_logprobs"]
        assert len(got) == len(ids) and got[0] is None
        want = reference_logprobs(tiny_model_dir, ids)
        assert max(abs(a - b) for a, b in zip(got[1:], want, strict=True)) <= TOLERANCE
        assert choice["text"] == tokenizer.decode(ids) and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] == sum(len(ids) for ids in batch)


def test_n_choices_are_the_seeded_single_requests(pipeline: Pipeline) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    together = complete(pipeline, {**body, "n": 3, "seed": 40})
    alone = [complete(pipeline, {**body, "seed": 40 + i}) for i in range(3)]
    texts = [c["text"] for c in sorted(together["choices"], key=lambda c: c["index"])]
    assert texts == [reply["choices"][0]["text"] for reply in alone]
    assert len(set(texts)) > 1  # sampled with different seeds
    assert together["usage"]["completion_tokens"] == sum(r["usage"]["completion_tokens"] for r in alone)
    assert together["usage"]["prompt_tokens"] == alone[0]["usage"]["prompt_tokens"]


def test_logit_bias_forces_and_bans_a_token(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = tokenizer("Once upon a time").input_ids
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    forced = tokenizer(" the").input_ids[-1]
    reply = complete(pipeline, {**body, "logit_bias": {str(forced): 100}})
    assert reply["choices"][0]["text"] == tokenizer.decode([forced] * 6)
    with torch.no_grad():  # the greedy first token, banned below
        logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(
            torch.tensor([prompt])
        ).logits
    greedy = int(logits[0, -1].argmax())
    plain = complete(pipeline, body)["choices"][0]["logprobs"]["tokens"][0]
    banned = complete(pipeline, {**body, "logit_bias": {str(greedy): -100}})["choices"][0]["logprobs"][
        "tokens"
    ]
    assert plain != banned[0]


def test_a_repeated_prompt_reports_cached_tokens(pipeline: Pipeline) -> None:
    prompt = "A prompt long enough to fill several blocks of sixteen tokens. " * 6
    first = complete(pipeline, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    second = complete(pipeline, {"prompt": prompt, "max_tokens": 1, "temperature": 0})
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert 16 <= cached < second["usage"]["prompt_tokens"]


def test_tokenize_detokenize_and_models(pipeline: Pipeline, tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "Hello there, tokenizer!"
    reply = httpx.post(f"{pipeline.http_url}/tokenize", json={"prompt": text}, timeout=TIMEOUT_S).json()
    assert reply["tokens"] == tokenizer(text).input_ids and reply["count"] == len(reply["tokens"])
    models = httpx.get(f"{pipeline.http_url}/v1/models", timeout=TIMEOUT_S).json()["data"]
    assert reply["max_model_len"] == models[0]["max_model_len"] > 0
    back = httpx.post(f"{pipeline.http_url}/detokenize", json={"tokens": reply["tokens"]}, timeout=TIMEOUT_S)
    assert back.json()["prompt"] == tokenizer.decode(reply["tokens"])
    response = httpx.get(
        f"{pipeline.http_url}/v1/models", headers={"X-Request-Id": "e2e-1"}, timeout=TIMEOUT_S
    )
    assert response.headers["x-request-id"] == "e2e-1"


# ----- lm-eval


def write_task(directory: Path) -> str:
    """A multiple-choice loglikelihood task of `QUESTIONS` questions: a YAML and its JSONL data."""
    rng = random.Random(7)
    words = ["river", "stone", "cloud", "garden", "window", "lamp", "forest", "letter", "bridge", "song"]
    rows = []
    for i in range(QUESTIONS):
        choices = rng.sample(words, 4)
        rows.append({"question": f"Question {i}: the {rng.choice(words)} is near the", "choices": choices,
                     "answer": rng.randrange(4)})  # fmt: skip
    data = directory / "questions.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    name = "sluice_scoring_mc"
    (directory / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        "doc_to_target: answer\n"
        'target_delimiter: " "\n'
        "metric_list:\n  - metric: acc\n"
    )
    return name


def run_lm_eval(model: str, model_args: dict[str, Any], task_dir: Path, task: str) -> dict[str, Any]:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(task_dir)),
        log_samples=True,
        batch_size=4,
    )


def loglikelihoods(results: dict[str, Any], task: str) -> dict[int, list[float]]:
    """Each document's loglikelihood of every choice."""
    return {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in results["samples"][task]}


def test_lm_eval_local_completions_matches_hf(
    pipeline: Pipeline, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("lm_eval")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    task = write_task(tmp_path)
    served = httpx.get(f"{pipeline.http_url}/v1/models", timeout=TIMEOUT_S).json()["data"][0]["id"]
    api_args = {
        "model": served,
        "base_url": f"{pipeline.http_url}/v1/completions",
        "tokenizer_backend": "huggingface",
        "tokenizer": str(tiny_model_dir),
        "add_bos_token": True,  # as the hf model's tokenizer does by default
        "num_concurrent": 1,
        "max_retries": 1,
    }
    api = run_lm_eval("local-completions", api_args, tmp_path, task)
    hf = run_lm_eval(
        "hf",
        {"pretrained": str(tiny_model_dir), "dtype": "float32", "device": "cpu", "add_bos_token": True},
        tmp_path,
        task,
    )
    served_ll, hf_ll = loglikelihoods(api, task), loglikelihoods(hf, task)
    assert sorted(served_ll) == sorted(hf_ll) == list(range(QUESTIONS))
    for doc_id, choices in hf_ll.items():
        assert served_ll[doc_id] == pytest.approx(choices, abs=TOLERANCE), doc_id
    assert api["results"][task]["acc,none"] == hf["results"][task]["acc,none"]
