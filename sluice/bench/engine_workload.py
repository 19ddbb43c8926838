"""The fixed workload of the engine benchmark: a random-weight tiny Llama and random-token requests.

Everything here is a pure function of the seed, so every method of one run (and every run with the
same seed) sees the same model weights and the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
FIRST_PLAIN_ID = 3  # prompts use ids in [FIRST_PLAIN_ID, vocab_size): no pad, bos or eos


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


def bench_model_config(max_position_embeddings: int = 1024) -> LlamaConfig:
    """The benchmark's tiny Llama: hidden 256, 4 layers, 4 heads, 2 KV heads, intermediate 704, vocab 8192."""
    return LlamaConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=704,
        vocab_size=8192,
        max_position_embeddings=max_position_embeddings,
        pad_token_id=PAD_ID,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        tie_word_embeddings=False,
    )


def write_bench_model(directory: Path, seed: int) -> Path:
    """Write the tiny Llama with seeded random fp32 weights to `directory` (save_pretrained); return it."""
    with torch.random.fork_rng(devices=[]):  # the CPU generator alone; the caller's state is restored
        torch.manual_seed(seed)
        model = LlamaForCausalLM(bench_model_config()).to(torch.float32).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    return directory
