"""Perplexity through the engine: the held-out text is not in the training corpus, and the prompt
log-probabilities of the engine's chunked prefill give transformers' own perplexity on the same text."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from sluice.bench import perplexity as ppl
from sluice.model.corpus import build_corpus


def test_held_out_text_is_prose_the_corpus_does_not_hold() -> None:
    texts = ppl.held_out_texts()
    assert len(texts) > 200
    assert not set(texts) & set(build_corpus().texts)
    assert len(set(texts)) == len(texts)
    assert all(len(t) >= ppl.MIN_PARAGRAPH_CHARS and "\n" not in t for t in texts)


def test_windows_cover_every_token_once() -> None:
    assert ppl.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert ppl.windows(list(range(9)), 4) == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
    ]  # a lone last token predicts nothing


def test_engine_perplexity_equals_transformers_forward(tiny_model_dir: Path) -> None:
    """Windows of 96 tokens in prefill chunks of at most 48 (so chunks attend to earlier chunks through the
    pool) against one plain transformers forward per window, fp32."""
    ids = ppl.encode_documents(tiny_model_dir / "tokenizer.json", ppl.held_out_texts(), 400)
    assert len(ids) == 400
    got, got_tokens = ppl.perplexity(
        tiny_model_dir, ids, "cpu", "float32", window=96, threads=1, max_num_batched_tokens=48
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    nll, tokens = 0.0, 0
    with torch.inference_mode():
        for part in ppl.windows(ids, 96):
            logits = model(input_ids=torch.tensor([part])).logits[0].double()
            nll += float(F.cross_entropy(logits[:-1], torch.tensor(part[1:]), reduction="sum"))
            tokens += len(part) - 1
    assert got_tokens == tokens == 400 - 5  # 4 full windows and one of 16 tokens
    expected = math.exp(nll / tokens)
    assert abs(got - expected) <= 1e-4 * expected
