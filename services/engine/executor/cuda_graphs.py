"""Step inputs without synchronous copies, and CUDA graphs of decode-only steps.

`Staging` packs the integer inputs a step builds on the host into one buffer (pinned on CUDA) and sends
them with one non-blocking copy. `StaticDecode` owns fixed device buffers for decode-only steps (input
ids, positions, slot mapping, block tables of `ceil(max_model_len / block_size)` columns, sequence
lengths); a step of B rows is padded to the next captured size (padding rows: sequence length 0, K/V
written to a scratch slot no request owns) and, on CUDA with graphs on, replays the graph captured for
that size. Without graphs (on CPU, in tests) the same padded buffers run the model eagerly, so that the
padding logic is exercised everywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from services.engine.executor.attention import StepMeta

log = logging.getLogger(__name__)

Part = Sequence[int] | np.ndarray
# forward(input_ids (1, G), position_ids (1, G), meta) -> logits (G, V) of every row
Forward = Callable[[torch.Tensor, torch.Tensor, StepMeta], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, ... below `max_num_seqs`, and `max_num_seqs` itself."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return [1 << i for i in range((max_num_seqs - 1).bit_length())] + [max_num_seqs]


def padded_size(sizes: Sequence[int], rows: int) -> int:
    """The smallest of `sizes` (ascending) holding `rows` rows; ValueError when none does."""
    for s in sizes:
        if s >= rows:
            return s
    raise ValueError(f"{rows} decode rows exceed the largest captured batch {sizes[-1]}")


class Staging:
    """One step's integer inputs of one dtype, packed on the host and copied to the device at once.

    On CUDA the host buffer is pinned and the copy is non-blocking; before the buffer is written again
    the host waits for the event recorded after the previous copy (which ran at the start of the step
    before, so in practice it has long finished). On CPU the returned views are the host buffer itself.
    Views returned by `stage` are valid until the next call.
    """

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64, capacity: int = 1024) -> None:
        self.device = device
        self.dtype = dtype
        self.cuda = device.type == "cuda"
        self._event: torch.cuda.Event | None = None
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self.host = torch.empty(capacity, dtype=self.dtype, pin_memory=self.cuda)
        self.dev = torch.empty(capacity, dtype=self.dtype, device=self.device) if self.cuda else self.host
        self._np = self.host.numpy()

    def reserve(self, capacity: int) -> None:
        """Grows the buffers to hold at least `capacity` elements (at start-up, so that steps do not)."""
        if capacity > self.capacity:
            if self._event is not None:
                self._event.synchronize()
            self._alloc(1 << (capacity - 1).bit_length())

    def stage(self, parts: Sequence[Part]) -> list[torch.Tensor]:
        """Device tensors (1-D) holding `parts`, in order."""
        total = sum(len(p) for p in parts)
        if self._event is not None:
            self._event.synchronize()
        if total > self.capacity:
            self._alloc(1 << (total - 1).bit_length())
        views = []
        offset = 0
        for p in parts:
            n = len(p)
            self._np[offset : offset + n] = p
            views.append(self.dev[offset : offset + n])
            offset += n
        if self.cuda and total:
            self.dev[:total].copy_(self.host[:total], non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return views


class StaticDecode:
    """Fixed input buffers of decode-only steps, padded to the captured batch sizes, and on CUDA their
    graphs (one per size, captured largest first into one memory pool).

    `run(ids, positions, slots, block_ids, pending)` fills the buffers for B <= max rows (the host lists
    are the real rows; `slots` and `block_ids` per KV group of the pool (ModelRunner.kv_groups), each
    group with its slot row, its block tables and its scratch slot in `scratch_slots`; `pending` = (rows,
    prev row) device tensors of the rows whose input id comes from `prev_tokens` on the device), replays
    (or runs) the padded forward and returns the logits of the B real rows.
    """

    def __init__(
        self,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        device: torch.device,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        scratch_slots: Sequence[int],
        layer_group: Sequence[int],
    ) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.max_rows = self.sizes[-1]
        self.width = -(-max_model_len // block_size)
        self.scratch_slots = list(scratch_slots)
        self.layer_group = layer_group
        groups = len(self.scratch_slots)
        rows = self.max_rows
        # Host buffers (pinned on CUDA) and their device copies (the host buffers themselves on CPU): ids,
        # positions and each group's slots as one (2 + groups, rows) int64 tensor, sequence lengths, block
        # tables (groups, rows, width).
        shapes = (
            ((2 + groups, rows), torch.int64),
            ((rows,), torch.int32),
            ((groups, rows, self.width), torch.int32),
        )
        host = [torch.zeros(shape, dtype=dtype, pin_memory=self.cuda) for shape, dtype in shapes]
        self._host_long, self._host_lens, self._host_table = host
        self._long_np, self._lens_np, self._table_np = (t.numpy() for t in host)
        dev = [torch.zeros_like(t, device=device) for t in host] if self.cuda else host
        self._dev_long, self.seq_lens, self.block_tables = dev
        self.input_ids, self.positions, *self.slot_mappings = self._dev_long
        self.kv = kv
        self._event: torch.cuda.Event | None = None
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool_bytes = 0

    def meta(self, size: int) -> StepMeta:
        """The StepMeta of a padded batch of `size` rows (per KV group beyond one, in `group_metas`):
        views of the static buffers, so that a replay reads the data of the step being run."""
        metas = [
            StepMeta(
                self.kv,
                slots[:size],
                [],
                [],
                backend="triton",
                num_decodes=size,
                block_tables=self.block_tables[g, :size],
                seq_lens=self.seq_lens[:size],
                block_size=self.block_size,
            )
            for g, slots in enumerate(self.slot_mappings)
        ]
        if len(metas) > 1:
            metas[0].group_metas, metas[0].layer_group = metas, self.layer_group
        return metas[0]

    def _inputs(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.input_ids[:size][None], self.positions[:size][None]

    def capture(self, forward: Forward) -> None:
        """Captures the padded forward for every size, largest first, sharing one graph memory pool; logs
        the time taken and the pool's memory."""
        if not self.cuda:
            raise ValueError("CUDA graphs need a CUDA device")
        self._fill_padding(0, self.max_rows)
        self._copy(self.max_rows)
        torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        free_before, _ = torch.cuda.mem_get_info(self.device)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            ids, pos = self._inputs(size)
            meta = self.meta(size)
            forward(ids, pos, meta)  # warm-up outside the graph: kernels compiled, workspaces allocated
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = forward(ids, pos, meta)
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        self.pool_bytes = max(0, free_before - free_after)
        log.info(
            "CUDA graphs: captured decode batch sizes %s in %.2f s; graph memory %.1f MiB",
            ",".join(map(str, self.sizes)),
            time.perf_counter() - start,
            self.pool_bytes / (1 << 20),
        )

    def _fill_padding(self, start: int, stop: int) -> None:
        """Padding rows: id 0 at position 0, written to the scratch slot, sequence length 0."""
        self._long_np[:2, start:stop] = 0
        for g, scratch in enumerate(self.scratch_slots):
            self._long_np[2 + g, start:stop] = scratch
        self._lens_np[start:stop] = 0

    def _copy(self, size: int) -> None:
        if not self.cuda:
            return
        self._dev_long.copy_(self._host_long, non_blocking=True)
        self.seq_lens.copy_(self._host_lens, non_blocking=True)
        for g in range(self.block_tables.shape[0]):
            self.block_tables[g, :size].copy_(self._host_table[g, :size], non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def run(
        self,
        ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[Sequence[int]],
        block_ids: Sequence[Sequence[Sequence[int]]],
        pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
        forward: Forward,
    ) -> torch.Tensor:
        """Logits (B, V) of the B real rows. `pending`: (rows, source rows, prev_tokens): the input id of
        row rows[i] is prev_tokens[source[i]], copied on the device."""
        b = len(ids)
        size = padded_size(self.sizes, b)
        if self._event is not None:
            self._event.synchronize()  # the previous step's copy out of the host buffers is done
        self._long_np[0, :b] = ids
        self._long_np[1, :b] = positions
        for g, group_slots in enumerate(slots):
            self._long_np[2 + g, :b] = group_slots
        self._fill_padding(b, size)
        table = self._table_np
        for g, tables in enumerate(block_ids):
            for i, blocks in enumerate(tables):
                table[g, i, : len(blocks)] = blocks
        self._lens_np[:b] = np.asarray(positions) + 1
        self._copy(size)
        if pending is not None:
            rows, src, prev_tokens = pending
            self.input_ids.index_copy_(0, rows, prev_tokens.index_select(0, src).to(self.input_ids.dtype))
        graph = self.graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1][:b]
        ids_t, pos_t = self._inputs(size)
        return forward(ids_t, pos_t, self.meta(size))[:b]
