"""Perplexity through the engine on held-out text: the prose of the standard library's *packages*
(HELD_OUT_PACKAGES), which the embedded model's corpus never reads, less any paragraph that is in the
corpus. Perplexity = exp(mean NLL) over every predicted token of windows whose prompt log-probabilities the
engine returns from its chunked prefill (each window's first token is context only).
"""

from __future__ import annotations

import ast
import functools
import math
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench import engine_driver as drv
from sluice.model.corpus import build_corpus, prose_paragraphs

HELD_OUT_PACKAGES = (
    "asyncio collections concurrent email http importlib json logging multiprocessing unittest urllib xml"
)
MIN_PARAGRAPH_CHARS = 80  # as the corpus builder's
DEFAULT_WINDOW = 512
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


def perplexity(
    model_dir: Path, ids: Sequence[int], device: str, dtype: str, window: int = DEFAULT_WINDOW, **fields: Any
) -> tuple[float, int]:
    """exp(mean NLL) of `ids` through an engine of the model (`fields`: other EngineSettings fields, such as
    quantization and kv_cache_dtype), each window one request that asks for its prompt's log-probabilities
    (prefix caching off, so every window is computed); returns it and the number of tokens predicted."""
    parts = windows(ids, window)
    lengths = [len(p) for p in parts]
    settings = drv.engine_settings(
        model_dir, device, dtype, lengths, extra=1, enable_prefix_caching=False, **fields
    )
    engine = drv.make_engine(settings)
    tracks = {f"w{i}": drv.Track() for i in range(len(parts))}
    for rid, part in zip(tracks, parts, strict=True):
        engine.add_request(rid, part, drv.SamplingParams(prompt_logprobs=0), drv.stop_after(1))
    drv.drain(engine, tracks)
    logprobs = [lp for t in tracks.values() for lp in t.prompt_logprobs]
    return (math.exp(-math.fsum(logprobs) / len(logprobs)) if logprobs else math.nan), len(logprobs)


@dataclass(frozen=True)
class QualityResult:
    """Perplexity of one variant (quantization, KV dtype) against the unquantized model's."""

    variant: str
    quantization: str
    kv_cache_dtype: str
    perplexity: float | None
    tokens: int
    error: str | None = None
