"""Small mixture-of-experts model directories for tests: Mixtral, Qwen3-MoE and GPT-OSS layouts with seeded
random weights and the project's own tokenizer, each family's special parts switched on (Qwen3-MoE's
per-head q/k norms and top-k renormalisation; GPT-OSS's attention sinks, alternating sliding-window
layers, biased router and experts, clamped SwiGLU and YaRN RoPE).

The weights are drawn so that greedy comparisons are not decided by float rounding: every matrix has std
1/sqrt(hidden) (so each layer changes the residual stream, and a wrong expert changes the output), the
router's rows 2/sqrt(hidden) (router logits of std about 2: a token's top-k experts are rarely near a
tie), the output projection LOGIT_STD/sqrt(hidden) (logits of std about LOGIT_STD), every bias and
GPT-OSS's sinks nonzero.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import GptOssConfig, MixtralConfig, PretrainedConfig, Qwen3MoeConfig

from sluice.model import tiny

MOE_ARCHS: dict[str, type[PretrainedConfig]] = {
    "mixtral": MixtralConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "gpt_oss": GptOssConfig,
}
LOGIT_STD = 4.0
ROUTER_STD = 2.0  # times 1/sqrt(hidden)
BIAS_STD = 0.1
SINK_STD = 1.0
DEFAULT_VOCAB_SIZE = 512

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "num_experts_per_tok": 2,
}
_FAMILY: dict[str, dict[str, Any]] = {
    "mixtral": {"num_local_experts": 8, "intermediate_size": 96},
    "qwen3_moe": {
        "num_experts": 8,
        "moe_intermediate_size": 48,
        "intermediate_size": 128,
        "head_dim": 16,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
    },
    # layer_types: sliding, full (GPT-OSS's alternation); rope: its YaRN default.
    "gpt_oss": {
        "num_local_experts": 8,
        "intermediate_size": 48,
        "head_dim": 16,
        "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,  # x 32 = max_position_embeddings
        },
    },
}


def moe_config(arch: str, *, vocab_size: int = DEFAULT_VOCAB_SIZE, **overrides: Any) -> PretrainedConfig:
    """The config of a small `arch` model (a key of MOE_ARCHS), `overrides` replacing any field."""
    if arch not in MOE_ARCHS:
        raise ValueError(f"unknown MoE arch {arch!r}; choose from {sorted(MOE_ARCHS)}")
    fields = {**_COMMON, **_FAMILY[arch], "vocab_size": vocab_size, **overrides}
    return MOE_ARCHS[arch](**fields, **tiny.special_ids())


def _std(name: str, param: torch.Tensor, hidden: int) -> float | None:
    """The std of parameter `name`'s normal draw, or None for a norm's scale (left at one)."""
    if param.dim() == 1 and "norm" in name:
        return None
    if name.endswith("sinks"):
        return SINK_STD
    if name.endswith("bias"):  # `.bias`, and GPT-OSS's experts' `gate_up_proj_bias`, `down_proj_bias`
        return BIAS_STD
    if name.endswith(("mlp.gate.weight", "mlp.router.weight")):
        return ROUTER_STD / math.sqrt(hidden)
    if name.endswith("lm_head.weight"):
        return LOGIT_STD / math.sqrt(hidden)
    if name.endswith("embed_tokens.weight"):
        return 1.0
    return 1.0 / math.sqrt(hidden)


def init_weights(model: torch.nn.Module, hidden: int, seed: int) -> None:
    """Draws every parameter of `model` in place from a generator seeded with `seed` (see the module
    docstring for the stds), in `named_parameters` order."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = _std(name, param, hidden)
            if std is None:
                param.fill_(1.0)
            else:
                param.copy_(torch.empty(param.shape).normal_(0.0, std, generator=gen))


def make_moe_model(out_dir: Path, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Writes a small `arch` model (moe_config with `overrides`) with seeded random weights, the project's
    tokenizer, chat template and generation config to `out_dir` (complete or not at all); returns it."""
    config = moe_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    init_weights(model, config.hidden_size, seed)
    return tiny.write_model_dir(Path(out_dir), model, {"moe": arch, "seed": seed, "overrides": overrides})
