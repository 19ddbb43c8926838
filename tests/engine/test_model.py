"""The engine on real (tiny, random) models: greedy output equals per-request `model.generate` token for
token under chunked prefill, preemption and prefix-cache hits; seeded sampling is reproducible whatever
else is in the batch; the three batching policies agree."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import transformers

from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.settings import EngineSettings
from tests.engine.conftest import TEST_DEVICE, VOCAB, make_model_dir

Workload = list[tuple[int, list[int], int]]  # (arrival step, prompt, max_new_tokens)


def workload(seed: int, n: int = 32) -> Workload:
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    items: Workload = []
    for i in range(n):
        if i % 4 == 0:  # a shared system prompt: prefix-cache hits
            prompt = shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))]
        else:
            prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 70))]
        items.append((rng.randint(0, 12), prompt, rng.randint(2, 12)))
    return items


def run_engine(
    engine: LLMEngine, items: Workload, sampling: SamplingParams | None = None
) -> dict[str, list[int]]:
    """Feeds requests at their arrival steps and steps until idle; returns generated ids by request."""
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    pending = sorted(enumerate(items), key=lambda x: x[1][0])
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt, n) = pending.pop(0)
            engine.add_request(str(i), prompt, sampling or SamplingParams(), StoppingParams(max_new_tokens=n))
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        step += 1
    for bm in [engine.block_manager, *engine.group_block_managers]:  # every KV group's pool whole again
        assert bm.num_free_blocks == bm.num_blocks
    for rid, seq in outs.items():
        assert sum(o.finished for o in seq) == 1 and seq[-1].finished, rid
    return {rid: [t for o in seq for t in o.new_token_ids] for rid, seq in outs.items()}


def reference(model_dir: Path, items: Workload) -> dict[str, list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).to(TEST_DEVICE)
    model.eval()
    out = {}
    with torch.inference_mode():
        for i, (_, prompt, n) in enumerate(items):
            ids = model.generate(
                torch.tensor([prompt], device=TEST_DEVICE), max_new_tokens=n, do_sample=False
            )
            out[str(i)] = ids[0, len(prompt) :].tolist()
    return out


def small_engine(model_dir: Path, **kw: object) -> LLMEngine:
    settings = dict(
        model=str(model_dir),
        device=TEST_DEVICE,
        dtype="float32",
        max_num_batched_tokens=64,
        num_kv_blocks=24,
        max_num_seqs=16,
        max_model_len=256,  # the pool of 24 blocks holds 384 tokens, less than the model's 512
    )
    settings.update(kw)
    return LLMEngine(EngineSettings(**settings))  # type: ignore[arg-type]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_matches_generate(family: str, llama_dir: Path, qwen2_dir: Path) -> None:
    model_dir = llama_dir if family == "llama" else qwen2_dir
    items = workload(seed=11)
    engine = small_engine(model_dir)
    got = run_engine(engine, items)
    assert got == reference(model_dir, items)
    st = engine.stats()
    assert st.num_preemptions > 0, "the pool is too small for all: preemption must happen"
    assert st.prefix_hit_rate > 0, "shared prompts must hit the prefix cache"
    assert any(len(p) > 64 for _, p, _ in items), "some prompts are chunked"


@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_policies_match_continuous(policy: str, llama_dir: Path) -> None:
    items = workload(seed=5, n=12)
    base = run_engine(small_engine(llama_dir, num_kv_blocks=64), items)
    got = run_engine(small_engine(llama_dir, num_kv_blocks=64, batching=policy, static_batch_size=4), items)
    assert got == base


def test_seeded_sampling_is_independent_of_the_batch(llama_dir: Path) -> None:
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    prompt = list(range(10, 40))
    alone = small_engine(llama_dir, num_kv_blocks=64)
    alone.add_request("x", prompt, sampling, StoppingParams(max_new_tokens=12, ignore_eos=True))
    outs: list[int] = []
    while alone.has_unfinished_requests():
        outs += [t for o in alone.step() for t in o.new_token_ids]
    crowded = small_engine(llama_dir, num_kv_blocks=64, max_num_batched_tokens=32)
    rng = random.Random(3)
    for i in range(6):
        other = SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams(temperature=0.7)
        crowded.add_request(f"o{i}", [rng.randrange(3, VOCAB) for _ in range(20)], other, StoppingParams(8))
    crowded.step()
    crowded.add_request("x", prompt, sampling, StoppingParams(max_new_tokens=12, ignore_eos=True))
    got: list[int] = []
    while crowded.has_unfinished_requests():
        got += [t for o in crowded.step() if o.request_id == "x" for t in o.new_token_ids]
    assert got == outs and len(got) == 12
    # A different seed gives a different sequence (with overwhelming probability).
    other_seed = small_engine(llama_dir, num_kv_blocks=64)
    other_seed.add_request(
        "x",
        prompt,
        SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=8),
        StoppingParams(max_new_tokens=12, ignore_eos=True),
    )
    diff: list[int] = []
    while other_seed.has_unfinished_requests():
        diff += [t for o in other_seed.step() for t in o.new_token_ids]
    assert diff != outs


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("mistral", {"sliding_window": 8}),  # every layer windowed
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),  # layer 1 only
    ],
)
def test_sliding_window_matches_generate(family: str, overrides: dict[str, object], tmp_path: Path) -> None:
    model_dir = make_model_dir(tmp_path / family, family, **overrides)
    items = workload(seed=2, n=8)
    engine = small_engine(model_dir, num_kv_blocks=64, max_num_batched_tokens=24)
    assert run_engine(engine, items) == reference(model_dir, items)


def test_logprobs(llama_dir: Path) -> None:
    engine = small_engine(llama_dir)
    engine.add_request("a", [5, 6, 7], SamplingParams(logprobs=5), StoppingParams(max_new_tokens=3))
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    lps = [lp for o in outs for lp in (o.logprobs or [])]
    assert len(lps) == 3
    for o, lp in zip([o for o in outs if o.new_token_ids], lps, strict=True):
        assert len(lp.top_ids) == 5 and lp.top_ids[0] == o.new_token_ids[0]
        assert lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) and lp.top_logprobs[0] <= 0
