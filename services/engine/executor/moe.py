"""Mixture-of-experts layers of the served model: the experts kernel they run, and what each step routes.

transformers holds an MoE layer's experts as one module of 3-D weight tensors, called with the hidden
states (T, hidden), the top-k expert indices (T, k) and their weights (T, k) through its experts interface.
`choose_experts_implementation` sets that interface once, at start-up, as `moe_experts` says: "grouped_mm"
(one grouped matmul per projection, no host sync: the one a CUDA graph captures), "eager" (a loop over the
experts hit, reading the routing on the host) or "batched_mm"; auto = grouped_mm where it runs, else eager.
`ExpertLoad` counts the tokens routed to each expert of each layer per step with forward pre-hooks, on the
device (no host sync; captured into graphs): `begin` zeroes the counter and weights the padding rows 0,
`end` moves the step's counts to the host (CUDA: non-blocking, behind an event), `take` returns finished
steps' counts. Kernel measurements: docs/architecture.md ("Mixture of experts"), docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import logging
import re
from collections.abc import Callable

import numpy as np
import torch

from services.engine.settings import MOE_EXPERTS

log = logging.getLogger(__name__)

MAX_UNREAD_STEPS = 1024  # steps' counts kept when nobody takes them (an engine without metrics)
_HOST_RING = 8  # pinned host buffers on CUDA: steps whose counts may be in flight at once
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def experts_modules(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """(decoder layer index, module) of every experts module that dispatches through transformers' experts
    interface (it carries `num_experts` and the interface's `has_gate`), in layer order."""
    found: list[tuple[int, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if hasattr(module, "has_gate") and hasattr(module, "num_experts"):
            match = _LAYER.search(name)
            found.append((int(match.group(1)) if match else len(found), module))
    return found


def choose_experts_implementation(model: torch.nn.Module, setting: str) -> str:
    """Sets the experts implementation of `model` as `setting` asks (see the module docstring) and returns
    it; a model without experts modules gets none ("")."""
    if setting not in MOE_EXPERTS:
        raise ValueError(f"moe_experts must be one of {', '.join(MOE_EXPERTS)}, got {setting!r}")
    if not experts_modules(model):
        return ""
    chosen = setting
    if setting == "auto":
        try:
            model._grouped_mm_can_dispatch()  # type: ignore[operator]
            chosen = "grouped_mm"
        except (ValueError, ImportError) as exc:
            log.info("moe experts: grouped_mm cannot run here (%s), eager instead", exc)
            chosen = "eager"
    model.set_experts_implementation(chosen)  # type: ignore[operator]
    return chosen


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer, per step (see the module docstring).

    `layers`: the decoder layer index of each row of the counts; `num_experts`: their columns. Call
    `begin(real, total)` before each forward of `total` rows whose first `real` are real, `end()` after it;
    `take()` from the same thread. `reset()` drops whatever was counted (warm-up and capture forwards).
    `max_rows`: the largest forward whose rows may be padding (a padded decode batch); larger forwards are
    all real rows."""

    def __init__(
        self, modules: list[tuple[int, torch.nn.Module]], device: torch.device, max_rows: int
    ) -> None:
        self.layers = [layer for layer, _ in modules]
        self.num_experts = int(modules[0][1].num_experts)
        self.device = device
        self.counts = torch.zeros((len(modules), self.num_experts), dtype=torch.float32, device=device)
        self._mask = torch.ones(max(1, max_rows), dtype=torch.float32, device=device)  # fixed: graphs read it
        self._masked = 0  # rows [_masked_from, _masked) of the mask are 0
        self._masked_from = 0
        self._finished: collections.deque[np.ndarray] = collections.deque(maxlen=MAX_UNREAD_STEPS)
        self._in_flight: collections.deque[tuple[torch.cuda.Event, torch.Tensor]] = collections.deque()
        self._ring: list[torch.Tensor] = []
        self._next = 0
        if device.type == "cuda":
            self._ring = [torch.empty_like(self.counts, device="cpu").pin_memory() for _ in range(_HOST_RING)]
        self._hooks = [
            module.register_forward_pre_hook(self._hook(i), with_kwargs=True)
            for i, (_, module) in enumerate(modules)
        ]

    def _hook(self, row: int) -> Callable[[torch.nn.Module, tuple, dict], None]:
        counts = self.counts

        def count(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
            if not isinstance(index, torch.Tensor):
                return
            t, k = index.shape[0], index.shape[-1]
            mask = self._mask
            weight = mask[:t] if t <= mask.numel() else torch.ones(t, device=index.device)
            counts[row].index_add_(0, index.reshape(-1), weight.repeat_interleave(k))

        return count

    def begin(self, real: int, total: int) -> None:
        """The next forward has `total` rows, the first `real` of them real (the rest count 0); its counts
        start at zero (whatever a forward that failed before `end` left)."""
        self.counts.zero_()
        if (self._masked_from, self._masked) == (real, total) or total > self._mask.numel():
            return
        self._mask[self._masked_from : self._masked].fill_(1.0)
        self._mask[real:total].fill_(0.0)
        self._masked_from, self._masked = real, total

    def end(self) -> None:
        """The step's counts leave for the host."""
        if self.device.type != "cuda":
            self._finished.append(self.counts.numpy().astype(np.int64))
            return
        if len(self._in_flight) == len(self._ring):  # nobody reads: settle the oldest
            event, host = self._in_flight.popleft()
            event.synchronize()
            self._finished.append(host.numpy().astype(np.int64))
        host = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        host.copy_(self.counts, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((event, host))

    def take(self) -> list[np.ndarray]:
        """The counts (layers, experts) of each step finished since the last call, oldest first (on CUDA,
        steps still on the device come with a later call)."""
        while self._in_flight and self._in_flight[0][0].query():
            _, host = self._in_flight.popleft()
            self._finished.append(host.numpy().astype(np.int64))
        out = list(self._finished)
        self._finished.clear()
        return out

    def reset(self) -> None:
        """Drops every count so far (on CUDA, after the forwards before it finish)."""
        for event, _ in self._in_flight:
            event.synchronize()
        self._in_flight.clear()
        self._finished.clear()
        self.counts.zero_()
