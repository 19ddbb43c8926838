"""Loads a Hugging Face causal LM, owns the paged KV pool, and runs one packed forward per step.

The model is transformers' own code with the attention implementation "sluice_paged"
(services/engine/attention.py). Each step feeds a single `(1, T)` batch with explicit per-sequence
`position_ids`, `use_cache=False`, and `logits_to_keep` listing the rows whose next token is sampled.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.engine.attention import (
    ATTN_NAME,
    META_KWARG,
    DecodeGroup,
    PrefillSeq,
    StepMeta,
    paged_attention,
)
from services.engine.request import Request

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
GiB = 1 << 30

transformers.AttentionInterface.register(ATTN_NAME, paged_attention)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def read_eos_ids(model_dir: Path, config: transformers.PretrainedConfig) -> frozenset[int]:
    """EOS ids from generation_config.json, else config.json."""
    eos: object = None
    gen_path = model_dir / "generation_config.json"
    if gen_path.exists():
        eos = json.loads(gen_path.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos) if isinstance(eos, list) else frozenset([int(eos)])  # type: ignore[arg-type]


class ModelRunner:
    """The model, its KV pool, and `execute` (one step's forward).

    Pool layout: per layer a K and a V tensor of shape (num_blocks * block_size, Hkv, D); slot
    `b * block_size + i` holds token i of block b.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        device: str = "auto",
        dtype: str = "auto",
        block_size: int = 16,
        kv_cache_gb: float = 0.5,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int = 0,
    ) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"{self.model_dir} is not a Hugging Face model directory (no config.json)")
        config = transformers.AutoConfig.from_pretrained(self.model_dir)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model type {config.model_type!r} is not supported; "
                f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        self.config = config
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation=ATTN_NAME
        ).to(self.device)
        self.model.eval()
        self.eos_ids = read_eos_ids(self.model_dir, config)
        self.vocab_size = int(config.vocab_size)
        self.block_size = block_size
        self.num_layers = int(config.num_hidden_layers)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.num_blocks = num_kv_blocks or self._blocks_from_budget(kv_cache_gb, gpu_memory_utilization)
        slots = self.num_blocks * block_size
        self.kv = [
            (
                torch.zeros((slots, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device),
                torch.zeros((slots, self.num_kv_heads, self.head_dim), dtype=self.dtype, device=self.device),
            )
            for _ in range(self.num_layers)
        ]
        self.max_position_embeddings = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.max_model_len = 0  # set by prepare()
        self.max_num_seqs = 0
        self.last_forward_s = 0.0
        # Decode grouping: a new group pays off when it saves this many padded key slots (per-call
        # overhead is larger on a GPU, where gathering is cheap).
        self.group_split_slots = 16384 if self.device.type == "cuda" else 2048
        log.info(
            "loaded %s (%s) on %s %s; KV pool %d blocks of %d tokens",
            self.model_dir,
            config.model_type,
            self.device,
            self.dtype,
            self.num_blocks,
            block_size,
        )

    def _blocks_from_budget(self, kv_cache_gb: float, utilization: float) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem
        if self.device.type == "cuda" and kv_cache_gb <= 0:
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * utilization)
        else:
            budget = int(kv_cache_gb * GiB)
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"KV cache budget too small for one block of {per_block} bytes")
        return blocks

    def prepare(self, max_model_len: int, max_num_seqs: int) -> None:
        """Called once by the engine before its first step (see `Runner.prepare`)."""
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[tuple[Request, int]], prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        """Runs the model on the step's tokens and returns the logits (N, V) of the requests that sample
        (a request samples when its chunk reaches its last token) and those requests, in row order.

        Decode rows (one new token, longest context first) go first in the packed batch, then the
        prefill chunks. A decode row with `prev_row >= 0` reads its input token from
        `prev_tokens[prev_row]` on the device (async scheduling).
        """
        decodes = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
        decodes.sort(key=lambda x: -x[0].num_computed_tokens)  # longest context first, for grouping
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
        ids, pos, slots, keep_rows = self._pack(decodes, prefills)
        meta = self._meta(decodes, prefills, slots)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)[None]
        pending = [(row, r.prev_row) for row, (r, _) in enumerate(decodes) if r.prev_row >= 0]
        if pending:
            if prev_tokens is None:
                raise ValueError("a request waits for a token of the previous step, but none was given")
            rows, src = zip(*pending, strict=True)
            idx = torch.tensor(src, dtype=torch.long, device=dev)
            input_ids[0, torch.tensor(rows, dtype=torch.long, device=dev)] = prev_tokens.index_select(0, idx)
        position_ids = torch.tensor(pos, dtype=torch.long, device=dev)[None]
        keep = torch.tensor([row for _, row in keep_rows], dtype=torch.long, device=dev)
        start = time.perf_counter()
        with self._sdpa_backends():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{META_KWARG: meta},
            )
        logits = out.logits[0]  # (N, V) in packed order
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.last_forward_s = time.perf_counter() - start
        return logits, [r for r, _ in keep_rows]

    def _sdpa_backends(self) -> contextlib.AbstractContextManager[None]:
        """On CUDA, SDPA without the cuDNN backend: it plans a graph for every new shape, and attention
        shapes change every step here."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _pack(
        self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]
    ) -> tuple[list[int], list[int], list[int], list[tuple[Request, int]]]:
        """Token ids, positions and pool slots of the packed batch, and (request, row) to sample."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        keep: list[tuple[Request, int]] = []
        for r, _ in decodes:
            p = r.num_computed_tokens
            if p + 1 == r.num_tokens:
                keep.append((r, len(ids)))
            ids.append(r.token_ids[p] if r.prev_row < 0 else 0)  # 0: a placeholder, filled on the device
            pos.append(p)
            slots.append(r.block_ids[p // bs] * bs + p % bs)
        for r, n in prefills:
            p0 = r.num_computed_tokens
            ids.extend(r.token_ids[p0 : p0 + n])
            rng = range(p0, p0 + n)
            pos.extend(rng)
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in rng)
            if p0 + n == r.num_tokens:
                keep.append((r, len(ids) - 1))
        return ids, pos, slots, keep

    def _meta(
        self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]], slots: list[int]
    ) -> StepMeta:
        dev = self.device
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        groups = self._decode_groups(decodes) if decodes else []
        seqs: list[PrefillSeq] = []
        row = len(decodes)
        for r, n in prefills:
            p0 = r.num_computed_tokens
            ctx = self._ctx_slots(r.block_ids, p0 + n) if p0 > 0 else None
            seqs.append(PrefillSeq(q_start=row, q_len=n, ctx_start=p0, ctx_slots=ctx))
            row += n
        return StepMeta(self.kv, slot_mapping, groups, seqs)

    def _decode_groups(self, decodes: list[tuple[Request, int]]) -> list[DecodeGroup]:
        """Splits the decode rows (sorted by context length, longest first) where padding every later row
        to the current group's length would cost more than another attention call."""
        dev = self.device
        bs = self.block_size
        lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        starts = [0]
        longest = lens[0]
        for i, n in enumerate(lens):
            if (longest - n) * (len(lens) - i) > self.group_split_slots:
                starts.append(i)
                longest = n
        max_blocks = -(-lens[0] // bs)
        table = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in decodes]
        blocks = torch.tensor(table, dtype=torch.long, device=dev)  # (Bd, max_blocks)
        slots = (blocks[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(len(decodes), -1)
        lens_t = torch.tensor(lens, dtype=torch.long, device=dev)
        bounds = [*starts, len(lens)]
        return [
            DecodeGroup(a, slots[a:b, : lens[a]].contiguous(), lens_t[a:b])
            for a, b in itertools.pairwise(bounds)
        ]

    def _ctx_slots(self, block_ids: list[int], length: int) -> torch.Tensor:
        bs = self.block_size
        nb = -(-length // bs)
        blocks = torch.tensor(block_ids[:nb], dtype=torch.long, device=self.device)
        return (blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)[:length]
