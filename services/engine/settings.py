"""Settings of the engine service (flags `--field-name`, environment `SLUICE_FIELD_NAME`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import StageTlsSettings, check_bounds, check_choices

BATCHING_POLICIES = ("continuous", "dynamic", "static")
SPECULATIVE_METHODS = ("off", "ngram")
QUANTIZATIONS = ("none", "int8", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8")
COMPILE_MODES = ("auto", "on", "off")  # what each does: executor/compiled.py
CPU_LINEAR_MODES = ("auto", "onednn", "torch")  # what each does: executor/cpu_linear.py
MOE_EXPERTS = ("auto", "grouped_mm", "eager", "batched_mm")  # what each is: executor/moe.py
CHOICES = (
    ("batching", BATCHING_POLICIES),
    ("dtype", ("auto", "float32", "bfloat16", "float16")),
    ("attention_backend", ("auto", "torch", "cpu", "triton")),
    ("cuda_graphs", ("on", "off")),
    ("compile", COMPILE_MODES),
    ("async_scheduling", ("auto", "on", "off")),
    ("speculative", SPECULATIVE_METHODS),
    ("quantization", QUANTIZATIONS),
    ("kv_cache_dtype", KV_CACHE_DTYPES),
    ("moe_experts", MOE_EXPERTS),
    ("cpu_linear", CPU_LINEAR_MODES),
)
BOUNDS = (  # kv_cache_gb 0 = automatic, threads 0 = torch's default, loop_recoveries 0 = none
    (">=", 1, ("max_num_seqs", "max_num_batched_tokens", "block_size", "static_batch_size")),
    (">=", 1, ("num_speculative_tokens", "speculative_disable_batch_size")),
    (">=", 0, ("default_max_new_tokens", "threads", "kv_cache_gb", "report_interval_ms", "loop_recoveries")),
    (">", 0, ("loop_recovery_window_s", "grammar_compile_timeout_s")),
    (">=", 1, ("max_step_failures", "grammar_compile_threads")),
)


@dataclass(frozen=True)
class EngineSettings(StageTlsSettings):
    """sluice engine: continuous batching over a paged KV cache."""

    model: str = field(
        default="",
        metadata={
            "help": "model directory or Hugging Face Hub id (ORG/NAME, from the cache or downloaded); "
            "'' = embedded model"
        },
    )
    revision: str = field(
        default="", metadata={"help": "branch, tag or commit of a Hub id in --model ('' = main)"}
    )
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50052, metadata={"help": "gRPC port (0 = any free port)"})
    grace_s: float = field(default=5.0, metadata={"help": "seconds calls in flight may finish on SIGTERM"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    threads: int = field(
        default=0,
        metadata={
            "help": "torch intra-op threads on CPU (0 = torch's default: one per core; sluice up "
            "gives one per core it may run on)"
        },
    )
    dtype: str = field(
        default="auto", metadata={"help": "auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16"}
    )
    batching: str = field(default="continuous", metadata={"help": "continuous | dynamic | static"})
    batch_wait_ms: float = field(
        default=10.0, metadata={"help": "dynamic/static: how long a partial batch forms before it runs"}
    )
    static_batch_size: int = field(default=16, metadata={"help": "static: fixed batch size"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(default=2048, metadata={"help": "token budget of one step"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_gb: float = field(
        default=0.0,
        metadata={
            "help": "KV pool budget in GiB; 0 = automatic: 0.5 on CPU, on CUDA gpu_memory_utilization "
            "of the memory free after loading the model and a warm-up forward (kv_sizing.py)"
        },
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata={
            "help": "CUDA, automatic KV size: fraction of the memory free after the warm-up forward "
            "that the KV pool takes (0 < f <= 1)"
        },
    )
    num_kv_blocks: int = field(
        default=0, metadata={"help": "KV pool size in blocks; 0 = from the memory budget"}
    )
    attention_backend: str = field(
        default="auto",
        metadata={
            "help": "decode attention: auto (triton on CUDA, cpu on a CPU where it builds, else torch) | "
            "torch (gather + SDPA) | cpu (the C++ paged kernel, built at first use) | triton (the paged "
            "kernel; on CPU only under TRITON_INTERPRET=1, for tests)"
        },
    )
    cpu_linear: str = field(
        default="auto",
        metadata={
            "help": "linear layers on a CPU: auto (oneDNN's prepacked weights for fp32/bf16 without "
            "quantization, compiled or not; else torch's) | onednn (refused where it cannot run) | torch "
            "(torch's GEMM)"
        },
    )
    cuda_graphs: str = field(
        default="on",
        metadata={
            "help": "on | off: on CUDA, replay decode-only steps from CUDA graphs captured at start-up "
            "for batch sizes 1, 2, 4, 8, ... up to max_num_seqs (ignored on CPU)"
        },
    )
    compile: str = field(
        default="auto",
        metadata={
            "help": "auto (on for CUDA, off on a CPU) | on | off: torch.compile the model step (inductor; "
            "decode batches padded to 1, 2, 4, ... max_num_seqs rows, prefill steps to x4 token buckets "
            "up to max_num_batched_tokens, all compiled at start-up; on CUDA the graphs are captured from "
            "it); a model that does not compile runs eagerly, the reason logged"
        },
    )
    async_scheduling: str = field(
        default="auto",
        metadata={"help": "auto (on for CUDA) | on | off: schedule step N+1 while the device runs step N"},
    )
    speculative: str = field(
        default="off",
        metadata={
            "help": "off | ngram: propose tokens by matching the request's last n-gram against its own "
            "prompt and output, and verify them in one forward; requests with a grammar (structured "
            "outputs) never get drafts; off (the only off switch) ignores the other speculative "
            "settings"
        },
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "speculative: most tokens proposed per request and step"}
    )
    ngram_min: int = field(default=1, metadata={"help": "speculative ngram: shortest n-gram matched"})
    ngram_max: int = field(
        default=4, metadata={"help": "speculative ngram: longest n-gram matched (tried first)"}
    )
    speculative_disable_batch_size: int = field(
        default=4,
        metadata={
            "help": "speculative: no proposals in a step with more running requests than this (a full "
            "batch has no compute to spare); >= 1: speculative=off turns speculation off"
        },
    )
    speculative_min_acceptance: float = field(
        default=0.3,
        metadata={
            "help": "speculative: a request accepting less than this share of its drafts (over windows "
            "of 8) stops proposing for 16 output tokens, doubling while it stays below"
        },
    )
    quantization: str = field(
        default="none",
        metadata={"help": "none | int8 (weight-only, CPU and CUDA) | fp8 (float8 weights, CUDA only)"},
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "auto (the model's dtype) | fp8 (float8 e4m3 KV pool: twice the blocks of bf16)"},
    )
    moe_experts: str = field(
        default="auto",
        metadata={
            "help": "mixture-of-experts models: the experts kernel, auto (grouped_mm where torch's grouped "
            "matmul runs on the device, else eager) | grouped_mm | eager | batched_mm"
        },
    )
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    max_model_len: int = field(default=0, metadata={"help": "context length; 0 = the model's own"})
    default_max_new_tokens: int = field(
        default=0,
        metadata={
            "help": "max_new_tokens when a request gives 0: the rest of the context (max_model_len - prompt "
            "tokens), capped at this when > 0 (0 = no cap)"
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the generator shared by unseeded requests"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics HTTP port (0 = none)"})
    report_interval_ms: float = field(
        default=50.0,
        metadata={"help": "least interval between two load and prefix-cache reports on one Stream call"},
    )
    trace_step_sample_rate: float = field(
        default=0.0, metadata={"help": "share of engine steps traced, as spans linked to their requests"}
    )
    loop_recoveries: int = field(
        default=3,
        metadata={
            "help": "times the step loop may fail and be rebuilt in-process (its requests end unavailable, "
            "the prefix cache is dropped, the model stays loaded) within loop_recovery_window_s; one "
            "failure more, or a rebuild that fails, leaves the engine NOT_SERVING for good, for its "
            "supervisor to restart (0: the first failure does)"
        },
    )
    loop_recovery_window_s: float = field(
        default=60.0, metadata={"help": "the window of loop_recoveries, in seconds"}
    )
    max_step_failures: int = field(
        default=3,
        metadata={
            "help": "engine steps that may fail in a row (a sticky device error, a repeated OOM) before the "
            "step loop is rebuilt as after a loop failure (loop_recoveries); their requests end internal, "
            "those of the step that reaches it unavailable; a step that runs resets the count"
        },
    )
    grammar_compile_timeout_s: float = field(
        default=10.0,
        metadata={
            "help": "longest a grammar's compile may run: one running longer ends its requests "
            "invalid_argument (too complex); time queued behind other compiles does not count (a queued "
            "request's wait is bounded by its deadline)"
        },
    )
    grammar_compile_threads: int = field(
        default=2, metadata={"help": "grammar compiles run at once, each on its own thread"}
    )

    def validate(self) -> None:
        """Raises ValueError naming the first bad value."""
        self.validate_tls()
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        check_choices(self, CHOICES)
        check_bounds(self, BOUNDS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if not 0.0 <= self.trace_step_sample_rate <= 1.0:
            raise ValueError("trace_step_sample_rate must be between 0 and 1")
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        """Checked whether speculation is on or not, so that a setting is never wrong in one mode only.
        `speculative` "off" is the only way to turn it off: a `speculative_disable_batch_size` of 0 is
        refused rather than read as a second off switch."""
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if not 0.0 <= self.speculative_min_acceptance <= 1.0:
            raise ValueError("speculative_min_acceptance must be between 0 and 1")
        if self.speculative != "off" and self.async_scheduling == "on":
            raise ValueError(
                "speculative decoding proposes from the host's tokens: use async_scheduling auto or off"
            )
