"""Small random-weight model directories of every dense decoder family the engine serves, each with its
family's special parts switched on, for tests: `make_family_model(DIR, "gemma2")`.

Every family is written at the `test` size of `sluice/model/tiny.py` (2 layers, hidden 64) with the
project's tokenizer and chat template, and weights drawn so that greedy choices are clear: the output
projection's std makes the logits' std about `LOGIT_STD` (as the benchmark presets do), the inner
matrices a std of `INNER_STD`. `FAMILIES` says what each one switches on; `ROPE_KINDS` are Llama models
with each RoPE scaling kind transformers ships.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import transformers

from sluice.model import tiny

LOGIT_STD = 6.0  # untied output projections
INNER_STD = 0.08
WINDOW = 8  # the sliding window of every windowed family: short, so that tests slide past it

_ALTERNATING = ["sliding_attention", "full_attention"]
# family → (config overrides, what they switch on). Head dims differ from hidden / heads where the
# family allows it; windows alternate with full layers where the family does.
FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "llama": ({}, "the baseline: RoPE, GQA, SwiGLU"),
    "qwen2": ({"sliding_window": WINDOW}, "a sliding window on every layer, QKV biases"),
    "mistral": ({"sliding_window": WINDOW}, "a sliding window on every layer"),
    "qwen3": (
        {"head_dim": 32, "num_key_value_heads": 1},
        "QK norms, head_dim 32 apart from hidden / heads, MQA",
    ),
    "gemma2": (
        {
            "head_dim": 32,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 8.0,
            "query_pre_attn_scalar": 24,
        },
        "alternating sliding/full layers, attention and final logit soft-capping, query_pre_attn_scalar",
    ),
    "gemma3_text": (
        {
            "head_dim": 32,
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 8.0,
        },
        "alternating sliding/full layers with their own RoPE bases, QK norms, query_pre_attn_scalar",
    ),
    "phi3": (
        {"sliding_window": WINDOW, "partial_rotary_factor": 0.5},
        "partial rotary (half of each head), a sliding window on every layer",
    ),
    "olmo2": ({}, "QK norms over all heads, norms after attention and MLP"),
    "granite": (
        {
            "attention_multiplier": 0.3,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.7,
            "logits_scaling": 0.5,
        },
        "attention, embedding, residual and logit multipliers",
    ),
    "smollm3": ({"no_rope_layers": [1, 0]}, "a layer without RoPE"),
    "cohere2": (
        {
            "sliding_window": WINDOW,
            "layer_types": _ALTERNATING,
            "head_dim": 32,
            "logit_scale": 0.5,
            "tie_word_embeddings": True,
        },
        "alternating sliding (RoPE) / full (no RoPE) layers, parallel attention and MLP, logit scale, "
        "tied embeddings",
    ),
    "starcoder2": ({"sliding_window": WINDOW}, "a sliding window on every layer, biases, LayerNorm"),
}

_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
# RoPE scaling kinds on Llama (transformers computes the frequencies; the engine feeds positions).
ROPE_KINDS: dict[str, dict[str, Any]] = {
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": _YARN,
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0 + i / 16 for i in range(8)],
        "long_factor": [2.0 + i / 4 for i in range(8)],
        "original_max_position_embeddings": 512,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "linear": {"rope_type": "linear", "factor": 2.0},
}


def family_config(family: str, vocab_size: int, **overrides: Any) -> transformers.PretrainedConfig:
    """The `test`-size config of `family` (a key of FAMILIES, or "llama-<rope kind>" for a key of
    ROPE_KINDS) with its special parts on, then `overrides`."""
    arch, rope = _split(family)
    fields: dict[str, Any] = {
        **tiny.common_fields(),
        **tiny.PRESETS["test"],
        "vocab_size": vocab_size,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,  # a tied random model repeats itself; cohere2 ties
        **FAMILIES[arch][0],
    }
    if rope is not None:
        fields["rope_parameters"] = {"rope_theta": 10000.0, **ROPE_KINDS[rope]}
    fields.update(overrides)
    if arch in ("qwen2",) and fields.get("sliding_window"):
        fields.update(use_sliding_window=True, max_window_layers=0)
    if arch == "smollm3":
        fields.setdefault("use_sliding_window", False)
    if arch == "starcoder2":
        fields.pop("rms_norm_eps", None)
    return transformers.AutoConfig.for_model(arch, **tiny.special_ids(), **fields)


def _split(family: str) -> tuple[str, str | None]:
    if family.startswith("llama-"):
        rope = family.removeprefix("llama-")
        if rope not in ROPE_KINDS:
            raise ValueError(f"unknown RoPE kind {rope!r}; choose from {sorted(ROPE_KINDS)}")
        return "llama", rope
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILY_NAMES)}")
    return family, None


FAMILY_NAMES = (*FAMILIES, *(f"llama-{k}" for k in ROPE_KINDS))


def spread_weights(model: torch.nn.Module, seed: int) -> None:
    """Draws every matrix again: an untied output projection with std LOGIT_STD / sqrt(hidden), so that
    logits spread and greedy near-ties are rare, the rest (a tied projection too: as an input embedding a
    larger one would drown the layers) with INNER_STD. Norm weights and biases keep their values."""
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    out = model.get_output_embeddings()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() < 2:
                continue
            is_output = out is not None and p is out.weight and not model.config.tie_word_embeddings
            std = LOGIT_STD / math.sqrt(hidden) if is_output else INNER_STD
            p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=gen))


def make_family_model(out_dir: Path, family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Writes a random-weight model directory of `family` (see FAMILY_NAMES) at `out_dir`, with the
    project's tokenizer, chat template and generation config; returns it."""
    vocab = int(overrides.pop("vocab_size", tiny.DEFAULT_VOCAB_SIZE))
    config = family_config(family, vocab, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    spread_weights(model, seed)
    recipe = dict(family=family, seed=seed, overrides=overrides)
    return tiny.write_model_dir(Path(out_dir), model, recipe)
