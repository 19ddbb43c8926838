"""Small, real Hugging Face causal-LM directories (`test`: untrained, seeded; `chat`: trained briefly on
the project's corpus), built in a temporary sibling folder and renamed into place. `default_model_dir()`
returns the trained chat model from the cache (`$SLUICE_CACHE_DIR`, else `~/.cache/sluice`).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from sluice.model.corpus import build_corpus
from sluice.model.tokenizer import (
    BOS_ID,
    DEFAULT_VOCAB_SIZE,
    GENERATION_EOS_IDS,
    PAD_ID,
    save_tokenizer,
    train_tokenizer,
)
from sluice.model.train import TrainConfig, TrainReport, train

# Part of a trained model's cache key: a change to what the directory holds (weights, tokenizer, chat
# template) bumps it. 4: the chat template renders tools and tool-call history.
RECIPE_VERSION = 4
DEFAULT_TRAIN_SECONDS = 150.0
MARKER = "sluice-model.json"

SIZES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)
PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(zip(SIZES, (64, 2, 4, 2, 128), strict=True)),
    "chat": {**dict(zip(SIZES, (256, 4, 4, 2, 704), strict=True)), "vocab_size": 4096},
}
_COMMON: dict[str, Any] = {
    "vocab_size": DEFAULT_VOCAB_SIZE,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
}
ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel]]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
}


def model_config(preset: str = "test", arch: str = "llama", **overrides: Any) -> PretrainedConfig:
    """The transformers config for `preset` and `arch`, with `overrides` applied (any config field;
    `sliding_window=N` turns on sliding-window attention for qwen2 and mistral)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {sorted(ARCHS)}")
    kwargs = {**_COMMON, **PRESETS[preset], **overrides}
    sliding_window = kwargs.pop("sliding_window", None)
    if sliding_window is not None and arch == "llama":
        raise ValueError("sliding_window needs arch qwen2 or mistral")
    if arch == "qwen2":
        kwargs.update(
            use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=0
        )
    elif arch == "mistral":
        kwargs.update(sliding_window=sliding_window)
    config_cls, _ = ARCHS[arch]
    return config_cls(**special_ids(), **kwargs)


def special_ids() -> dict[str, Any]:
    """The special token ids of every model the project makes (its tokenizer's)."""
    return {"bos_token_id": BOS_ID, "eos_token_id": list(GENERATION_EOS_IDS), "pad_token_id": PAD_ID}


def common_fields() -> dict[str, Any]:
    """The config fields every model the project makes shares (vocabulary, positions, tying, norms)."""
    return dict(_COMMON)


def make_tiny_model(
    out_dir: Path,
    *,
    preset: str = "test",
    arch: str = "llama",
    train_seconds: float = 0.0,
    seed: int = 0,
    progress: bool = True,
    **overrides: Any,
) -> Path:
    """Write a model directory at `out_dir` and return it.

    Weights are seeded random (`train_seconds == 0`) or trained for about `train_seconds` seconds on two
    CPU threads. `out_dir` may be missing, empty, or a previous model directory (which is replaced);
    anything else raises FileExistsError. The directory appears complete or not at all.
    """
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    config = model_config(preset, arch, **overrides)
    tok = train_tokenizer(config.vocab_size)
    if tok.get_vocab_size() != config.vocab_size:
        raise ValueError(f"tokenizer has {tok.get_vocab_size()} tokens, config wants {config.vocab_size}")
    _, model_cls = ARCHS[arch]
    with torch.random.fork_rng(devices=[]):  # seeded weights without touching the caller's generator
        torch.manual_seed(seed)
        model = model_cls(config).float().eval()
    report = None
    if train_seconds > 0:
        training = TrainConfig(seconds=train_seconds, seed=seed, progress=progress)
        report = train(model, tok, build_corpus(), training)
    recipe = dict(preset=preset, arch=arch, seed=seed, train_seconds=train_seconds, overrides=overrides)
    return write_model_dir(out_dir, model, recipe, report, tok)


def write_model_dir(
    out_dir: Path,
    model: PreTrainedModel,
    recipe: dict[str, Any],
    report: TrainReport | None = None,
    tok: Any = None,
) -> Path:
    """Writes `model` with the project's tokenizer (`tok`, else one trained for its vocabulary), chat
    template, generation config and the recipe marker to `out_dir` (missing, empty or a previous model
    directory), complete or not at all; returns `out_dir`."""
    _check_replaceable(out_dir)
    config = model.config
    if tok is None:
        tok = train_tokenizer(config.vocab_size)
    with written_whole(out_dir) as tmp:
        model.save_pretrained(tmp)
        GenerationConfig(**special_ids()).save_pretrained(tmp)
        save_tokenizer(tok, tmp, model_max_length=config.max_position_embeddings)
        _write_marker(tmp, recipe, report)
    return out_dir


@contextlib.contextmanager
def written_whole(out_dir: Path) -> Iterator[Path]:
    """Yields a temporary directory beside `out_dir`; once the block has filled it, it replaces
    `out_dir` (readable by all; a previous `out_dir` is moved aside first and deleted after), and on any
    failure it is removed: `out_dir` is complete or untouched."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # `mkdtemp` and some writers create owner-only files
        for f in tmp.iterdir():
            f.chmod(0o644)
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{time.monotonic_ns()}")
        if out_dir.exists():
            out_dir.rename(old)
        tmp.rename(out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _check_replaceable(out_dir: Path) -> None:
    if out_dir.exists() and not (
        out_dir.is_dir() and (not any(out_dir.iterdir()) or (out_dir / "config.json").exists())
    ):
        raise FileExistsError(f"{out_dir} exists and is neither empty nor a model directory")


def _write_marker(path: Path, recipe: dict[str, Any], report: TrainReport | None) -> None:
    """Writes how the model was made (the recipe's arguments, training report, versions) beside it."""
    info = {
        "recipe_version": RECIPE_VERSION,
        **recipe,
        "train_report": asdict(report) if report else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    (path / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def cache_root() -> Path:
    """`$SLUICE_CACHE_DIR`, else `~/.cache/sluice`."""
    env = os.environ.get("SLUICE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "sluice"


def default_model_dir(
    *, preset: str = "chat", arch: str = "llama", train_seconds: float = DEFAULT_TRAIN_SECONDS, seed: int = 0
) -> Path:
    """The cached trained model directory, built on first use (with a progress bar) and reused after.

    The folder name carries the recipe version and the parameters, so a change of either builds a new
    model. Concurrent callers (several processes) wait on a file lock; only one builds.
    """
    root = cache_root()
    path = root / f"tiny-{preset}-{arch}-t{train_seconds:g}-s{seed}-r{RECIPE_VERSION}"
    if (path / MARKER).exists():
        return path
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{path.name}.lock"):
        if not (path / MARKER).exists():
            about = f"once, about {train_seconds:g} s"
            print(f"sluice: building the embedded model in {path} ({about})", file=sys.stderr)
            make_tiny_model(path, preset=preset, arch=arch, train_seconds=train_seconds, seed=seed)
    return path


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def copy_model_dir(src: Path, out_dir: Path) -> Path:
    """Copies the model directory `src` to `out_dir` (missing, empty, or a previous model directory,
    which is replaced; anything else raises FileExistsError). It appears complete or not at all."""
    out_dir = Path(out_dir)
    _check_replaceable(out_dir)
    with written_whole(out_dir) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
    return out_dir


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="sluice model tiny",
        description="Write a small Hugging Face model directory made by the project: by default the "
        "embedded chat model that `sluice up` serves (trained once, about "
        f"{DEFAULT_TRAIN_SECONDS:g} s, then copied from the cache); with --preset, a model built to order.",
    )
    about = "output directory (may be left out with --trained: prints the cached model's path)"
    p.add_argument("dir", nargs="?", type=Path, help=about)
    about = "build this preset instead of the embedded model (test: small, for tests; untrained unless"
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help=f"{about} --train-seconds)")
    p.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    about = f"training budget in seconds (embedded model: {DEFAULT_TRAIN_SECONDS:g}; --preset: 0, untrained)"
    p.add_argument("--train-seconds", type=float, default=0.0, help=about)
    about = "the embedded model (the default; DIR may then be left out)"
    p.add_argument("--trained", action="store_true", help=about)
    p.add_argument("--seed", type=int, default=0)
    about = "sliding-window size (qwen2, mistral; with --preset)"
    p.add_argument("--sliding-window", type=int, default=None, help=about)
    return p


def main(argv: list[str]) -> int:
    """`sluice model tiny [DIR] [--preset test|chat] [--arch ...] [--train-seconds S] [--trained]`:
    the embedded model (the cached copy `sluice up` serves) unless --preset asks for another."""
    p = _parser()
    args = p.parse_args(argv)
    if args.preset is not None and args.trained:
        p.error("--trained is the embedded model; leave out --preset")
    if args.preset is None and args.sliding_window is not None:
        p.error("--sliding-window needs --preset (the embedded model has none)")
    if args.dir is None and not args.trained:
        p.error("DIR is required unless --trained (which then uses the cache)")
    try:
        if args.preset is None:
            seconds = args.train_seconds or DEFAULT_TRAIN_SECONDS
            cached = default_model_dir(arch=args.arch, train_seconds=seconds, seed=args.seed)
            out = cached if args.dir is None else copy_model_dir(cached, args.dir)
        else:
            overrides = {} if args.sliding_window is None else {"sliding_window": args.sliding_window}
            recipe = {"preset": args.preset, "arch": args.arch, "seed": args.seed, **overrides}
            out = make_tiny_model(args.dir, train_seconds=args.train_seconds, **recipe)
    except (ValueError, FileExistsError) as e:
        print(f"sluice model tiny: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
