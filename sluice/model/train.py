"""Brief, time-budgeted next-token training of a causal LM on the project's corpus (plain torch, CPU).

The corpus (plain documents as `<s> text </s>`, chat conversations as `<s>` + ChatML turns) is encoded
into one stream of token ids; each step draws `batch_size` random windows of `seq_len + 1` tokens from
it with a seeded generator and takes one AdamW step. The learning rate warms up over the first steps,
then follows a cosine over the *elapsed fraction of the time budget*, so a run of any length ends at a
low rate. Training stops when the budget is spent; the step count depends on the machine's speed.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer
from tqdm import tqdm
from transformers import PreTrainedModel

from sluice.model.corpus import Corpus
from sluice.model.tokenizer import BOS, EOS_DOC, render_chat

_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}s [left {remaining}{postfix}]"


@dataclass(frozen=True)
class TrainConfig:
    seconds: float
    seed: int = 0
    batch_size: int = 4
    seq_len: int = 128
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    threads: int = 2
    progress: bool = True


@dataclass(frozen=True)
class TrainReport:
    steps: int
    tokens: int
    seconds: float
    eval_loss_before: float
    eval_loss_after: float


def encode_corpus(tok: Tokenizer, corpus: Corpus) -> torch.Tensor:
    """The corpus as one 1-D LongTensor of ids: each text as `<s> text </s>`, each conversation as
    `<s>` followed by its rendered turns (special tokens are parsed from the markup)."""
    docs = [f"{BOS}{t}{EOS_DOC}" for t in corpus.texts]
    docs += [f"{BOS}{render_chat(c)}" for c in corpus.conversations]
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    return torch.tensor([i for e in encodings for i in e.ids], dtype=torch.long)


def _batch(stream: torch.Tensor, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    offsets = torch.arange(cfg.seq_len + 1)
    return stream[starts[:, None] + offsets[None, :]]  # (B, seq_len + 1)


def _loss(model: PreTrainedModel, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1], use_cache=False).logits  # (B, T, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())


def _lr_at(cfg: TrainConfig, step: int, elapsed_fraction: float) -> float:
    warm = min(1.0, (step + 1) / cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, elapsed_fraction)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def train(model: PreTrainedModel, tok: Tokenizer, corpus: Corpus, cfg: TrainConfig) -> TrainReport:
    """Train `model` in place for about `cfg.seconds` seconds; returns losses on a fixed held batch.

    The torch thread count is set to `cfg.threads` for the run and restored afterwards. The model is
    left in eval mode.
    """
    stream = encode_corpus(tok, corpus)
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_batch = _batch(stream, cfg, torch.Generator().manual_seed(cfg.seed + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        before = _eval(model, eval_batch)
        steps, seconds = _run(model, stream, cfg, gen)
        after = _eval(model, eval_batch)
    finally:
        torch.set_num_threads(threads)
    return TrainReport(steps=steps, tokens=steps * cfg.batch_size * cfg.seq_len, seconds=seconds,
                       eval_loss_before=before, eval_loss_after=after)


@torch.no_grad()
def _eval(model: PreTrainedModel, window: torch.Tensor) -> float:
    model.eval()
    return float(_loss(model, window))


def _run(model: PreTrainedModel, stream: torch.Tensor, cfg: TrainConfig,
         gen: torch.Generator) -> tuple[int, float]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    model.train()
    bar = tqdm(total=round(cfg.seconds), unit="s", desc="training", file=sys.stderr, disable=not cfg.progress,
               bar_format=_BAR_FORMAT)
    start = time.monotonic()
    step, elapsed = 0, 0.0
    while elapsed < cfg.seconds:
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step, elapsed / cfg.seconds)
        loss = _loss(model, _batch(stream, cfg, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        elapsed = time.monotonic() - start
        bar.set_postfix_str(f"step={step} loss={loss.item():.3f}", refresh=False)
        bar.update(min(round(elapsed), bar.total) - bar.n)
    bar.close()
    model.eval()
    return step, elapsed
