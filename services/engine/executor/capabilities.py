"""Which models the engine serves: by capability, not by a list of family names.

Everything refused raises ValueError at start-up, naming what is missing. `check_config`, before any
weight is read: a causal-LM class supporting custom attention, no encoder-decoder, only full or sliding
attention layers, no multi-head latent attention, no layer sharing another's KV. `probe`, once loaded:
one two-token forward whose attention calls only record what they get (`AttentionProbe`); a keyword
neither `HONOURED` nor `INERT`, a non-causal call, K and V of different head sizes, layers of different
KV shapes or a layer that never calls attention is refused; the `AttentionSpec` it returns sizes the pool
and tells the scheduler whether every layer slides. `rope_length_limit` and `pin_long_factor`: RoPE whose
frequencies follow the forward's longest position (`dynamic`, `longrope`). Rationale and the families
refused: docs/architecture.md ("Which models").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from services.engine.executor.attention import META_KWARG, AttentionProbe

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")
# Keywords the paged attention honours (attention.py): per-layer windows, logit soft-capping, sinks.
HONOURED = frozenset({"sliding_window", "softcap", "s_aux"})
# Keywords that carry nothing for attention here: positions are already in the rotated Q and K, the
# engine runs without transformers' cache, what a forward outputs is the model's business (router
# logits of mixture-of-experts layers included), and the step metadata is the engine's own.
INERT = frozenset(
    {
        "position_ids",
        "cache_position",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "past_key_values",
        META_KWARG,
    }
)
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


@dataclass(frozen=True)
class AttentionSpec:
    """What the probe saw: the head layout (the same in every layer) and per layer its window (0 = full
    attention), soft-cap (0 = none) and whether it has sinks."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    windows: tuple[int, ...]
    softcaps: tuple[float, ...] = ()
    sinks: tuple[bool, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def all_sliding_window(self) -> int:
        """The largest window when every layer has one (KV older than it is never read again), else 0."""
        return max(self.windows) if self.windows and all(self.windows) else 0

    def features(self) -> list[str]:
        """The attention features this model uses, in words (for the start-up log)."""
        out = [f"{self.num_heads} query heads / {self.num_kv_heads} KV heads of {self.head_dim}"]
        windows = sorted({w for w in self.windows if w})
        if windows:
            full = sum(1 for w in self.windows if not w)
            out.append(f"sliding windows {windows} ({full} of {self.num_layers} layers full)")
        if any(self.softcaps):
            out.append(f"logit soft-cap {max(self.softcaps)}")
        if any(self.sinks):
            out.append("attention sinks")
        return out


def _layer_types(config: transformers.PretrainedConfig) -> list[str]:
    types = getattr(config, "layer_types", None) or []
    return [str(t) for t in types]


def check_config(config: transformers.PretrainedConfig) -> None:
    """Raises ValueError naming what the engine cannot serve in `config` (see the module docstring)."""
    model_type = config.model_type
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"model type {model_type!r} is an encoder-decoder model; "
            "the engine serves decoder-only causal LMs"
        )
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, class_name, None) if class_name else None
    if cls is None:
        raise ValueError(
            f"model type {model_type!r} has no causal-LM class in transformers (AutoModelForCausalLM); "
            "the engine serves decoder-only causal LMs"
        )
    other = sorted({t for t in _layer_types(config) if t not in ATTENTION_LAYER_TYPES})
    if other:
        raise ValueError(
            f"model type {model_type!r} has layers of type {', '.join(other)} (linear attention, mamba, "
            "recurrent, conv, chunked or indexed attention: not plain causal attention); the engine serves "
            f"layers of type {' and '.join(ATTENTION_LAYER_TYPES)} only"
        )
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"model type {model_type!r}: {class_name} does not route attention through transformers' "
            "attention interface (_supports_attention_backend is False), so the paged attention cannot run it"
        )
    if getattr(config, "kv_lora_rank", None):
        raise ValueError(
            f"model type {model_type!r} uses multi-head latent attention (DeepSeek-style MLA: kv_lora_rank "
            f"{config.kv_lora_rank}, K and V of different head sizes), which the engine does not serve"
        )
    if getattr(config, "num_kv_shared_layers", 0):
        raise ValueError(
            f"model type {model_type!r} has layers that reuse another layer's KV (num_kv_shared_layers "
            f"{config.num_kv_shared_layers}), which the engine does not serve"
        )


def rope_length_limit(config: transformers.PretrainedConfig) -> tuple[str, int] | None:
    """(kind, limit) for a RoPE kind whose frequencies depend on the forward's length (dynamic,
    longrope): beyond `limit` positions a packed batch would change another request's frequencies."""
    params: Any = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    layered = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    for p in layered:
        kind = p.get("rope_type") or p.get("type")
        if kind in LENGTH_DEPENDENT_ROPE:
            limit = p.get("original_max_position_embeddings") or config.max_position_embeddings
            return str(kind), int(limit)
    return None


def pin_long_factor(model: torch.nn.Module) -> int:
    """Makes every longrope rotary embedding of `model` use its long factor at every position, whatever
    the longest position of a forward; returns how many (rotary module, layer type) pairs it pinned.

    transformers' update (modeling_rope_utils.dynamic_rope_update) copies into `inv_freq`, each forward,
    `long_inv_freq` past `original_max_position_embeddings` and `original_inv_freq` (the short factor's)
    up to it: both are set to the long factor's frequencies here, so either branch picks them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    pinned = 0
    for module in model.modules():
        kinds = getattr(module, "rope_type", None)
        per_layer = kinds.items() if isinstance(kinds, dict) else [(None, kinds)]
        for layer_type, kind in per_layer:
            prefix = f"{layer_type}_" if layer_type is not None else ""
            short = getattr(module, f"{prefix}original_inv_freq", None)
            if kind != "longrope" or not isinstance(short, torch.Tensor):
                continue
            params = module.config.rope_parameters
            params = params[layer_type] if layer_type is not None else params
            beyond = int(params["original_max_position_embeddings"]) + 1
            kw = {"layer_type": layer_type} if layer_type is not None else {}
            long, _ = ROPE_INIT_FUNCTIONS["longrope"](module.config, short.device, seq_len=beyond, **kw)
            long = long.to(short.dtype)
            short.copy_(long)
            getattr(module, f"{prefix}inv_freq").copy_(long)
            setattr(module, f"{prefix}long_inv_freq", long)
            pinned += 1
    return pinned


@dataclass
class _Seen:
    """One layer's attention call as the probe recorded it."""

    q: tuple[int, ...]
    k: tuple[int, ...]
    v: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def probe(model: torch.nn.Module, num_layers: int, device: torch.device) -> AttentionSpec:
    """Runs one two-token forward of `model` (loaded with the paged attention) whose attention calls
    only record their arguments; returns the AttentionSpec, or raises ValueError naming what the paged
    attention would not honour."""
    seen: dict[int, _Seen] = {}

    def record(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer is None:
            raise ValueError(f"{type(module).__name__} has no layer_idx: the paged pool is indexed by it")
        seen[int(layer)] = _Seen(tuple(q.shape), tuple(k.shape), tuple(v.shape), dict(kw))

    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    pos = torch.arange(2, device=device)[None]
    with torch.inference_mode():
        model(
            input_ids=ids,
            position_ids=pos,
            use_cache=False,
            logits_to_keep=1,
            **{META_KWARG: AttentionProbe(record)},
        )
    return _spec(seen, num_layers)


def _spec(seen: dict[int, _Seen], num_layers: int) -> AttentionSpec:
    missing = sorted(set(range(num_layers)) - set(seen))
    if missing:
        raise ValueError(
            f"layers {missing} never called the attention interface (a non-attention layer, or attention "
            "computed by other means), which the engine does not serve"
        )
    shapes = set()
    windows, softcaps, sinks = [], [], []
    for layer in range(num_layers):
        s = seen[layer]
        if s.k[-1] != s.v[-1]:
            raise ValueError(
                f"layer {layer}: K head size {s.k[-1]} differs from V head size {s.v[-1]} (multi-head latent "
                "attention or similar), which the engine does not serve"
            )
        if s.q[-1] != s.k[-1] or s.q[1] % s.k[1]:
            raise ValueError(
                f"layer {layer}: {s.q[1]} query heads of {s.q[-1]} do not fit {s.k[1]} KV heads of {s.k[-1]}"
            )
        shapes.add((s.q[1], s.k[1], s.k[-1]))
        _check_kwargs(layer, s.kwargs)
        windows.append(int(s.kwargs.get("sliding_window") or 0))
        softcaps.append(float(s.kwargs.get("softcap") or 0.0))
        sinks.append(s.kwargs.get("s_aux") is not None)
    if len(shapes) > 1:
        raise ValueError(
            f"layers differ in their head layout {sorted(shapes)}, which the engine does not serve"
        )
    (h, hkv, d) = shapes.pop()
    return AttentionSpec(h, hkv, d, tuple(windows), tuple(softcaps), tuple(sinks))


def _check_kwargs(layer: int, kwargs: dict[str, Any]) -> None:
    """Refuses, by name, a keyword the model code hands attention that changes attention and that the
    paged attention does not honour."""
    unknown = sorted(k for k, v in kwargs.items() if k not in HONOURED | INERT and not _inert_value(k, v))
    if unknown:
        shown = ", ".join(f"{k}={_short(kwargs[k])}" for k in unknown)
        raise ValueError(
            f"layer {layer}: the model's attention call passes {shown}, which the paged attention does not "
            f"honour (it honours {', '.join(sorted(HONOURED))}, the scaling as given, GQA and MQA)"
        )


def _inert_value(key: str, value: Any) -> bool:
    """A keyword whose value asks for nothing beyond causal attention: is_causal True, no head mask,
    no dropout."""
    if key == "is_causal":
        return value is None or value is True
    if key in ("head_mask", "attention_dropout"):
        return value is None or value == 0
    return False


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)}>"
    return repr(value)[:40]
