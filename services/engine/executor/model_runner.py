"""Loads a Hugging Face causal LM, owns the paged KV pool, and runs one packed forward per step.

The model is transformers' own code with the attention implementation "sluice_paged"
(services/engine/executor/attention.py). Each step feeds a single `(1, T)` batch with explicit per-sequence
`position_ids`, `use_cache=False`, and `logits_to_keep` listing the rows whose next token is sampled,
plus, for a request that asks for prompt logprobs, the rows of its prompt (`ModelRunner.prompt_logits`).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.common.models import eos_token_ids, resolve_model_dir, tokenizer_eos_id, tokenizer_size
from services.engine.core.request import Request
from services.engine.executor import capabilities, compiled, host_malloc, kv_sizing
from services.engine.executor.attention import (
    ATTN_NAME,
    META_KWARG,
    DecodeGroup,
    DecodeScratch,
    PrefillSeq,
    StepMeta,
)
from services.engine.executor.cpu_linear import pack_linears
from services.engine.executor.cuda_graphs import Staging, StaticDecode
from services.engine.executor.kernels import cpu_kernels
from services.engine.executor.kv_sizing import KVLayout, group_layers, initial_kv_cache_gb
from services.engine.executor.moe import ExpertLoad, choose_experts_implementation, experts_modules
from services.engine.executor.quantization import check_quantization, quantize_model
from services.engine.settings import EngineSettings

log = logging.getLogger(__name__)

GiB = 1 << 30

# attention.paged_attention, or inside the compiled step its custom op (executor/compiled.py)
transformers.AttentionInterface.register(ATTN_NAME, compiled.attend)


def load_runner(settings: EngineSettings) -> ModelRunner:
    """The engine's runner as `settings` ask: torch's CPU threads and, on a CPU, the C allocator keeping
    freed blocks (host_malloc), the model and its pool, resized on CUDA with an automatic size from the
    memory free after a warm-up forward (kv_sizing.fit_kv_pool)."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if resolve_device(settings.device).type == "cpu":
        host_malloc.keep_freed_memory()
    runner = ModelRunner(settings)
    kv_sizing.fit_kv_pool(runner, settings)
    return runner


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """The compute dtype. auto: bf16 on CUDA; on a CPU bf16 only for a half-precision checkpoint
    (`checkpoint`, the config's dtype) on a CPU with bf16 instructions (AMX or AVX512-BF16), else fp32."""
    if name != "auto":
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    if device.type == "cuda":
        return torch.bfloat16
    half = checkpoint in (torch.bfloat16, torch.float16)
    fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    dtype = torch.bfloat16 if half and fast else torch.float32
    log.info("dtype auto on CPU: %s (checkpoint %s, CPU bf16 instructions: %s)", dtype, checkpoint, fast)
    return dtype


def read_eos_ids(model_dir: Path, config: transformers.PretrainedConfig) -> frozenset[int]:
    """The ids that stop a generation: the same rule as the tokenizer's (models.eos_token_ids, with the
    tokenizer's eos token), so the two agree."""
    return frozenset(eos_token_ids(model_dir, tokenizer_eos_id(model_dir)))


def sampled_vocab(model_dir: Path, vocab_size: int) -> int:
    """The ids a step may sample: [0, this). A model whose vocabulary has more rows than its tokenizer has
    ids (embeddings padded to a round size) never samples the rows past the tokenizer's, which nothing could
    turn into text; `vocab_size` where the tokenizer has as many or there is none."""
    size = tokenizer_size(model_dir)
    if size is None or size >= vocab_size:
        return vocab_size
    log.info(
        "vocabulary: %d rows, the tokenizer %d ids; ids from %d on are never sampled",
        vocab_size,
        size,
        size,
    )
    return size


def checkpoint_dtype(config: transformers.PretrainedConfig) -> torch.dtype | None:
    """The dtype the checkpoint was saved in (config `dtype`, formerly `torch_dtype`), None if unsaid."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def triton_status(device: torch.device) -> tuple[bool, str]:
    """Whether the paged Triton kernel can run on `device`, and if not, why."""
    try:
        from services.engine.executor.kernels.paged_attention import triton_usable
    except ImportError as exc:
        return False, f"the paged attention kernel cannot be imported ({exc})"
    if triton_usable(device):
        return True, ""
    if device.type == "cuda":
        return False, "triton is not importable"
    interp = os.environ.get("TRITON_INTERPRET", "")
    return False, f"device {device} is not CUDA and TRITON_INTERPRET=1 is not set (it is {interp!r})"


PAGED_BACKENDS = ("triton", "cpu")  # decode attention reading block tables and lengths, no gather groups


def resolve_backend(name: str, device: torch.device) -> str:
    """The decode attention backend: "triton", "cpu" or "torch". auto = triton on CUDA when usable, the
    C++ paged kernel on a CPU when it builds (kernels/cpu_kernels.py), else torch; "triton" or "cpu" where
    the kernel cannot run raises ValueError saying why."""
    if name == "torch":
        return "torch"
    if name not in ("auto", "cpu", "triton"):
        raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {name!r}")
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        if device.type != "cpu":
            raise ValueError(f"attention_backend cpu cannot run on device {device}")
        module, why = cpu_kernels.status()
        if module is not None:
            return "cpu"
        if name == "cpu":
            raise ValueError(f"attention_backend cpu cannot run: {why}")
        return "torch"  # the reason is logged by cpu_kernels
    if name == "auto" and device.type != "cuda":
        return "torch"
    usable, why = triton_status(device)
    if usable:
        return "triton"
    if name == "auto":
        log.warning("attention backend: torch, the triton kernel is not usable: %s", why)
        return "torch"
    raise ValueError(f"attention_backend triton cannot run: {why}")


class ModelRunner:
    """The model, its KV pool, and `execute` (one step's forward).

    Pool layout: the layers form KV groups (`kv_groups`, kv_sizing.KVLayout: one for most models, a
    full-attention and a sliding group for a hybrid one), group g with `kv_groups[g].num_blocks` blocks;
    per layer a K and a V tensor of shape ((its group's blocks + 1) * block_size, Hkv, D); slot
    `b * block_size + i` holds token i of block b. The block past a group's blocks is scratch, never
    handed out: the padding rows of a padded decode batch write their K/V there, and the blocks that slid
    out of a window read it. A request's table of group g is `Request.tables[g]`.

    Built from the engine's settings; of them it reads `model` (the directory; '' = the embedded model),
    `device`, `dtype`, `block_size`, the pool's size (`num_kv_blocks`, else `kv_cache_gb` or its
    provisional default: kv_sizing.initial_kv_cache_gb), `attention_backend` (auto | torch | cpu | triton, see
    `resolve_backend`), `cuda_graphs` (on | off, acts on CUDA with the triton backend), `compile` (auto |
    on | off: the step under torch.compile, executor/compiled.py; auto = on for CUDA), `quantization`
    (none | int8 | fp8, applied to the weights after loading: executor/quantization.py), `cpu_linear`
    (auto | onednn | torch: oneDNN's prepacked linear layers on a CPU, executor/cpu_linear.py) and
    `kv_cache_dtype` (auto: the model's dtype | fp8: a float8 e4m3 pool, `kv_dtype`, which attention reads
    back in the compute dtype and which halves a block's bytes against bf16). `static_decode`: run
    decode-only steps through the padded static buffers of `StaticDecode` even without graphs (eagerly;
    tests use it on CPU), triton backend only.
    """

    def __init__(self, settings: EngineSettings, *, static_decode: bool = False) -> None:
        self.model_dir = resolve_model_dir(settings.model, settings.revision)
        if not (self.model_dir / "config.json").exists():
            raise ValueError(f"{self.model_dir} is not a Hugging Face model directory (no config.json)")
        config = transformers.AutoConfig.from_pretrained(self.model_dir)
        capabilities.check_config(config)  # what cannot be served is refused before the weights load
        self.config = config
        self.device = resolve_device(settings.device)
        self.dtype = resolve_dtype(settings.dtype, self.device, checkpoint_dtype(config))
        # auto = the model's, fp8 = float8 e4m3 (values clamped to ±448, scale 1.0)
        self.kv_dtype = {"auto": self.dtype, "fp8": torch.float8_e4m3fn}[settings.kv_cache_dtype]
        quantization = self.quantization = settings.quantization
        check_quantization(quantization, self.device)  # before the load: fp8 on a CPU stops here
        self.max_position_embeddings, long_rope = self._context_limit(config, settings.max_model_len)
        self.cuda_graphs = settings.cuda_graphs
        self.compile_setting = settings.compile
        self.max_num_batched_tokens = settings.max_num_batched_tokens
        self._compiled: compiled.CompiledStep | None = None
        self.static_decode = static_decode
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation=ATTN_NAME
        ).to(self.device)
        self.model.eval()
        if long_rope and not capabilities.pin_long_factor(self.model):
            raise ValueError(
                "longrope past original_max_position_embeddings: the model has no rotary embedding of "
                "transformers' kind (rope_type, original_inv_freq) to fix to the long factor"
            )
        quantize_model(self.model, quantization, self.device)
        self.packed_linears = pack_linears(
            self.model, settings.cpu_linear, self.device, self.dtype, quantization
        )
        self.num_layers = int(config.num_hidden_layers)
        # The head layout, windows, soft-caps and sinks as the model's own attention calls show them.
        self.attention = capabilities.probe(self.model, self.num_layers, self.device)
        self.num_heads = self.attention.num_heads
        self.num_kv_heads = self.attention.num_kv_heads
        self.head_dim = self.attention.head_dim
        self.backend = resolve_backend(settings.attention_backend, self.device)
        if self.backend == "triton" and self.device.type == "cuda":
            self.backend = self._checked_kernel(settings.attention_backend)
        if static_decode and self.backend != "triton":
            raise ValueError("static_decode needs the triton attention backend")
        # MoE: the experts kernel, and the tokens each step routes to each expert (None for a dense model).
        self.moe_experts = choose_experts_implementation(self.model, settings.moe_experts)
        moe_layers = experts_modules(self.model)
        self.expert_load = ExpertLoad(moe_layers, self.device, settings.max_num_seqs) if moe_layers else None
        self.eos_ids = read_eos_ids(self.model_dir, config)
        self.vocab_size = int(config.vocab_size)
        self.sampled_vocab = sampled_vocab(self.model_dir, self.vocab_size)
        block_size = self.block_size = settings.block_size
        element = torch.tensor([], dtype=self.kv_dtype).element_size()
        self.kv_layout = KVLayout(
            tuple(group_layers(self.attention.windows)),
            block_size,
            kv_sizing.block_bytes(1, block_size, self.num_kv_heads, self.head_dim, element),
            settings.max_num_seqs,
            settings.max_num_batched_tokens,
        )
        self.layer_group = [0] * self.num_layers  # each layer's KV group
        for g, (_, layers) in enumerate(self.kv_layout.groups):
            for i in layers:
                self.layer_group[i] = g
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.allocate_pool(settings.num_kv_blocks or self._blocks_from_budget(initial_kv_cache_gb(settings)))
        self.max_model_len = 0  # set by prepare()
        self.max_num_seqs = 0
        self._forward_s = 0.0  # finished forwards not reported yet (see last_forward_s)
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA forwards in flight
        self._long = Staging(self.device, torch.int64)
        self._int = Staging(self.device, torch.int32)
        self._static: StaticDecode | None = None
        # The prompt rows of the latest execute: (request, first position, logits (n, V)), row j of which
        # predicts the prompt token at position first + j + 1 (see `execute`).
        self.prompt_logits: list[tuple[Request, int, torch.Tensor]] = []
        # Decode grouping: a new group pays off when it saves this many padded key slots (per-call
        # overhead is larger on a GPU, where gathering is cheap).
        self.group_split_slots = 16384 if self.device.type == "cuda" else 2048
        self._scratch = DecodeScratch()  # the torch decode path's K/V gathers, reused across steps
        log.info(
            "loaded %s (%s: %s) on %s %s, quantization %s; KV pool %d blocks of %d tokens in %s (%s, "
            "%.2f GiB); decode attention %s%s",
            self.model_dir,
            config.model_type,
            "; ".join(self.attention.features()),
            self.device,
            self.dtype,
            quantization,
            self.num_blocks,
            block_size,
            self.kv_dtype,
            self.kv_layout.describe(self.num_blocks),
            self.kv_layout.pool_bytes(self.num_blocks) / GiB,
            self.backend,
            f"; MoE experts {self.moe_experts}" if self.moe_experts else "",
        )

    @staticmethod
    def _context_limit(config: transformers.PretrainedConfig, max_model_len: int) -> tuple[int, bool]:
        """(the model's context length, whether longrope's long factor is pinned). The length is
        max_position_embeddings, or for a RoPE kind whose frequencies depend on the forward's length
        (capabilities.rope_length_limit) the length up to which they do not, where a longer
        `max_model_len` is refused by name; except longrope whose context (`max_model_len`, else
        max_position_embeddings) is past that length: it keeps max_position_embeddings and is served
        with the long factor at every position (capabilities.pin_long_factor)."""
        own = int(getattr(config, "max_position_embeddings", 0) or 0)
        limit = capabilities.rope_length_limit(config)
        if limit is None:
            return own, False
        kind, length = limit
        wanted = max_model_len or own
        if kind == "longrope" and wanted > length:
            log.info(
                "longrope: the long factor for every position, since max_model_len %d > original %d; a "
                "sequence shorter than %d therefore differs from transformers' generate, which uses the "
                "short factor there",
                wanted,
                length,
                length,
            )
            return own, True
        if max_model_len > length:
            raise ValueError(
                f"max_model_len {max_model_len} is past {length}, where RoPE scaling {kind!r} changes its "
                "frequencies with the longest sequence in a forward (requests batched together would "
                f"change each other's output); serve at most {length} tokens"
            )
        log.info("context length capped at %d: RoPE scaling %r is exact up to there", length, kind)
        return (min(own, length) if own else length), False

    def _checked_kernel(self, setting: str) -> str:
        """ "triton" when the kernel compiles and agrees with its reference on this GPU in the model's head
        layout; otherwise "torch" under auto (with a warning saying why), ValueError under triton."""
        from services.engine.executor.kernels.paged_attention import self_check

        spec = self.attention
        why = self_check(
            self.device,
            self.dtype,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.kv_dtype,
            softcap=max(spec.softcaps, default=0.0),
            sinks=any(spec.sinks),
            sliding_window=max(spec.windows, default=0),
        )
        if why is None:
            return "triton"
        if setting == "triton":
            raise ValueError(f"attention_backend triton: the kernel fails its start-up check: {why}")
        log.warning("attention backend: torch, the triton kernel fails its start-up check: %s", why)
        return "torch"

    def allocate_pool(self, num_blocks: int) -> None:
        """Releases the KV pool and allocates one of `num_blocks` blocks in the first KV group (a sliding
        group gets `kv_layout.group_blocks`), plus each group's scratch block past them that its block
        manager never hands out: per layer K and V of ((its group's blocks + 1) * block_size, Hkv, D) in
        `kv_dtype`."""
        self.kv = []  # the old pool is freed before the new one takes its memory
        self.kv_groups = self.kv_layout.specs(num_blocks)
        for g in self.layer_group:
            shape = ((self.kv_groups[g].num_blocks + 1) * self.block_size, self.num_kv_heads, self.head_dim)
            k = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            self.kv.append((k, torch.zeros_like(k)))
        self.num_blocks = num_blocks

    def _blocks_from_budget(self, kv_cache_gb: float) -> int:
        blocks = self.kv_layout.blocks_for_bytes(int(kv_cache_gb * GiB))
        if blocks < 1:
            raise ValueError(
                f"KV cache budget too small for one block of {self.kv_layout.pool_bytes(1)} bytes"
            )
        return blocks

    @property
    def scratch_slots(self) -> list[int]:
        """Per KV group, the first slot of its scratch block (past the blocks its manager hands out)."""
        return [g.num_blocks * self.block_size for g in self.kv_groups]

    @property
    def last_forward_s(self) -> float:
        """Seconds in the model forward of the forwards finished since the previous read (CPU: timed by
        the host; CUDA: by events, read without waiting), so the sum of the reads is the whole forward
        time however often the engine reads."""
        done = 0
        while done < len(self._timings) and self._timings[done][1].query():
            start, end = self._timings[done]
            self._forward_s += start.elapsed_time(end) / 1000.0
            done += 1
        del self._timings[:done]
        figure, self._forward_s = self._forward_s, 0.0
        return figure

    def prepare(self, max_model_len: int, max_num_seqs: int) -> None:
        """Called once by the engine before its first step, with the pool final (see `Runner.prepare`):
        the compiled step (every bucket compiled now) when compile is wanted, the static decode buffers
        and, on CUDA with graphs on and the triton backend, the graphs (captured from the compiled step
        when there is one)."""
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        # A full decode batch's inputs without growing the staging buffers: ids, positions, slots, sampled
        # rows, pending rows (two), and per KV group the slots and the block table, the lengths (int64 for
        # torch, int32 for the paged kernels).
        groups = len(self.kv_groups)
        table = groups * max_num_seqs * (-(-max_model_len // self.block_size) + 1)
        self._long.reserve((5 + groups) * max_num_seqs + (table if self.backend == "torch" else 0))
        self._int.reserve(table + max_num_seqs if self.backend in PAGED_BACKENDS else 0)
        self._compiled = self._compile_step(max_num_seqs)
        graphs, why = self._graphs_wanted()
        self._static = None
        if graphs or self.static_decode:
            self._static = StaticDecode(
                self.kv,
                device=self.device,
                block_size=self.block_size,
                max_num_seqs=max_num_seqs,
                max_model_len=max_model_len,
                scratch_slots=self.scratch_slots,
                layer_group=self.layer_group,
            )
        if graphs:
            assert self._static is not None
            try:
                with torch.inference_mode():
                    self._static.capture(self._forward)  # from the compiled step when there is one
            except Exception as exc:  # e.g. an operation of the model's code that cannot be captured
                why = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graphs: capture failed, every step runs eagerly: %s", why)
                self._static = None
        elif self.device.type == "cuda":
            log.info("CUDA graphs: none, every step runs eagerly (%s)", why)
        if self.expert_load is not None:
            self.expert_load.reset()  # the warm-up and capture forwards routed nothing of a request's

    def _compile_wanted(self) -> tuple[bool, str]:
        """Whether to compile the step, and why not. auto: on CUDA only (on a CPU the compiled step
        measured no faster: docs/architecture.md, "Where the cycles go")."""
        if self.compile_setting == "off":
            return False, "compile is off"
        if self.compile_setting == "auto" and self.device.type != "cuda":
            return False, "compile auto is off on a CPU"
        return True, ""

    def _compile_step(self, max_num_seqs: int) -> compiled.CompiledStep | None:
        """The compiled step for decode batches up to `max_num_seqs` rows and prefill steps up to the
        token budget, every bucket compiled now; None (every step eager, the reason logged) when compile
        is not wanted or the model does not compile."""
        wanted, why = self._compile_wanted()
        if not wanted:
            log.info("compile: none, every step runs eagerly (%s)", why)
            return None
        sizes = compiled.buckets(max_num_seqs, max(max_num_seqs, self.max_num_batched_tokens))
        step = compiled.CompiledStep(self.model, sizes, max_num_seqs, self.device)
        empty = StepMeta(self.kv, torch.zeros(0, dtype=torch.long, device=self.device), [], [],
                         backend=self.backend, block_size=self.block_size)  # fmt: skip
        if self.backend in PAGED_BACKENDS:
            empty.block_tables = torch.zeros((0, 1), dtype=torch.int32, device=self.device)
            empty.seq_lens = torch.zeros(0, dtype=torch.int32, device=self.device)
        log.info("compile: %s step sizes %s (torch.compile, inductor) ...", self.config.model_type, sizes)
        try:
            with torch.inference_mode():
                step.warm_up(empty)
        except Exception as exc:  # an operation of the model's code that does not compile
            log.warning("compile: failed, every step runs eagerly: %s: %s", type(exc).__name__, exc)
            torch._dynamo.reset()
            return None
        return step

    def _graphs_wanted(self) -> tuple[bool, str]:
        if self.device.type != "cuda":
            return False, "not a CUDA device"
        if self.cuda_graphs != "on":
            return False, "cuda_graphs is off"
        if self.backend != "triton":
            return False, "the torch attention backend"
        return True, ""

    # ---- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(
        self, scheduled: Sequence[tuple[Request, int]], prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        """Runs the model on the step's tokens and returns the logits (N, V) of the requests that sample
        (a request samples when its chunk reaches its last token) and those requests, in row order; the
        columns past `sampled_vocab` are -inf.
        A request with drafts (`draft_ids`, speculative decoding) computes its last token and the drafts
        as one chunk and gets 1 + len(draft_ids) consecutive rows, its name repeated once per row.

        Decode rows (one new token, longest context first) go first in the packed batch, then the
        prefill chunks. A decode row with `prev_row >= 0` reads its input token from
        `prev_tokens[prev_row]` on the device (async scheduling). The host builds the inputs; on CUDA
        they go to the device in non-blocking copies and nothing here waits for the device. A decode-only
        step runs through the padded static buffers (and a CUDA graph) when `prepare` made them.

        Prompt logprobs: for a request that wants them (`Request.wants_prompt_logprobs`), the rows of the
        prompt positions it computes in this step, before its last prompt token and from the first it has
        no entry for, are kept too and left in `prompt_logits` (an empty list for a step without any).
        """
        decodes = [(r, n) for r, n in scheduled if n == 1 and r.num_computed_tokens > 0]
        decodes.sort(key=lambda x: -x[0].num_computed_tokens)  # longest context first, for grouping
        prefills = [(r, n) for r, n in scheduled if not (n == 1 and r.num_computed_tokens > 0)]
        ids, pos, slots, keep_rows = self._pack(decodes, prefills)
        prompt_rows = self._prompt_rows(decodes, prefills)
        self.prompt_logits = []
        pending = [(row, r.prev_row) for row, (r, _) in enumerate(decodes) if r.prev_row >= 0]
        if pending and prev_tokens is None:
            raise ValueError("a request waits for a token of the previous step, but none was given")
        timer = self._start_timer()
        static = self._static
        if (
            static is not None
            and decodes
            and not prefills
            and not prompt_rows
            and len(decodes) <= static.max_rows
        ):
            keep, rows, src = self._long.stage(
                [[row for _, row in keep_rows], [a for a, _ in pending], [b for _, b in pending]]
            )
            prev = (rows, src, prev_tokens) if pending and prev_tokens is not None else None
            blocks = [[r.tables[g] for r, _ in decodes] for g in range(len(self.kv_groups))]
            if self.expert_load is not None:  # the padding rows route too: they count 0
                self.expert_load.begin(len(decodes), static.max_rows)
            all_logits = static.run(ids, pos, slots, blocks, prev, self._forward)
            logits = all_logits.index_select(0, keep)
        else:
            extra = [row for _, _, rows in prompt_rows for row in rows]
            if self.expert_load is not None:  # a compiled step's padding rows route too: they count 0
                self.expert_load.begin(len(ids), self._rows_run(len(ids), len(keep_rows) + len(extra)))
            logits = self._execute_eager(
                decodes,
                prefills,
                ids,
                pos,
                slots,
                [row for _, row in keep_rows] + extra,
                pending,
                prev_tokens,
            )
            logits, prompt = logits[: len(keep_rows)], logits[len(keep_rows) :]  # (N, V), (M, V)
            offset = 0
            for req, first, rows in prompt_rows:
                self.prompt_logits.append((req, first, prompt[offset : offset + len(rows)]))
                offset += len(rows)
        if self.expert_load is not None:
            self.expert_load.end()
        if self.sampled_vocab < logits.shape[-1]:
            logits[:, self.sampled_vocab :] = float("-inf")  # rows no tokenizer id stands for (sampled_vocab)
        self._stop_timer(timer)
        return logits, [r for r, _ in keep_rows]

    @staticmethod
    def _prompt_rows(
        decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]
    ) -> list[tuple[Request, int, list[int]]]:
        """Per request that wants prompt logprobs and computes prompt positions it has no entry for, other
        than its last prompt token: (request, first such position, their rows in the packed batch), the
        rows laid out as `_pack` lays them out (decode rows first, then the prefill chunks)."""
        out: list[tuple[Request, int, list[int]]] = []
        row = 0
        for r, n in [*decodes, *prefills]:
            if r.wants_prompt_logprobs:
                p0 = r.num_computed_tokens
                first = max(p0, len(r.prompt_logprobs))
                end = min(p0 + n, r.num_prompt_tokens - 1)
                if first < end:
                    out.append((r, first, list(range(row + first - p0, row + end - p0))))
            row += n
        return out

    def _execute_eager(
        self,
        decodes: list[tuple[Request, int]],
        prefills: list[tuple[Request, int]],
        ids: list[int],
        pos: list[int],
        slots: list[list[int]],
        keep_rows: list[int],
        pending: list[tuple[int, int]],
        prev_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The packed step as it is: every input in one staged copy (two with a paged-kernel backend: the
        tables and lengths in int32); the logits of the rows `keep_rows`, in that order."""
        paged, bs = self.backend in PAGED_BACKENDS, self.block_size
        parts: list[Sequence[int] | np.ndarray] = [
            ids,
            pos,
            keep_rows,
            [a for a, _ in pending],
            [b for _, b in pending],
        ]
        lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        if decodes and not paged:
            parts.append(lens)
        tables = [self._decode_table(decodes, g) for g in range(len(slots))]
        for g, group_slots in enumerate(slots):  # per KV group: slots, prefill context blocks, decode table
            parts.append(group_slots)
            # The blocks holding each prefill chunk's tokens and the context before them.
            parts.extend(r.tables[g][: -(-(r.num_computed_tokens + n) // bs)] for r, n in prefills)
            if decodes and not paged:
                parts.append(tables[g].reshape(-1))
        staged = self._long.stage(parts)
        ids_t, pos_t, keep, rows, src = staged[:5]
        lens_t = staged[5] if decodes and not paged else None
        int_staged = self._int.stage([*(t.reshape(-1) for t in tables), lens]) if paged else []
        at = 6 if lens_t is not None else 5
        metas = []
        for g, table in enumerate(tables):
            slots_t, ctx_t = staged[at], staged[at + 1 : at + 1 + len(prefills)]
            at += 1 + len(prefills)
            meta = self._meta(decodes, prefills, slots_t, ctx_t)  # over group g's slots and tables
            if paged:
                meta.block_tables = int_staged[g].view(table.shape)
                meta.seq_lens = int_staged[-1]
            elif decodes:
                assert lens_t is not None
                meta.decode_groups = self._decode_groups(decodes, staged[at].view(table.shape), lens_t)
                at += 1
            metas.append(meta)
        meta = metas[0]
        if len(metas) > 1:
            meta.group_metas, meta.layer_group = metas, self.layer_group
        input_ids = ids_t[None]
        if pending:
            assert prev_tokens is not None
            input_ids = input_ids.clone()
            input_ids[0, rows] = prev_tokens.index_select(0, src).to(input_ids.dtype)
        return self._forward(input_ids, pos_t[None], meta, keep)  # (N, V) in packed order

    def _forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        meta: StepMeta,
        keep: torch.Tensor | int = 0,
    ) -> torch.Tensor:
        """The logits of the rows `keep`; by default those of every row, (G, V) for a padded decode batch
        (the shape a graph needs). Through the compiled step when there is one and the step fits a bucket."""
        step = self._compiled
        if step is not None:
            rows = keep.shape[0] if isinstance(keep, torch.Tensor) else input_ids.shape[1]
            if step.fits(input_ids.shape[1], rows):
                with self._sdpa_backends():
                    return step.run(
                        input_ids, position_ids, meta, keep if isinstance(keep, torch.Tensor) else None
                    )
        with self._sdpa_backends():
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                use_cache=False,
                logits_to_keep=keep,
                **{META_KWARG: meta},
            )
        return out.logits[0]

    def _rows_run(self, tokens: int, kept: int) -> int:
        """The rows the forward of a step of `tokens` tokens keeping `kept` logits rows runs: its compiled
        bucket's, else `tokens`."""
        step = self._compiled
        if step is None or not step.fits(tokens, kept):
            return tokens
        return compiled.bucket_for(step.sizes, tokens) or tokens

    def _start_timer(self) -> torch.cuda.Event | float:
        if self.device.type != "cuda":
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def _stop_timer(self, start: torch.cuda.Event | float) -> None:
        if isinstance(start, float):
            self._forward_s += time.perf_counter() - start
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._timings.append((start, end))

    def _sdpa_backends(self) -> contextlib.AbstractContextManager[None]:
        """On CUDA, SDPA without the cuDNN backend: it plans a graph for every new shape, and attention
        shapes change every step here."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _pack(
        self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]]
    ) -> tuple[list[int], list[int], list[list[int]], list[tuple[Request, int]]]:
        """Token ids, positions and pool slots (per KV group) of the packed batch, and (request, row) to
        sample."""
        ids: list[int] = []
        pos: list[int] = []
        keep: list[tuple[Request, int]] = []
        for r, _ in decodes:
            p = r.num_computed_tokens
            if p + 1 == r.num_tokens:
                keep.append((r, len(ids)))
            ids.append(r.token_ids[p] if r.prev_row < 0 else 0)  # 0: a placeholder, filled on the device
            pos.append(p)
        for r, n in prefills:
            p0 = r.num_computed_tokens
            ids.extend(r.token_ids[p0 : p0 + n])
            drafts = len(r.draft_ids)
            if drafts:  # speculative: the chunk is the last token and the drafts after it
                assert p0 + n == r.num_tokens + drafts and r.prev_row < 0, "drafts come with the last token"
                ids.extend(r.draft_ids)
            pos.extend(range(p0, p0 + n))
            if p0 + n == r.num_tokens + drafts:
                keep.extend((r, len(ids) - 1 - j) for j in range(drafts, -1, -1))
        return ids, pos, [self._slots(decodes, prefills, g) for g in range(len(self.kv_groups))], keep

    def _slots(
        self, decodes: list[tuple[Request, int]], prefills: list[tuple[Request, int]], group: int
    ) -> list[int]:
        """The pool slot in KV group `group` of every packed token, in `_pack`'s row order."""
        bs = self.block_size
        slots: list[int] = []
        for r, _ in decodes:
            p = r.num_computed_tokens
            slots.append(r.tables[group][p // bs] * bs + p % bs)
        for r, n in prefills:
            table, p0 = r.tables[group], r.num_computed_tokens
            slots.extend(table[p // bs] * bs + p % bs for p in range(p0, p0 + n))
        return slots

    def _meta(
        self,
        decodes: list[tuple[Request, int]],
        prefills: list[tuple[Request, int]],
        slot_mapping: torch.Tensor,
        ctx_blocks: list[torch.Tensor],
    ) -> StepMeta:
        seqs: list[PrefillSeq] = []
        row = len(decodes)
        for (r, n), blocks in zip(prefills, ctx_blocks, strict=True):
            p0 = r.num_computed_tokens
            ctx = self._ctx_slots(blocks, p0 + n) if p0 > 0 else None
            seqs.append(PrefillSeq(q_start=row, q_len=n, ctx_start=p0, ctx_slots=ctx))
            row += n
        return StepMeta(
            self.kv,
            slot_mapping,
            [],
            seqs,
            backend=self.backend,
            num_decodes=len(decodes),
            block_size=self.block_size,
            scratch=self._scratch,
        )

    def _decode_table(self, decodes: list[tuple[Request, int]], group: int) -> np.ndarray:
        """(Bd, max_blocks) block ids of the decode rows in KV group `group`, padded with block 0."""
        max_blocks = max((len(r.block_ids) for r, _ in decodes), default=0)
        table = np.zeros((len(decodes), max_blocks), dtype=np.int64)
        for i, (r, _) in enumerate(decodes):
            blocks = r.tables[group]
            table[i, : len(blocks)] = blocks
        return table

    def _decode_groups(
        self, decodes: list[tuple[Request, int]], blocks: torch.Tensor, lens_t: torch.Tensor
    ) -> list[DecodeGroup]:
        """Splits the decode rows (sorted by context length, longest first) where padding every later row
        to the current group's length would cost more than another attention call. `blocks`: their block
        table on the device (Bd, max_blocks); `lens_t`: their context lengths."""
        bs = self.block_size
        lens = [r.num_computed_tokens + 1 for r, _ in decodes]
        starts = [0]
        longest = lens[0]
        for i, n in enumerate(lens):
            if (longest - n) * (len(lens) - i) > self.group_split_slots:
                starts.append(i)
                longest = n
        bounds = [*starts, len(lens)]
        return [
            DecodeGroup(a, blocks[a:b, : -(-lens[a] // bs)].contiguous(), lens_t[a:b], bs)
            for a, b in itertools.pairwise(bounds)
        ]

    def _ctx_slots(self, blocks: torch.Tensor, length: int) -> torch.Tensor:
        bs = self.block_size
        return (blocks[:, None] * bs + torch.arange(bs, device=self.device)).reshape(-1)[:length]
