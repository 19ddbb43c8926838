"""Device kernels for the engine (Triton), each with a plain-torch reference of the same interface."""

from services.engine.executor.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_reference,
    self_check,
    triton_usable,
)

__all__ = ["paged_decode_attention", "paged_decode_attention_reference", "self_check", "triton_usable"]
