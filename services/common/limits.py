"""Bounds of sampling parameters that both the gateway (which refuses them with 400 before they reach an
engine) and the engine (which refuses them `invalid_argument`) check: one owner, the same numbers.

- `MAX_LOGPROBS`: top alternatives per generated token (and per prompt token, `prompt_logprobs`).
- `MAX_LOGIT_BIAS_ENTRIES`: token ids one request may bias; `MAX_ABS_LOGIT_BIAS`: |bias| at most.
- `MIN_REPETITION_PENALTY`..`MAX_REPETITION_PENALTY`: the repetition penalty (1 = off); smaller or larger
  values make the logits overflow. The wire carries it as float32, so the engine compares against the
  float32 value of the minimum (`float32(MIN_REPETITION_PENALTY)`) and 0.01 sent as float32 passes.
- `MAX_ABS_PENALTY`: presence and frequency penalties lie in [-2, 2] (OpenAI's range; the gateway's check).

The JSON whitespace rule of constrained outputs is `services/common/constraints.py`'s `JSON_WHITESPACE`.
"""

from __future__ import annotations

import struct

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0


def float32(value: float) -> float:
    """`value` as the wire's float32 carries it."""
    return struct.unpack("f", struct.pack("f", value))[0]
