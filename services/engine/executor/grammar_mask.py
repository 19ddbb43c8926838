"""Structured outputs, executor side: a step's token bitmask from the requests' grammar states, applied
to the logits inside the sampler.

`GrammarBatch.fill` writes one bitmask row per sampled row, (rows, ceil(vocab / 32)) int32 on the host,
bit j of word w allowing token 32·w + j (core/grammar.py holds the states); `apply_bitmask_` sets the
logits of forbidden tokens to -inf in place, by the same torch code on CPU or CUDA. `GrammarBatch.mask_`
does both for the sampler and never overwrites its pinned host buffer while a non-blocking copy from it
may still be queued on the device. Eager on purpose, and `llguidance.torch` never imported (its compiled
function's cost): docs/benchmarks.md ("Grammar library").
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch

from services.engine.core.grammar import GrammarState


def bitmask_words(vocab_size: int) -> int:
    """Width of one bitmask row in int32 words: one bit per token."""
    return (vocab_size + 31) // 32


class GrammarBatch:
    """Builds a step's bitmask: one row per sampled row, in the sampler's layout (a request with d drafts
    owns d + 1 consecutive rows; row j is the distribution after its first j drafts).

    Owns a reusable host buffer (pinned when CUDA is available) and llguidance's thread pool; `fill`
    reads the states and leaves them as they were (drafts are accepted and rolled back inside)."""

    def __init__(self, vocab_size: int, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self._words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor(num_threads=threads)
        self._pin = torch.cuda.is_available()
        self._buffer = torch.empty((0, self._words), dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None  # after the latest copy from the buffer (CUDA)

    def mask_(self, logits: torch.Tensor, states: Sequence[GrammarState | None]) -> None:
        """Sets to -inf, in place, the logits (N, V) of the tokens each row's grammar forbids next;
        `states[i]`: row i's state (None: left as it is). One row per request (no drafts)."""
        bitmask, rows = self.fill(states)
        apply_bitmask_(logits, bitmask, rows)
        if logits.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def fill(
        self,
        states: Sequence[GrammarState | None],
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """The bitmask (rows, words) int32 on the host (valid until the next call) and the rows a grammar
        constrains. `states[i]` is request i's state (None: unconstrained, its rows allow every token);
        `drafts[i]` its drafted tokens (none when `drafts` is None). A draft row after a draft the grammar
        forbids is left allowing everything: the verify step never keeps its token."""
        sizes = [1 + len(drafts[i]) if drafts is not None else 1 for i in range(len(states))]
        bitmask = self._rows(sum(sizes))
        bitmask.fill_(-1)
        plain: list[tuple[llguidance.LLMatcher, int]] = []
        drafted: list[tuple[llguidance.LLMatcher, int, list[int]]] = []
        rows: list[int] = []
        start = 0
        for i, (state, size) in enumerate(zip(states, sizes, strict=True)):
            if state is not None:
                rows.extend(range(start, start + size))
                if size == 1:
                    plain.append((state.matcher, start))
                else:
                    drafted.append((state.matcher, start, list(drafts[i])))  # type: ignore[index]
            start += size
        n, row_bytes = bitmask.shape[0], self._words * 4
        assert bitmask.is_contiguous(), "the executor writes rows at data_ptr + row * row_bytes"
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), row_bytes, n)
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), row_bytes, n)
        return bitmask, rows

    def _rows(self, n: int) -> torch.Tensor:
        """The first n rows of the host buffer, once no copy from it is queued on the device."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        if self._buffer.shape[0] < n:
            self._buffer = torch.empty(
                (max(n, 2 * self._buffer.shape[0]), self._words), dtype=torch.int32, pin_memory=self._pin
            )
        return self._buffer[:n]


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets to -inf, in place, the logits of the tokens that `bitmask` forbids in the listed rows.

    logits: (R, V) float on any device; bitmask: (R, W) int32 on the host, 32·W >= V (tokens past V are
    ignored); rows: the rows to mask (others are left untouched). The same torch code runs on CPU and
    CUDA; the host → device copy is non-blocking from a pinned buffer."""
    if not rows:
        return
    n, vocab = logits.shape
    assert bitmask.shape[0] >= n and bitmask.shape[1] * 32 >= vocab, (tuple(bitmask.shape), (n, vocab))
    every_row = len(rows) == n
    masks = bitmask[:n] if every_row else bitmask[list(rows)]  # (r, W)
    masks = masks.to(logits.device, non_blocking=True)
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    blocked = (((masks.unsqueeze(-1) >> bits) & 1) == 0).view(len(rows), -1)[:, :vocab]  # (r, V) bool
    if every_row:
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(list(rows), dtype=torch.long).to(logits.device, non_blocking=True)  # (r,)
    logits[index] = logits[index].masked_fill(blocked, float("-inf"))
