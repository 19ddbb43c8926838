"""The benchmarks' model presets: preset shapes and the directories they write."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.engine.executor.model_runner import ModelRunner
from services.engine.settings import EngineSettings
from sluice.model import presets
from sluice.model.presets import PRESETS, count_parameters, preset_config, write_random_model


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("tiny", 7.15e6),
        ("tiny-moe", 22.3e6),
        ("qwen2-0.5b", 494e6),
        ("llama-1b", 1.24e9),
        ("llama-8b", 8.03e9),
    ],
)
def test_preset_shapes_count_the_real_models_parameters(name: str, published: float) -> None:
    assert count_parameters(preset_config(name)) == pytest.approx(published, rel=0.01)
    assert PRESETS[name].parameters == pytest.approx(published, rel=0.01)


def test_presets_tie_the_embeddings_as_the_real_models_do() -> None:
    assert preset_config("qwen2-0.5b").tie_word_embeddings
    assert preset_config("llama-1b").tie_word_embeddings
    assert not preset_config("llama-8b").tie_word_embeddings
    assert preset_config("qwen2-0.5b").max_position_embeddings == 32768


def _small(name: str) -> object:
    """The preset's architecture shrunk to run in a second: one layer, a small vocabulary, heads of 8
    (the runner runs a start-up forward, which a head size that does not divide the hidden size fails)."""
    heads = PRESETS[name].fields["num_attention_heads"]
    return preset_config(
        name, num_hidden_layers=1, vocab_size=512, hidden_size=8 * heads, intermediate_size=256
    )


@pytest.mark.parametrize("name", ["qwen2-0.5b", "llama-1b"])
def test_a_written_preset_loads_through_the_engines_runner(name: str, tmp_path: Path) -> None:
    config = _small(name)
    model_dir = write_random_model(config, tmp_path / name, "bfloat16", seed=3)
    settings = EngineSettings(  # dense weights to read back (packing: tests/engine/test_cpu_linear.py)
        model=str(model_dir), device="cpu", dtype="bfloat16", kv_cache_gb=0.01, cpu_linear="torch"
    )
    runner = ModelRunner(settings)
    assert runner.config.model_type == PRESETS[name].model_type
    assert runner.vocab_size == 512 and runner.num_layers == 1
    weights = dict(runner.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in weights.values())
    embed = weights["model.embed_tokens.weight"].float()
    assert embed.std().item() == pytest.approx(presets.LOGIT_STD / config.hidden_size**0.5, rel=0.05)
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"].float()
    assert q_proj.std().item() == pytest.approx(presets.INNER_STD, rel=0.05)
    assert runner.eos_ids == frozenset({2})


def test_the_moe_preset_loads_with_its_experts_and_a_spread_router(tmp_path: Path) -> None:
    config = preset_config("tiny-moe", num_hidden_layers=1, vocab_size=512)
    model_dir = write_random_model(config, tmp_path / "moe", "float32", seed=3)
    runner = ModelRunner(EngineSettings(model=str(model_dir), device="cpu", kv_cache_gb=0.01))
    assert runner.config.model_type == "mixtral" and runner.moe_experts == "grouped_mm"
    assert runner.expert_load is not None and runner.expert_load.num_experts == 8
    weights = dict(runner.model.named_parameters())
    router = weights["model.layers.0.mlp.gate.weight"]
    assert router.std().item() == pytest.approx(presets.ROUTER_STD / 256**0.5, rel=0.05)
    experts = weights["model.layers.0.mlp.experts.gate_up_proj"]
    assert experts.shape == (8, 2 * 704, 256)
    assert experts.std().item() == pytest.approx(presets.INNER_STD, rel=0.05)


def test_weights_are_a_function_of_the_seed(tmp_path: Path) -> None:
    config = _small("qwen2-0.5b")
    files = [
        (write_random_model(config, tmp_path / d, "float32", seed) / "model.safetensors").read_bytes()
        for d, seed in (("a", 1), ("b", 1), ("c", 2))
    ]
    assert files[0] == files[1] and files[0] != files[2]


def test_a_large_model_is_written_in_shards_with_an_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(presets, "SHARD_BYTES", 200_000)
    model_dir = write_random_model(_small("llama-1b"), tmp_path / "m", "float32", seed=0)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and all((model_dir / s).is_file() for s in shards)
    runner = ModelRunner(
        EngineSettings(model=str(model_dir), device="cpu", dtype="float32", kv_cache_gb=0.01)
    )
    assert runner.num_layers == 1


def test_a_preset_is_cached_and_not_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[Path] = []

    def small_write(config: object, directory: Path, dtype: str, seed: int) -> Path:
        writes.append(directory)
        return write_random_model(_small("qwen2-0.5b"), directory, dtype, seed)

    monkeypatch.setattr(presets, "write_random_model", small_write)
    first = presets.preset_model_dir("qwen2-0.5b", "bfloat16", 7, tmp_path, root=tmp_path / "cache")
    second = presets.preset_model_dir("qwen2-0.5b", "bfloat16", 7, tmp_path, root=tmp_path / "cache")
    assert first == second == tmp_path / "cache" / "qwen2-0.5b-bfloat16-s7"
    assert len(writes) == 1 and (first / "config.json").is_file()
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["qwen2-0.5b-bfloat16-s7"]  # no leftovers
