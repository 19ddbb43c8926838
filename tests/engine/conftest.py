"""Tiny random models for the engine tests, written as real Hugging Face directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

VOCAB = 384
# Where the engine tests run the models (scripts/gpu_check.sh sets cuda); always fp32, so that greedy
# outputs can be compared token for token with transformers' own generate on the same device.
TEST_DEVICE = os.environ.get("SLUICE_TEST_DEVICE", "cpu")


def make_model_dir(path: Path, model_type: str = "llama", **overrides: object) -> Path:
    """Writes an untrained tiny causal LM of `model_type` (llama | qwen2 | mistral) to `path`."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
    }[model_type]
    config = config_cls(**common)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Larger weights than the default init spread the logits, so near-ties are rare in greedy tests.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model_dir(tmp_path_factory.mktemp("qwen2"), "qwen2")
