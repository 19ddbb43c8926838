"""The model step under torch.compile (inductor), with the paged attention as one opaque custom op.

`sluice::paged_attention` wraps `attention.paged_attention` unchanged: its real implementation reads the
step's `StepMeta` from `current_step` (set by the runner around the call, so nothing of the step reaches
the graph or its guards), attends the step's real tokens (the first `len(meta.slot_mapping)` rows) as
the eager path does and leaves the padding rows zero; its fake implementation gives the shape.
`CompiledStep` compiles `model(input_ids, position_ids)` -> logits of every row with `dynamic=False` per
token bucket: a step of T tokens runs padded to the smallest bucket >= T (padding: id 0 at position 0,
outside the metadata); a longer step runs eagerly. `warm_up` compiles every bucket at start-up, so no
step compiles. docs/architecture.md ("A compiled step") has the buckets and what compiles.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from services.engine.executor import attention
from services.engine.executor.attention import StepMeta

log = logging.getLogger(__name__)


class _Current(threading.local):
    meta: StepMeta | None = None


_CURRENT = _Current()


@contextlib.contextmanager
def current_step(meta: StepMeta) -> Iterator[None]:
    """The step whose metadata the custom op reads while the compiled model runs."""
    previous, _CURRENT.meta = _CURRENT.meta, meta
    try:
        yield
    finally:
        _CURRENT.meta = previous


class _Layer:
    """What `paged_attention` reads of the layer module: its index."""

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx


@torch.library.custom_op("sluice::paged_attention", mutates_args=())
def paged_attention_op(
    query: torch.Tensor,  # (1, H, T, D)
    key: torch.Tensor,  # (1, Hkv, T, D)
    value: torch.Tensor,
    layer_idx: int,
    scaling: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """(1, T, H, D): `attention.paged_attention` of the current step's real rows (K/V written to the
    pool as there), zeros for the padding rows after them."""
    meta = _CURRENT.meta
    if meta is None:
        raise RuntimeError("sluice::paged_attention runs only inside current_step(meta)")
    _, h, t, d = query.shape
    n = meta.slot_mapping.shape[0]
    if n == 0:
        return query.new_zeros((1, t, h, d))
    kwargs: dict[str, object] = {attention.META_KWARG: meta, "sliding_window": sliding_window}
    if softcap:
        kwargs["softcap"] = softcap
    if sinks is not None:
        kwargs["s_aux"] = sinks
    rows = slice(0, n)
    real, _ = attention.paged_attention(
        _Layer(layer_idx),  # type: ignore[arg-type]
        query[:, :, rows],
        key[:, :, rows],
        value[:, :, rows],
        None,
        scaling,
        **kwargs,
    )
    if n == t:  # no padding: the eager result itself (a new tensor, aliasing no input)
        return real
    out = query.new_zeros((1, t, h, d))
    out[:, :n] = real
    return out


@paged_attention_op.register_fake
def _(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layer_idx: int,
    scaling: float,
    sliding_window: int,
    softcap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    _, h, t, d = query.shape
    return query.new_empty((1, t, h, d))


class OpaqueStep:
    """The value of the step keyword inside a compiled model: attention calls the custom op."""


OPAQUE_STEP = OpaqueStep()


def attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The attention implementation registered as "sluice_paged": inside the compiled step (the step
    keyword is OPAQUE_STEP) the custom op, with the keywords `paged_attention` honours; otherwise
    `attention.paged_attention` itself."""
    if not isinstance(kwargs.get(attention.META_KWARG), OpaqueStep):
        return attention.paged_attention(
            module, query, key, value, attention_mask, scaling, dropout, **kwargs
        )
    sinks = kwargs.get("s_aux")
    out = paged_attention_op(
        query,
        key,
        value,
        int(module.layer_idx),  # type: ignore[arg-type]
        float(scaling if scaling is not None else query.shape[-1] ** -0.5),
        int(kwargs.get("sliding_window") or 0),  # type: ignore[call-overload]
        float(kwargs.get("softcap") or 0.0),  # type: ignore[arg-type]
        sinks if isinstance(sinks, torch.Tensor) else None,
    )
    return out, None


def buckets(max_rows: int, max_tokens: int) -> list[int]:
    """Token counts compiled: 1, 2, 4, ... (powers of 2) below `max_rows` (decode batches), `max_rows`,
    then x4 per bucket up to `max_tokens` (prefill chunks), `max_tokens` the last."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    sizes = [1 << i for i in range((max_rows - 1).bit_length())] + [max_rows]
    while sizes[-1] < max_tokens:
        sizes.append(min(max_tokens, sizes[-1] * 4))
    return sizes


def bucket_for(sizes: Sequence[int], tokens: int) -> int | None:
    """The smallest of `sizes` (ascending) holding `tokens`, None when none does."""
    return next((s for s in sizes if s >= tokens), None)


_BUCKETS_IN_PROCESS = 0  # buckets of every CompiledStep made in this process

Logits = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | int], torch.Tensor]


class CompiledStep:
    """`model` compiled for the token counts `sizes`; `run` pads a step to its bucket. A bucket of T
    tokens computes the logits of min(T, max_rows) rows (all of a decode batch; a prefill step's sampled
    and prompt-logprob rows, padded)."""

    def __init__(
        self, model: torch.nn.Module, sizes: Sequence[int], max_rows: int, device: torch.device
    ) -> None:
        self.sizes = list(sizes)
        self.max_rows = max_rows
        self.device = device
        # One graph per bucket, and every CompiledStep of the process shares `logits`'s code object (and
        # so dynamo's cache of it): the recompile limit (8 by default) must hold all their buckets.
        global _BUCKETS_IN_PROCESS
        _BUCKETS_IN_PROCESS += len(self.sizes)
        limit = max(torch._dynamo.config.recompile_limit, _BUCKETS_IN_PROCESS + 2)
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.config.accumulated_recompile_limit = max(
            torch._dynamo.config.accumulated_recompile_limit, 4 * limit
        )

        def logits(
            input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | int
        ) -> torch.Tensor:
            out = model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{attention.META_KWARG: OPAQUE_STEP},
            )
            return out.logits[0]

        self._compiled: Logits = torch.compile(logits, dynamic=False, fullgraph=True)
        # Inputs of each bucket, filled in place every step: the graphs see the same kind of tensor
        # (never an inference tensor, ids never the positions) whatever the caller passes.
        self._inputs = {
            size: (
                torch.zeros((1, size), dtype=torch.long, device=device),
                torch.zeros((1, size), dtype=torch.long, device=device),
                torch.zeros(self._rows(size), dtype=torch.long, device=device),
            )
            for size in self.sizes
        }

    def fits(self, tokens: int, rows: int) -> bool:
        """Whether a step of `tokens` tokens keeping `rows` logits rows has a bucket."""
        size = bucket_for(self.sizes, tokens)
        return size is not None and rows <= self._rows(size)

    def _rows(self, size: int) -> int:
        return min(size, self.max_rows)

    def _fill(
        self, size: int, input_ids: torch.Tensor, position_ids: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | int]:
        """The bucket's inputs holding the step's (padding rows: id 0 at position 0) and the rows it
        computes: `keep` padded with row 0, or 0 (every row, transformers' `logits_to_keep`) when the
        bucket computes every row."""
        ids, pos, rows = self._inputs[size]
        t = input_ids.shape[1]
        ids[:, :t].copy_(input_ids)
        ids[:, t:].zero_()
        pos[:, :t].copy_(position_ids)
        pos[:, t:].zero_()
        if rows.shape[0] == size:
            return ids, pos, 0
        k = 0 if keep is None else keep.shape[0]
        if k > rows.shape[0]:
            raise ValueError(f"a step of {size} tokens keeps at most {rows.shape[0]} rows, not {k}")
        if keep is not None:
            rows[:k].copy_(keep)
        rows[k:].zero_()
        return ids, pos, rows

    def run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: StepMeta,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits (K, V) of the step's rows `keep` (K indices; None = every row) of its T tokens
        (input_ids and position_ids (1, T)), computed padded to the smallest bucket >= T; ValueError
        when T exceeds the largest."""
        t = input_ids.shape[1]
        size = bucket_for(self.sizes, t)
        if size is None:
            raise ValueError(f"{t} tokens exceed the largest compiled step {self.sizes[-1]}")
        if keep is None and self._rows(size) < size:
            raise ValueError(f"a step of {size} tokens computes {self._rows(size)} rows: say which to keep")
        ids, pos, rows = self._fill(size, input_ids, position_ids, keep)
        with current_step(meta):
            logits = self._compiled(ids, pos, rows)
        if isinstance(rows, int):  # every row computed
            return logits[:t] if keep is None else logits.index_select(0, keep)
        assert keep is not None
        return logits[: keep.shape[0]]

    def warm_up(self, empty_meta: StepMeta) -> float:
        """Compiles every bucket (a step of padding rows only, `empty_meta` holding no token), logging each
        one's time; returns the seconds taken in all."""
        start = time.perf_counter()
        for i, size in enumerate(self.sizes, 1):
            t0 = time.perf_counter()
            none = torch.zeros((1, 0), dtype=torch.long, device=self.device)
            with current_step(empty_meta):
                self._compiled(*self._fill(size, none, none, None))
            log.info(
                "compile: step of %d tokens (%d/%d) in %.1f s",
                size,
                i,
                len(self.sizes),
                time.perf_counter() - t0,
            )
        total = time.perf_counter() - start
        log.info("compile: %d step sizes %s compiled in %.1f s", len(self.sizes), self.sizes, total)
        return total
