"""The two workloads of `sluice bench latency` (docs/benchmarks.md), and how much of each output copies its
prompt. `repetitive`: a user turn asks to repeat a document made of a held-out seed and the model's own
greedy continuation of it; `non-repetitive`: short questions sampled at NON_REPETITIVE_TEMPERATURE. A model
without tokenizer.json gets words mapped to ids by crc32.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from sluice.bench.perplexity import held_out_texts

REPETITIVE = "repetitive"
NON_REPETITIVE = "non-repetitive"
WORKLOADS = (REPETITIVE, NON_REPETITIVE)
SEED_TOKENS = 24  # tokens of a held-out paragraph the model continues into the document
COPY_NGRAM = 4  # a token counts as copied when it lies in a span of this many tokens found in the prompt
NON_REPETITIVE_TEMPERATURE = 0.9
FIRST_PLAIN_ID = 5  # ids below are special tokens in every model the benchmark makes (pad, bos, eos, ...)
BOS_ID = 1
QUESTIONS = (
    "What does {t} do?",
    "When would I use {t}?",
    "Give me an overview of {t}.",
    "What are the pitfalls of {t}?",
)


@dataclass(frozen=True)
class LatencyRequest:
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class LatencyWorkload:
    """Requests of one kind; `how` says in a sentence how they were built."""

    name: str
    requests: tuple[LatencyRequest, ...]
    how: str

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> LatencyWorkload:
        return LatencyWorkload(self.name, self.requests[:n], self.how)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r in self.requests)


Encoder = Callable[[str], list[int]]


def make_encoder(model_dir: Path, vocab_size: int) -> Encoder:
    """The model's tokenizer (no special tokens added; markup such as `<|im_start|>` is parsed as the
    special token it names), or, without tokenizer.json, each whitespace-separated word mapped to an id in
    [FIRST_PLAIN_ID, vocab_size) by crc32."""
    path = model_dir / "tokenizer.json"
    if path.is_file():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return lambda text: tok.encode(text, add_special_tokens=False).ids
    span = vocab_size - FIRST_PLAIN_ID
    return lambda text: [FIRST_PLAIN_ID + zlib.crc32(w.encode()) % span for w in text.split()]


def _user_turn(encode: Encoder, text: Sequence[int] | str) -> list[int]:
    body = encode(text) if isinstance(text, str) else list(text)
    return [BOS_ID, *encode("<|im_start|>user\n"), *body, *encode("<|im_end|>\n<|im_start|>assistant\n")]


def seed_texts(encode: Encoder, count: int, seed: int) -> list[list[int]]:
    """`count` distinct held-out paragraphs of at least SEED_TOKENS tokens, drawn with `seed`, each cut to
    its first SEED_TOKENS tokens."""
    usable = [ids[:SEED_TOKENS] for t in held_out_texts() if len(ids := encode(t)) >= SEED_TOKENS]
    if len(usable) < count:
        raise ValueError(f"only {len(usable)} held-out paragraphs are long enough, {count} wanted")
    return random.Random(seed).sample(usable, count)


Continue = Callable[[list[list[int]], int], list[list[int]]]  # prompts, n -> each one's n greedy tokens


def repetitive(
    encode: Encoder, continue_greedy: Continue, count: int, output_len: int, seed: int
) -> LatencyWorkload:
    """`count` repeat-the-document requests (see the module docstring); `continue_greedy` runs the model."""
    seeds = seed_texts(encode, count, seed)
    continuations = continue_greedy([[BOS_ID, *s] for s in seeds], output_len)
    instruction = encode("Repeat the following text exactly.\n\n")
    requests = []
    for s, c in zip(seeds, continuations, strict=True):
        prompt = [*_user_turn(encode, [*instruction, *s, *c]), *s]
        requests.append(LatencyRequest(tuple(prompt), output_len))
    how = (
        f"a user turn asks to repeat a document: {SEED_TOKENS} tokens of a held-out paragraph and the "
        f"model's own greedy continuation of them ({output_len} tokens); the answer starts with the "
        f"paragraph's {SEED_TOKENS} tokens; greedy, {output_len} tokens per request"
    )
    return LatencyWorkload(REPETITIVE, tuple(requests), how)


def _topic(encode: Encoder, text: str) -> str:
    """A few words from the start of a held-out paragraph, as the subject of a question."""
    return " ".join(text.split()[:4]).rstrip(".,:;")


def non_repetitive(encode: Encoder, count: int, output_len: int, seed: int) -> LatencyWorkload:
    """`count` short questions about held-out paragraphs' subjects, sampled (see the module docstring)."""
    rng = random.Random(seed + 1)
    texts = rng.sample(list(held_out_texts()), count)
    requests = []
    for i, text in enumerate(texts):
        question = rng.choice(QUESTIONS).format(t=_topic(encode, text))
        prompt = _user_turn(encode, question)
        requests.append(
            LatencyRequest(tuple(prompt), output_len, NON_REPETITIVE_TEMPERATURE, seed * 1000 + i)
        )
    how = (
        f"a user turn asks a short question about a held-out paragraph's first words; sampled at "
        f"temperature {NON_REPETITIVE_TEMPERATURE} with a seed per request, {output_len} tokens per request"
    )
    return LatencyWorkload(NON_REPETITIVE, tuple(requests), how)


def copy_fraction(prompt: Sequence[int], output: Sequence[int], n: int = COPY_NGRAM) -> float:
    """Share of `output`'s tokens that lie in some span of `n` output tokens also found in `prompt`."""
    if not output:
        return 0.0
    grams = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for j in range(len(output) - n + 1):
        if tuple(output[j : j + n]) in grams:
            covered[j : j + n] = [True] * n
    return sum(covered) / len(output)


def lookup_fraction(prompt: Sequence[int], output: Sequence[int], n: int = COPY_NGRAM) -> float:
    """Share of `output`'s tokens that lie in some span of `n` output tokens occurring earlier in the
    prompt followed by the output (what prompt lookup can propose)."""
    if not output:
        return 0.0
    seq = [*prompt, *output]
    first: dict[tuple[int, ...], int] = {}
    for i in range(len(seq) - n + 1):
        first.setdefault(tuple(seq[i : i + n]), i)
    covered = [False] * len(output)
    for j in range(len(output) - n + 1):
        start = len(prompt) + j
        if first[tuple(seq[start : start + n])] < start:
            covered[j : j + n] = [True] * n
    return sum(covered) / len(output)


def mean_fraction(
    fraction: Callable[[Sequence[int], Sequence[int]], float],
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[Sequence[int]],
) -> float:
    """`fraction` over every request, weighted by output length."""
    total = sum(len(o) for o in outputs)
    if not total:
        return 0.0
    return sum(fraction(p, o) * len(o) for p, o in zip(prompts, outputs, strict=True)) / total
