"""The memory roofline of a decode step: (weight bytes + KV bytes read) ÷ memory bandwidth. A step of
batch B reads every weight the forward multiplies by (a tied embedding whole, as the output projection; an
untied input embedding only at B rows) and B × context × layers × 2 × KV heads × head_dim KV elements.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import transformers

from sluice.model.presets import meta_model

# Peak memory bandwidth in GB/s (10^9 bytes/s) by torch.cuda.get_device_name, first match wins.
HBM_GBPS: tuple[tuple[str, float], ...] = (
    (r"H200", 4800.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100", 3350.0),  # SXM (HBM3)
    (r"A100.*80\s*GB", 2039.0),
    (r"A100", 1555.0),  # 40 GB
    (r"L40S", 864.0),
    (r"\bL4\b", 300.0),
)


def hbm_gbps(device_name: str) -> float | None:
    """The bandwidth of a known GPU by its name, None for any other device."""
    for pattern, gbps in HBM_GBPS:
        if re.search(pattern, device_name):
            return gbps
    return None


def device_bandwidth(device: str, override: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from): `override` when given, else the table for a CUDA device, else
    None (a CPU has no entry)."""
    if override is not None:
        return override, "--hbm-gbps"
    if not device.startswith("cuda"):
        return None, "a CPU has no entry; give --hbm-gbps"
    name = torch.cuda.get_device_name(torch.device(device))
    gbps = hbm_gbps(name)
    return gbps, (name if gbps is not None else f"{name} not in the table; give --hbm-gbps")


def weight_bytes_per_step(config: transformers.PretrainedConfig, element_size: int) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied input embedding."""
    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight
    if not config.tie_word_embeddings:
        total -= embedding.numel()
    return total * element_size


def kv_bytes_per_token(config: transformers.PretrainedConfig, element_size: int) -> int:
    """Bytes of K and V of one token over all layers."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * element_size


@dataclass(frozen=True)
class Roofline:
    """The bytes one decode step reads and, given a bandwidth, the least time it takes."""

    weight_bytes: int
    kv_bytes: int
    gbps: float | None

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    @property
    def seconds(self) -> float | None:
        return None if not self.gbps else self.total_bytes / (self.gbps * 1e9)


def decode_roofline(
    config: transformers.PretrainedConfig, element_size: int, batch: int, context: float, gbps: float | None
) -> Roofline:
    """The roofline of a decode step of `batch` rows with `context` tokens each (mean, new token included)."""
    kv = round(batch * context * kv_bytes_per_token(config, element_size))
    return Roofline(weight_bytes_per_step(config, element_size), kv, gbps)
