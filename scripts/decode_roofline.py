"""`PYTHONPATH=. python scripts/decode_roofline.py`: decode-only steps of the engine at one batch size, CUDA
graphs on and off (one run on a CPU), against the memory roofline: (weight bytes + KV bytes a step reads) ÷
the memory bandwidth, by GPU name or `--hbm-gbps` (a CPU has none). A step of batch B reads every weight
the forward multiplies by (a tied embedding whole, as the output projection; an untied input embedding
only at B rows) and B × context × layers × 2 × KV heads × head_dim KV elements. Writes `--json`
{"decode_steps", "decode_error", "ratios"}; exit status 0 when every step was measured, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from sluice.bench import engine_driver as drv
from sluice.bench.common import add_count, add_flags, error_text, positive_float, quiet_torch, run_meta
from sluice.bench.engine import model_dir, model_label, resolve
from sluice.bench.engine_driver import on_cuda, timed
from sluice.bench.report import NOT_ON_CPU, Measured, ratio, write_json
from sluice.model.presets import FIRST_PLAIN_ID, PRESET_NAMES, TINY, meta_model

# option: (with --quick, without); the context is the mean of `sluice bench engine`'s workload while it
# decodes (prompts of 16-256 tokens and half of outputs of 8-256; --quick: 16-48 and 8-24)
DEFAULTS = {"batch": (4, 64), "steps": (4, 32), "context": (40, 202)}
WARM_STEPS = 3  # decode steps run before the timed ones (first decodes, CUDA graph replay warm-up)
HBM_GBPS: tuple[tuple[str, float], ...] = (  # peak GB/s by torch.cuda.get_device_name, first match wins
    (r"H200", 4800.0),
    (r"H100.*PCIe", 2000.0),
    (r"H100", 3350.0),  # SXM (HBM3)
    (r"A100.*80\s*GB", 2039.0),
    (r"A100", 1555.0),  # 40 GB
    (r"L40S", 864.0),
    (r"\bL4\b", 300.0),
)


@dataclass(frozen=True)
class DecodeStep:
    """Decode-only steps of the engine at one batch size: their mean time and what they computed."""

    cuda_graphs: str  # "on" | "off" | NOT_ON_CPU
    batch: int
    mean_context: float  # tokens per row, the new one included, averaged over the timed steps
    steps: int  # steps timed
    step_s: float  # mean wall time of one step

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s if self.step_s > 0 else 0.0


class StepShapes:
    """An engine observer that records, per scheduled step, its batch size and whether every row decodes."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, bool]] = []

    def on_arrival(self, request: object, trace_context: object = None) -> None:
        pass

    def on_scheduled(self, sched: Any) -> None:
        decode_only = all(n == 1 and r.num_computed_tokens >= r.num_prompt_tokens for r, n in sched.scheduled)
        self.shapes.append((len(sched.scheduled), decode_only))

    def on_step_end(self, *args: object) -> None:
        pass


def measure_decode_step(
    model: Path,
    device: str,
    dtype: str,
    batch: int,
    context: int,
    steps: int,
    graphs: str = "on",
    seed: int = 0,
) -> DecodeStep:
    """Times `steps` decode-only steps of `batch` requests whose context averages `context` tokens over
    them: `batch` random prompts are prefilled, a few decode steps run untimed, then `steps` are timed
    (device synchronised at both ends). RuntimeError when a timed step was not a decode of the whole batch
    (it would not measure what it says)."""
    prompt_len = max(1, context - WARM_STEPS - steps // 2 - 1)
    # None ends during the timed steps: a request whose prefill finished in an early step of the burst
    # decodes during the later prefill steps, so it can be ahead by up to one token per prefill step.
    prefill_steps = -(-batch * prompt_len // drv.MAX_NUM_BATCHED_TOKENS)
    new_tokens = WARM_STEPS + steps + prefill_steps + 4
    # max_num_seqs = batch: CUDA graphs are captured up to the batch measured, not beyond.
    settings = drv.engine_settings(
        model, device, dtype, [prompt_len + new_tokens] * batch, max_num_seqs=batch, cuda_graphs=graphs
    )
    engine = drv.make_engine(settings)
    rng = random.Random(seed)
    produced: dict[str, list[int]] = {}
    for i in range(batch):
        prompt = [rng.randrange(FIRST_PLAIN_ID, engine.runner.vocab_size) for _ in range(prompt_len)]
        engine.add_request(f"d{i}", prompt, drv.greedy(), drv.stop_after(new_tokens))
        produced[f"d{i}"] = []
    while min(len(t) for t in produced.values()) < WARM_STEPS:
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"engine failed request {out.request_id}: {out.error}")
            produced[out.request_id].extend(out.new_token_ids)
    shapes = engine.observer = StepShapes()  # type: ignore[assignment]
    with timed(device) as elapsed:
        for _ in range(steps):
            engine.step()
    engine.observer = None
    if shapes.shapes != [(batch, True)] * steps:
        raise RuntimeError(f"timed steps were not all decodes of {batch} rows: {shapes.shapes}")
    # Context of a row in the first timed step: its prompt, its outputs so far and the new token (give or
    # take the one a step launched before may be computing).
    start = prompt_len + sum(len(t) for t in produced.values()) / batch + 1
    state = graphs if on_cuda(device) else NOT_ON_CPU
    return DecodeStep(state, batch, start + (steps - 1) / 2, steps, elapsed[0] / steps)


def hbm_gbps(device_name: str) -> float | None:
    """The bandwidth of a known GPU by its name, None for any other device."""
    return next((gbps for pattern, gbps in HBM_GBPS if re.search(pattern, device_name)), None)


def device_bandwidth(device: str, override: float | None) -> tuple[float | None, str]:
    """(GB/s, where the figure comes from): `override` when given, else the table for a CUDA device, else
    None (a CPU has no entry)."""
    if override is not None:
        return override, "--hbm-gbps"
    if not device.startswith("cuda"):
        return None, "a CPU has no entry; give --hbm-gbps"
    name = torch.cuda.get_device_name(torch.device(device))
    gbps = hbm_gbps(name)
    return gbps, (name if gbps is not None else f"{name} not in the table; give --hbm-gbps")


def weight_bytes_per_step(config: PretrainedConfig, element_size: int) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied input embedding."""
    model = meta_model(config)
    total = sum(p.numel() for p in model.parameters())
    if not config.tie_word_embeddings:
        total -= model.get_input_embeddings().weight.numel()
    return total * element_size


@dataclass(frozen=True)
class Roofline:
    """The bytes one decode step reads and, given a bandwidth, the least time it takes."""

    weight_bytes: int
    kv_bytes: int
    gbps: float | None

    @property
    def seconds(self) -> float | None:
        return None if not self.gbps else (self.weight_bytes + self.kv_bytes) / (self.gbps * 1e9)


def decode_roofline(
    config: PretrainedConfig, element_size: int, batch: int, context: float, gbps: float | None
) -> Roofline:
    """The roofline of a decode step of `batch` rows with `context` tokens each (mean, new token included)."""
    kv = round(batch * context * drv.kv_bytes_per_token(config, element_size))
    return Roofline(weight_bytes_per_step(config, element_size), kv, gbps)


@dataclass(frozen=True)
class DecodeFigure:
    """Decode-only steps as measured, and the memory roofline of the same steps."""

    step: DecodeStep
    roofline: Roofline
    bandwidth_source: str  # the GPU's name, "--hbm-gbps", or why there is no figure

    @property
    def ratio(self) -> float | None:
        """Measured step time ÷ roofline time (1 = as fast as memory allows); None without a bandwidth."""
        seconds = self.roofline.seconds
        return self.step.step_s / seconds if seconds else None

    def to_json(self) -> dict[str, Any]:
        roof = self.roofline
        return {**dataclasses.asdict(self.step), "tokens_per_s": self.step.tokens_per_s,
                "weight_bytes": roof.weight_bytes, "kv_bytes": roof.kv_bytes, "hbm_gbps": roof.gbps,
                "bandwidth_source": self.bandwidth_source, "roofline_s": roof.seconds,
                "ratio_to_roofline": self.ratio}  # fmt: skip


def graphs_ratio(figures: list[DecodeFigure], model: str, batch: int) -> Measured:
    """Decode tokens/s with CUDA graphs over eager (CUDA only: None elsewhere)."""
    speed = {f.step.cuda_graphs: f.step.tokens_per_s for f in figures}
    name = f"[{model}] decode tokens/s with CUDA graphs ÷ eager (decode-only steps, batch {batch})"
    return Measured(name, ratio(speed.get("on", speed.get(NOT_ON_CPU)), speed.get("off")))


def format_decode(figures: list[DecodeFigure], error: str | None) -> str:
    """Step time, tokens/s and the roofline, per CUDA graphs setting; the error that stopped the run."""
    lines = []
    for f in figures:
        s, roof = f.step, f.roofline
        read = f"{roof.weight_bytes / 1e9:.3g} GB weights + {roof.kv_bytes / 1e9:.3g} GB KV"
        bound = (
            f"roofline {roof.seconds * 1e3:.3f} ms ({read} at {roof.gbps:g} GB/s, {f.bandwidth_source}): "
            f"{f.ratio:.2f}× the roofline"
            if roof.seconds
            else f"roofline n/a: {read} read per step, no bandwidth: {f.bandwidth_source}"
        )
        lines.append(
            f"decode-only steps, batch {s.batch}, context ~{s.mean_context:.0f}, CUDA graphs {s.cuda_graphs}"
            f": {s.step_s * 1e3:.2f} ms a step over {s.steps} steps, {s.tokens_per_s:.1f} tok/s; {bound}"
        )
    return "\n".join(lines + ([f"decode-only steps FAILED: {error}"] if error is not None else []))


def run(args: argparse.Namespace, path: Path) -> tuple[list[DecodeFigure], str | None]:
    """The steps with CUDA graphs on (and off, on CUDA) against the roofline; the figures and the error
    that stopped the measurement, if any."""
    config = AutoConfig.from_pretrained(path)
    gbps, source = device_bandwidth(args.device, args.hbm_gbps)
    element = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
    print(f"== decode-only steps: batch {args.batch}, context ~{args.context}, {args.steps} steps")
    figures: list[DecodeFigure] = []
    for graphs in ("on", "off") if on_cuda(args.device) else ("on",):
        try:
            step = measure_decode_step(
                path, args.device, args.dtype, args.batch, args.context, args.steps, graphs, args.seed
            )
        except Exception as exc:
            return figures, error_text(exc)
        finally:
            drv.release_memory(args.device)
        roof = decode_roofline(config, element, step.batch, step.mean_context, gbps)
        figures.append(DecodeFigure(step, roof, source))
    return figures, None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scripts/decode_roofline.py", description=__doc__.split("\n")[0])
    model = parser.add_mutually_exclusive_group()
    about = "random weights in a model's shape (cached; default tiny)"
    model.add_argument("--preset", default=TINY, choices=PRESET_NAMES, help=about)
    add_flags(model, "model", model="a local Hugging Face model")
    add_count(parser, "--batch", None, "rows of every decode step (default 64)")
    add_count(parser, "--steps", None, "decode steps timed (default 32)")
    add_count(parser, "--context", None, "mean tokens per row over the timed steps (default 202)")
    about = "memory bandwidth for the roofline (default: by GPU name; none on CPU)"
    parser.add_argument("--hbm-gbps", type=positive_float, metavar="GB/s", help=about)
    add_flags(parser, "seed", "device", "dtype", "json", "threads", "quick", "no-progress")
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        resolve(args, DEFAULTS, real_model=args.model is not None or args.preset != TINY)
    except ValueError as exc:
        parser.error(str(exc))
    quiet_torch(args.threads)
    meta = {**run_meta([], args.device), "command": shlex.join([parser.prog, *argv])}
    label = model_label(args)
    with tempfile.TemporaryDirectory(prefix="sluice-decode-") as tmp:
        figures, error = run(args, model_dir(args, Path(tmp)))
    ratios = [graphs_ratio(figures, label, args.batch)]
    print(f"\n{format_decode(figures, error)}\nratios:\n" + "\n".join(r.line() for r in ratios))
    steps = [f.to_json() for f in figures]
    doc = {**meta, "bench": "decode", "model": label, "dtype": args.dtype, "decode_steps": steps,
           "decode_error": error, "ratios": ratios}  # fmt: skip
    write_json(args.json, doc, announce=True)
    return 0 if error is None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
