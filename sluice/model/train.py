"""Brief, time-budgeted next-token training of a causal LM on the project's corpus (plain torch, CPU).

The corpus (plain documents as `<s> text </s>`, chat conversations as `<s>` + ChatML turns) is encoded
into one stream of token ids. Each step draws `batch_size` windows of `seq_len + 1` tokens with a seeded
generator, each starting at the beginning of a document (a conversation with probability
`chat_fraction`, else a plain text; a window may run on into the next document), and takes one AdamW
step. Windows start where a chat prompt starts, so the few steps a short budget allows go to what a
chat page shows: the markup, a short answer and the end of the turn. The learning rate warms up over
the first steps, then follows a cosine over the *elapsed fraction of the time budget*, so a run of any
length ends at a low rate. Training stops when the budget is spent; the step count depends on the
machine's speed.
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
    chat_fraction: float = 0.5
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
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


@dataclass(frozen=True)
class EncodedCorpus:
    """`stream`: every document's ids, concatenated (1-D); `text_starts` / `chat_starts`: where each
    plain text / conversation begins in `stream` (1-D, non-empty)."""

    stream: torch.Tensor
    text_starts: torch.Tensor
    chat_starts: torch.Tensor


def encode_corpus(tok: Tokenizer, corpus: Corpus) -> EncodedCorpus:
    """Each text as `<s> text </s>`, each conversation as `<s>` followed by its rendered turns (special
    tokens are parsed from the markup), in corpus order: texts, then conversations."""
    docs = [f"{BOS}{t}{EOS_DOC}" for t in corpus.texts]
    docs += [f"{BOS}{render_chat(c)}" for c in corpus.conversations]
    encodings = tok.encode_batch(docs, add_special_tokens=False)
    lengths = torch.tensor([len(e.ids) for e in encodings])
    starts = torch.cumsum(lengths, 0) - lengths
    stream = torch.tensor([i for e in encodings for i in e.ids], dtype=torch.long)
    n = len(corpus.texts)
    return EncodedCorpus(stream=stream, text_starts=starts[:n], chat_starts=starts[n:])


def _batch(data: EncodedCorpus, cfg: TrainConfig, gen: torch.Generator) -> torch.Tensor:
    is_chat = torch.rand(cfg.batch_size, generator=gen) < cfg.chat_fraction
    pick_text = data.text_starts[torch.randint(0, data.text_starts.numel(), (cfg.batch_size,), generator=gen)]
    pick_chat = data.chat_starts[torch.randint(0, data.chat_starts.numel(), (cfg.batch_size,), generator=gen)]
    starts = torch.where(is_chat, pick_chat, pick_text)
    positions = starts[:, None] + torch.arange(cfg.seq_len + 1)[None, :]
    return data.stream[positions % data.stream.numel()]  # (B, seq_len + 1); the last document wraps


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
    data = encode_corpus(tok, corpus)
    gen = torch.Generator().manual_seed(cfg.seed)
    eval_batch = _batch(data, cfg, torch.Generator().manual_seed(cfg.seed + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        before = _eval(model, eval_batch)
        steps, seconds = _run(model, data, cfg, gen)
        after = _eval(model, eval_batch)
    finally:
        torch.set_num_threads(threads)
    return TrainReport(
        steps=steps,
        tokens=steps * cfg.batch_size * cfg.seq_len,
        seconds=seconds,
        eval_loss_before=before,
        eval_loss_after=after,
    )


@torch.no_grad()
def _eval(model: PreTrainedModel, window: torch.Tensor) -> float:
    model.eval()
    return float(_loss(model, window))


def _run(
    model: PreTrainedModel, data: EncodedCorpus, cfg: TrainConfig, gen: torch.Generator
) -> tuple[int, float]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), fused=True)  # fused: 4x faster step on CPU
    model.train()
    bar = tqdm(
        total=round(cfg.seconds),
        unit="s",
        desc="training",
        file=sys.stderr,
        disable=not cfg.progress,
        bar_format=_BAR_FORMAT,
    )
    start = time.monotonic()
    step, elapsed = 0, 0.0
    while elapsed < cfg.seconds:
        for group in opt.param_groups:
            group["lr"] = _lr_at(cfg, step, elapsed / cfg.seconds)
        loss = _loss(model, _batch(data, cfg, gen))
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
