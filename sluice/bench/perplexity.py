"""Perplexity through the engine's model runner on held-out text: the prose of the standard library's
*packages* (HELD_OUT_PACKAGES), which the embedded model's corpus never reads, less any paragraph that is in
the corpus. Perplexity = exp(mean NLL) over every predicted token of windows run teacher-forced in prefill
chunks (each window's first token is context only).
"""

from __future__ import annotations

import ast
import functools
import math
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sluice.model.corpus import build_corpus, prose_paragraphs

if TYPE_CHECKING:
    from services.engine.executor.model_runner import ModelRunner

HELD_OUT_PACKAGES = (
    "asyncio collections concurrent email http importlib json logging multiprocessing unittest urllib xml"
)
MIN_PARAGRAPH_CHARS = 80  # as the corpus builder's
DEFAULT_WINDOW = 512
DEFAULT_CHUNK = 128
DEFAULT_MAX_TOKENS = 16384


def _docstrings(path: Path) -> Iterator[str]:
    """Docstrings of a module and of every class and function in it (methods included), in file order."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc:
                yield doc


@functools.cache
def held_out_texts() -> tuple[str, ...]:
    """Prose paragraphs (one line each, at least MIN_PARAGRAPH_CHARS) of the docstrings of the standard
    library's HELD_OUT_PACKAGES, in sorted file order, without duplicates and without any paragraph of the
    training corpus (see the module docstring)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    trained = set(build_corpus().texts)
    seen: set[str] = set()
    texts: list[str] = []
    for package in HELD_OUT_PACKAGES.split():
        for path in sorted((root / package).rglob("*.py")):
            if "test" in path.relative_to(root).parts[1:-1]:
                continue
            for doc in _docstrings(path):
                for para in prose_paragraphs(doc):
                    if len(para) >= MIN_PARAGRAPH_CHARS and para not in trained and para not in seen:
                        seen.add(para)
                        texts.append(para)
    return tuple(texts)


def encode_documents(tokenizer_file: Path, texts: Sequence[str], max_tokens: int) -> list[int]:
    """The texts as the trainer encodes plain documents, `<s> text </s>` one after another, cut at
    `max_tokens` ids."""
    from tokenizers import Tokenizer

    from sluice.model.tokenizer import BOS, EOS_DOC

    tok = Tokenizer.from_file(str(tokenizer_file))
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(f"{BOS}{text}{EOS_DOC}", add_special_tokens=False).ids)
        if len(ids) >= max_tokens:
            break
    return ids[:max_tokens]


def windows(ids: Sequence[int], window: int) -> list[list[int]]:
    """`ids` cut into consecutive windows of `window` tokens (the last may be shorter; one of a single
    token, which predicts nothing, is dropped)."""
    parts = [list(ids[i : i + window]) for i in range(0, len(ids), window)]
    return [p for p in parts if len(p) > 1]


@dataclass(frozen=True)
class Perplexity:
    """exp(nll / tokens): `nll` summed over `tokens` predicted tokens."""

    nll: float
    tokens: int

    @property
    def value(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else float("nan")


@torch.inference_mode()
def runner_logits(runner: ModelRunner, ids: Sequence[int], chunk: int) -> torch.Tensor:
    """Teacher-forced logits (len(ids), V), fp32 on the CPU, of one sequence through the runner's paged
    attention: prefill chunks of `chunk` tokens, each attending to the KV the previous ones wrote to the
    pool. The sequence takes the pool's first blocks in order (slot p holds position p), so it must fit in
    the pool (ValueError otherwise); the runner's `_meta` builds the attention metadata as for a step."""
    from services.engine.executor.attention import META_KWARG

    capacity = runner.num_blocks * runner.block_size
    if len(ids) > capacity:
        raise ValueError(f"a window of {len(ids)} tokens does not fit the runner's pool of {capacity} slots")
    device = runner.device
    blocks = torch.arange(-(-len(ids) // runner.block_size), device=device)
    out: list[torch.Tensor] = []
    for p0 in range(0, len(ids), chunk):
        n = min(chunk, len(ids) - p0)
        input_ids = torch.tensor(ids[p0 : p0 + n], device=device)
        positions = torch.arange(p0, p0 + n, device=device)
        held = blocks[: -(-(p0 + n) // runner.block_size)] if p0 else torch.zeros(0, dtype=torch.long)
        seq = SimpleNamespace(num_computed_tokens=p0)
        meta = runner._meta([], [(seq, n)], positions, [held])  # type: ignore[list-item]
        logits = runner.model(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            logits_to_keep=0,
            **{META_KWARG: meta},
        ).logits[0]
        out.append(logits.float().cpu())
    return torch.cat(out)


def nll_sum(logits: torch.Tensor, ids: Sequence[int]) -> float:
    """Summed NLL of ids[1:] under logits[:-1] (row t predicts token t + 1)."""
    target = torch.tensor(ids[1:], dtype=torch.long)
    return float(F.cross_entropy(logits[:-1].double(), target, reduction="sum"))


def runner_perplexity(
    runner: ModelRunner, ids: Sequence[int], window: int = DEFAULT_WINDOW, chunk: int = DEFAULT_CHUNK
) -> Perplexity:
    """Perplexity of `ids` through the runner (see the module docstring)."""
    nll, tokens = 0.0, 0
    for part in windows(ids, window):
        nll += nll_sum(runner_logits(runner, part, chunk), part)
        tokens += len(part) - 1
    return Perplexity(nll, tokens)


def make_runner(
    model_dir: Path, device: str, dtype: str, quantization: str, kv_cache_dtype: str, window: int
) -> ModelRunner:
    """A ModelRunner as the engine loads it (eager, no CUDA graphs), with a pool of one window."""
    from services.engine.executor.model_runner import ModelRunner
    from services.engine.settings import EngineSettings

    weights = dict(
        model=str(model_dir), device=device, dtype=dtype, quantization=quantization, cuda_graphs="off"
    )
    pool = dict(block_size=16, num_kv_blocks=-(-window // 16), kv_cache_dtype=kv_cache_dtype)
    return ModelRunner(EngineSettings(**weights, **pool))


@dataclass(frozen=True)
class QualityResult:
    """Perplexity of one variant (quantization, KV dtype) against the unquantized model's."""

    variant: str
    quantization: str
    kv_cache_dtype: str
    perplexity: float | None
    tokens: int
    error: str | None = None

    def ratio_to(self, base: float | None) -> float | None:
        if self.perplexity is None or not base:
            return None
        return self.perplexity / base
