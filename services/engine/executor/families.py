"""Which model families the engine serves, with which of their features, and which it refuses and
why: `sluice models`, and the table in the README (a test keeps the two equal).

`FAMILIES` lists the families people serve today, each with its transformers `model_type`, a Hub id of
a released model, and the special parts of its architecture. Whether a family is served is not written
here: `verdict` builds the family's default configuration (no weights) and asks the engine's own check
(`capabilities.check_config`, which the runner applies before it loads weights), so the table says
what the code does. (The runner's start-up probe of the attention calls, after the load, can refuse
more; a family's shipped configuration may switch on parts its default does not.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import transformers


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str
    example: str  # a Hub id of a released model of the family
    features: str  # the special parts of its architecture, in words


FAMILIES: tuple[Family, ...] = (
    Family("Llama 3", "llama", "meta-llama/Llama-3.2-1B-Instruct", "GQA, llama3 RoPE, tied embeddings"),
    Family("Mistral", "mistral", "mistralai/Mistral-7B-Instruct-v0.3", "GQA, sliding window (v0.1)"),
    Family("Qwen2.5", "qwen2", "Qwen/Qwen2.5-0.5B-Instruct", "GQA, QKV bias, tied embeddings"),
    Family("Qwen3", "qwen3", "Qwen/Qwen3-0.6B", "GQA, per-head Q/K norm, head_dim apart from hidden size"),
    Family("Qwen3-MoE", "qwen3_moe", "Qwen/Qwen3-30B-A3B", "mixture of experts, per-head Q/K norm"),
    Family(
        "Gemma 2", "gemma2", "google/gemma-2-2b-it",
        "alternating local/global layers, attention and final logit soft-capping, query_pre_attn_scalar",
    ),
    Family(
        "Gemma 3", "gemma3_text", "google/gemma-3-1b-it",
        "sliding windows on 5 of 6 layers, per-head Q/K norm, query_pre_attn_scalar, two RoPE bases",
    ),
    Family(
        "Phi-3", "phi3", "microsoft/Phi-3-mini-4k-instruct",
        "longrope (128k variants: the long factor past 4k), fused QKV",
    ),
    Family("OLMo 2", "olmo2", "allenai/OLMo-2-0425-1B-Instruct", "Q/K norm over all heads, post-norm"),
    Family(
        "Granite", "granite", "ibm-granite/granite-3.3-2b-instruct",
        "embedding, attention, residual and logit multipliers",
    ),
    Family("Mixtral", "mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1", "mixture of experts, GQA"),
    Family(
        "GPT-OSS", "gpt_oss", "openai/gpt-oss-20b",
        "mixture of experts, attention sinks, alternating sliding windows, yarn RoPE",
    ),
    Family("SmolLM3", "smollm3", "HuggingFaceTB/SmolLM3-3B", "layers without RoPE (every 4th), GQA"),
    Family(
        "Cohere 2", "cohere2", "CohereLabs/c4ai-command-r7b-12-2024",
        "sliding windows, global layers without RoPE, logit scale",
    ),
    Family("Starcoder2", "starcoder2", "bigcode/starcoder2-3b", "sliding window, biases, GQA"),
    Family("DeepSeek-V3", "deepseek_v3", "deepseek-ai/DeepSeek-V3", "multi-head latent attention (MLA), MoE"),
    Family("Qwen3-Next", "qwen3_next", "Qwen/Qwen3-Next-80B-A3B-Instruct", "hybrid linear attention, MoE"),
)  # fmt: skip


@dataclass(frozen=True)
class Verdict:
    family: Family
    served: bool
    reason: str  # why it is refused ("" when served)


def check_config(config: transformers.PretrainedConfig) -> None:
    """The engine's start-up check of a model's configuration, before any weight is read (the one the
    runner applies): raises ValueError saying what it cannot serve."""
    from services.engine.executor.capabilities import check_config as engine_check

    engine_check(config)


def verdict(family: Family) -> Verdict:
    """Whether the engine serves `family`: its default configuration through `check_config`."""
    config = transformers.AutoConfig.for_model(family.model_type)
    try:
        check_config(config)
    except ValueError as exc:
        return Verdict(family, False, str(exc))
    return Verdict(family, True, "")


def verdicts() -> list[Verdict]:
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # default configs warn about their token ids
    try:
        return [verdict(f) for f in FAMILIES]
    finally:
        transformers.logging.set_verbosity(level)


def markdown_table(rows: Sequence[Verdict]) -> str:
    """The README's table of families (one line per family, ending in a newline)."""
    lines = [
        "| family | `model_type` | served | its special parts | why refused |",
        "|---|---|---|---|---|",
    ]
    for v in rows:
        f = v.family
        reason = v.reason.replace("|", "\\|")
        lines.append(
            f"| {f.name} | `{f.model_type}` | {'yes' if v.served else 'no'} | {f.features} | {reason} |"
        )
    return "\n".join(lines) + "\n"


def text_table(rows: Sequence[Verdict]) -> str:
    """`sluice models`' plain listing: served families first, then refused ones with the reason."""
    out: list[str] = []
    for served in (True, False):
        group = [v for v in rows if v.served == served]
        if not group:
            continue
        out.append("served:" if served else "refused:")
        for v in group:
            f = v.family
            out.append(f"  {f.name:<12} {f.model_type:<12} e.g. {f.example}")
            out.append(f"  {'':<12} features: {f.features}")
            if not served:
                out.append(f"  {'':<12} why: {v.reason}")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sluice models", description="which model families the engine serves, and why not the others"
    )
    parser.add_argument("--markdown", action="store_true", help="print the README's table")
    args = parser.parse_args(argv)
    rows = verdicts()
    sys.stdout.write(markdown_table(rows) if args.markdown else text_table(rows))
    return 0
