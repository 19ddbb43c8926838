"""The fixed workload of the engine benchmark: random-token requests, a pure function of the seed."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sluice.model.presets import FIRST_PLAIN_ID


@dataclass(frozen=True)
class Workload:
    """Requests that all arrive at once: `prompts[i]` asks for exactly `max_new_tokens[i]` tokens."""

    prompts: tuple[tuple[int, ...], ...]
    max_new_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        assert len(self.prompts) == len(self.max_new_tokens)

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.max_new_tokens)

    def describe(self, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int) -> dict:
        return {
            "num_requests": len(self),
            "prompt_len": list(prompt_len),
            "output_len": list(output_len),
            "seed": seed,
            "prompt_tokens": sum(len(p) for p in self.prompts),
            "output_tokens": self.total_output_tokens,
        }


def make_workload(
    num_requests: int,
    seed: int,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 256),
    output_len: tuple[int, int] = (8, 256),
) -> Workload:
    """`num_requests` requests with lengths uniform in the inclusive ranges and uniform random token ids."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be at least 1, got {num_requests}")
    for name, (lo, hi) in (("prompt_len", prompt_len), ("output_len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"{name} must satisfy 1 <= min <= max, got {lo}..{hi}")
    rng = random.Random(seed)
    prompts: list[tuple[int, ...]] = []
    outputs: list[int] = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompts.append(tuple(rng.randrange(FIRST_PLAIN_ID, vocab_size) for _ in range(length)))
        outputs.append(rng.randint(*output_len))
    return Workload(prompts=tuple(prompts), max_new_tokens=tuple(outputs))
