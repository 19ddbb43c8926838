"""Model presets: the benchmarks' tiny Llama, its mixture-of-experts sibling `tiny-moe` (Mixtral layout: 8
experts of the tiny MLP's size, 2 per token), or seeded random weights in the shapes of Qwen2-0.5B,
Llama-3.2-1B and Llama-3.1-8B, written as Hugging Face directories (all but tiny cached under
`~/.cache/sluice/bench/<preset>-<dtype>-s<seed>` or `$SLUICE_BENCH_CACHE`). The output projection's std
makes the logits' std about `LOGIT_STD`, and an MoE router's about `ROUTER_STD`, so exact near-ties (of
the next token, of a token's experts) stay rare. Special ids: pad 0, bos 1, eos 2.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from sluice.model.tiny import SIZES, written_whole

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
FIRST_PLAIN_ID = 3  # prompts use ids in [FIRST_PLAIN_ID, vocab_size): no pad, bos or eos
TINY = "tiny"
TINY_MOE = "tiny-moe"
INNER_STD = 0.02
LOGIT_STD = 4.0
ROUTER_STD = 2.0
SHARD_BYTES = 2 << 30  # safetensors shards of at most about 2 GiB each


@dataclass(frozen=True)
class Preset:
    """A model shape: the transformers model type and its config fields (special ids are the module's)."""

    name: str
    model_type: str  # "llama" | "qwen2" | "mixtral"
    fields: dict[str, Any]
    parameters: int  # the real model's parameter count, as published (for the shape tests)


SHAPE_FIELDS = (*SIZES, "vocab_size", "tie_word_embeddings", "max_position_embeddings")


def _shape(*values: Any) -> dict[str, Any]:
    """The config fields of a Llama-like shape: hidden, layers, heads, KV heads, MLP, vocab, tied,
    positions."""
    return dict(zip(SHAPE_FIELDS, values, strict=True))


def _llama3(factor: float) -> dict[str, Any]:
    """Llama 3's norm epsilon and RoPE scaling, with the scaling factor of one size."""
    rope = {"rope_theta": 500000.0, "rope_type": "llama3", "high_freq_factor": 4.0, "low_freq_factor": 1.0}
    return {
        "rms_norm_eps": 1e-5,
        "rope_scaling": {**rope, "original_max_position_embeddings": 8192, "factor": factor},
    }


_QWEN2 = {"rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
PRESETS: dict[str, Preset] = {
    TINY: Preset(TINY, "llama", _shape(256, 4, 4, 2, 704, 8192, False, 1024), 7_145_728),
    TINY_MOE: Preset(
        TINY_MOE,
        "mixtral",
        {**_shape(256, 4, 4, 2, 704, 8192, False, 1024), "num_local_experts": 8, "num_experts_per_tok": 2},
        22_292_736,
    ),
    "qwen2-0.5b": Preset(
        "qwen2-0.5b", "qwen2", {**_shape(896, 24, 14, 2, 4864, 151936, True, 32768), **_QWEN2}, 494_000_000
    ),
    "llama-1b": Preset(
        "llama-1b",
        "llama",
        {**_shape(2048, 16, 32, 8, 8192, 128256, True, 131072), **_llama3(32.0)},
        1_240_000_000,
    ),
    "llama-8b": Preset(
        "llama-8b",
        "llama",
        {**_shape(4096, 32, 32, 8, 14336, 128256, False, 131072), **_llama3(8.0)},
        8_030_000_000,
    ),
}
PRESET_NAMES = tuple(PRESETS)


def preset_config(name: str, **overrides: Any) -> transformers.PretrainedConfig:
    """The config of preset `name` (`overrides` replace fields, e.g. fewer layers for a quick test)."""
    preset = PRESETS[name]
    config_cls = transformers.CONFIG_MAPPING[preset.model_type]
    fields = {**preset.fields, **overrides}
    return config_cls(**fields, pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def meta_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """The model of `config` on the meta device: shapes only, no memory, no initialisation."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def count_parameters(config: transformers.PretrainedConfig) -> int:
    """Parameters of the model (a tied output projection counted once)."""
    return sum(p.numel() for p in meta_model(config).parameters())


def cache_root() -> Path:
    return Path(os.environ.get("SLUICE_BENCH_CACHE") or Path.home() / ".cache" / "sluice" / "bench")


def model_dir_for(name: str, dtype: str, seed: int, root: Path | None = None) -> Path:
    """Where preset `name` in `dtype` with weights of `seed` is cached."""
    return (root or cache_root()) / f"{name}-{dtype}-s{seed}"


def _init_value(name: str, shape: torch.Size, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """The seeded float32 value of one parameter: RMSNorm scales 1, biases 0, the output projection (the
    embedding when tied) normal with std LOGIT_STD / sqrt(hidden), an MoE router's ROUTER_STD / sqrt(hidden),
    every other matrix (an MoE layer's experts too) normal with std INNER_STD."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = INNER_STD
    if name.endswith(("lm_head.weight", "embed_tokens.weight")):
        std = LOGIT_STD / math.sqrt(hidden)
    elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):
        std = ROUTER_STD / math.sqrt(hidden)
    return torch.empty(shape).normal_(0.0, std, generator=gen)


def _shards(named: list[tuple[str, torch.Size]], element_size: int) -> list[list[tuple[str, torch.Size]]]:
    """Parameters grouped, in order, into shards of about SHARD_BYTES."""
    shards: list[list[tuple[str, torch.Size]]] = [[]]
    size = 0
    for name, shape in named:
        nbytes = math.prod(shape) * element_size
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def write_random_model(config: transformers.PretrainedConfig, directory: Path, dtype: str, seed: int) -> Path:
    """Writes `config` with seeded random weights in `dtype` to `directory` as safetensors shards (an
    index when more than one), config.json and generation_config.json; returns `directory`. Peak memory is
    about one shard, whatever the model's size."""
    torch_dtype = getattr(torch, dtype)
    element = torch.tensor([], dtype=torch_dtype).element_size()
    named = [(n, p.shape) for n, p in meta_model(config).named_parameters()]  # a tied projection once
    gen = torch.Generator().manual_seed(seed)
    shards = _shards(named, element)
    directory.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        filename = (
            "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {n: _init_value(n, shape, config.hidden_size, gen).to(torch_dtype) for n, shape in shard}
        save_file(tensors, str(directory / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, filename))
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(math.prod(s) for _, s in named) * element},
                 "weight_map": weight_map}  # fmt: skip
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = torch_dtype
    config.save_pretrained(directory)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


def preset_model_dir(name: str, dtype: str, seed: int, scratch: Path, root: Path | None = None) -> Path:
    """The directory of preset `name`, written once (complete or not at all): `tiny` in `scratch`, the
    real shapes in the cache (`root`, else `cache_root()`)."""
    target = model_dir_for(name, dtype, seed, scratch if name == TINY else root)
    if not (target / "config.json").exists():
        with written_whole(target) as tmp:
            write_random_model(preset_config(name), tmp, dtype, seed)
    return target
