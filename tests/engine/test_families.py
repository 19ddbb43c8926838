"""Every dense decoder family the engine serves, on a random-weight model of it with its special parts
on (sluice/model/families.py): greedy output through `LLMEngine` equals transformers' `generate` token
for token, with prefix-cache hits, chunked prefill, preemption and (for windowed families) blocks
freed as they slide out of the window (a hybrid family's sliding layers in a KV group of their own);
the same on the Triton kernel (under the interpreter on a CPU) for every family. Families that cannot
be served are refused at start-up with a message naming what is missing."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import transformers

from services.engine.core.engine import LLMEngine
from services.engine.executor.capabilities import check_config
from services.engine.executor.kernels import cpu_kernels
from services.engine.settings import EngineSettings
from sluice.model.families import FAMILIES, FAMILY_NAMES
from tests.conftest import FAMILY_VOCAB
from tests.engine.conftest import TEST_DEVICE
from tests.engine.test_model import Workload, reference, run_engine, small_engine

FamilyDir = Callable[[str], Path]


def family_workload(seed: int, n: int = 8) -> Workload:
    """Prompts past the window and the step's token budget, a shared prefix (cache hits), short ones."""
    rng = random.Random(seed)
    shared = [rng.randrange(5, FAMILY_VOCAB) for _ in range(36)]
    items: Workload = []
    for i in range(n):
        if i % 3 == 0:
            prompt = shared + [rng.randrange(5, FAMILY_VOCAB) for _ in range(rng.randint(1, 8))]
        else:
            prompt = [rng.randrange(5, FAMILY_VOCAB) for _ in range(rng.randint(2, 60))]
        items.append((rng.randint(0, 6), prompt, rng.randint(4, 10)))
    return items


def family_engine(model_dir: Path, **kw: object) -> LLMEngine:
    """A pool of 12 blocks of 8 tokens (preemption), 24 tokens a step (chunked prefill)."""
    settings: dict[str, object] = dict(
        num_kv_blocks=12, block_size=8, max_num_batched_tokens=24, max_model_len=96
    )
    settings.update(kw)
    return small_engine(model_dir, **settings)


# What each family must show its attention calls, so that a family whose special parts did not reach
# the paged attention fails here rather than passing on plain attention.
EXPECTED = {
    "gemma2": lambda a: a.windows == (8, 0) and a.softcaps == (2.0, 2.0) and a.head_dim == 32,
    "gemma3_text": lambda a: a.windows == (8, 0) and a.head_dim == 32,
    "cohere2": lambda a: a.windows == (8, 0),
    "qwen3": lambda a: a.num_kv_heads == 1 and a.head_dim == 32,
    "mistral": lambda a: a.all_sliding_window == 8,
    "qwen2": lambda a: a.all_sliding_window == 8,
    "phi3": lambda a: a.all_sliding_window == 8,
    "starcoder2": lambda a: a.all_sliding_window == 8,
}


@pytest.mark.parametrize("cpu_linear", ["torch", "auto"], ids=["torch-gemm", "onednn"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_greedy_matches_generate(family: str, cpu_linear: str, family_model_dir: FamilyDir) -> None:
    model_dir = family_model_dir(family)
    items = family_workload(seed=3)
    engine = family_engine(model_dir, cpu_linear=cpu_linear)
    packed = engine.runner.packed_linears  # type: ignore[attr-defined]
    assert (packed > 0) == (cpu_linear == "auto" and engine.runner.device.type == "cpu")  # type: ignore[attr-defined]
    spec = engine.runner.attention  # type: ignore[attr-defined]
    assert EXPECTED.get(family, lambda a: True)(spec), spec
    slid = _count_slides(engine)
    got = run_engine(engine, items)
    want = reference(model_dir, items)
    assert got == want
    stats = engine.stats()
    assert stats.num_preemptions > 0, "the pool is too small for all: preemption must happen"
    assert stats.prefix_hit_rate > 0, "shared prompts must hit the prefix cache"
    assert any(len(p) > 24 for _, p, _ in items), "some prompts are chunked"
    if any(spec.windows):
        assert slid, "blocks that slid out of a window are freed while their request runs"
    else:
        assert not slid


def _count_slides(engine: LLMEngine) -> list[int]:
    """Records, at every step, how many blocks the running requests have freed as they slid."""
    counts: list[int] = []
    original = engine.scheduler._free_slid_out

    def spy(req):  # type: ignore[no-untyped-def]
        before = sum(req.slid_blocks)
        original(req)
        if sum(req.slid_blocks) > before:
            counts.append(sum(req.slid_blocks) - before)

    engine.scheduler._free_slid_out = spy  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("family", FAMILIES)
def test_triton_kernel_matches_generate(family: str, family_model_dir: FamilyDir) -> None:
    """Every family's rows through the Triton kernel (interpreted on a CPU): its head sizes, GQA or MQA,
    scaling, windows (alternating with full layers, or on every layer with blocks freed) and soft-caps.
    RoPE is applied before the kernel, so the RoPE variants of llama add nothing here."""
    model_dir = family_model_dir(family)
    items = family_workload(seed=5, n=4)
    engine = family_engine(model_dir, attention_backend="triton", num_kv_blocks=10, max_model_len=80)
    assert engine.runner.backend == "triton"  # type: ignore[attr-defined]
    slid = _count_slides(engine)
    assert run_engine(engine, items) == reference(model_dir, items)
    if any(engine.runner.attention.windows):  # type: ignore[attr-defined]
        assert slid, "blocks that slid out of a window are freed while their request runs"
    if not engine.runner.attention.all_sliding_window:  # type: ignore[attr-defined]
        assert engine.stats().num_preemptions > 0


@pytest.mark.parametrize(
    ("family", "backend"), [("gemma3_text", "torch"), ("cohere2", "torch"), ("gemma2", "triton")]
)
def test_a_hybrid_familys_sliding_layers_get_a_bounded_pool(
    family: str, backend: str, family_model_dir: FamilyDir
) -> None:
    """Two requests at a time: the sliding layers' pool holds 2 × (ceil(7 / 8) + 2) + ceil(24 / 8) = 9
    blocks beside the full layers' 16 (each group with its own block tables), and greedy output still
    equals generate, prefix hits included, with every block of both pools back at the end."""
    model_dir = family_model_dir(family)
    twice = [random.Random(9).randrange(5, FAMILY_VOCAB) for _ in range(20)]  # a hit on a held window
    items = [(0, twice, 4), (1, twice, 4), *family_workload(seed=9, n=5)]
    engine = family_engine(model_dir, num_kv_blocks=16, max_num_seqs=2, attention_backend=backend)
    runner = engine.runner
    groups = runner.kv_groups  # type: ignore[attr-defined]
    assert [(g.window, g.num_blocks) for g in groups] == [(0, 16), (8, 9)]
    assert runner.kv[groups[1].layers[0]][0].shape[0] == (9 + 1) * 8  # type: ignore[attr-defined]
    assert run_engine(engine, items) == reference(model_dir, items)
    assert engine.stats().prefix_hit_rate > 0


def _config(model_type: str, **kw: object) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model(model_type, **kw)


@pytest.mark.parametrize(
    ("model_type", "named"),
    [
        ("bart", "encoder-decoder"),
        ("t5", "encoder-decoder"),
        ("deepseek_v3", "multi-head latent attention"),
        ("qwen3_next", "linear_attention"),
        ("granitemoehybrid", "linear_attention"),
        ("llama4_text", "chunked_attention"),
        ("mamba", "layers of type linear_attention"),
        ("falcon_h1", "layers of type hybrid"),
        ("gemma3n_text", "reuse another layer's KV"),
    ],
)
def test_refused_families_name_what_is_missing(model_type: str, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        check_config(_config(model_type))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "gemma2", "phi3", "starcoder2"])
def test_attention_interface_families_pass_the_config_check(model_type: str) -> None:
    check_config(_config(model_type))


def test_a_refused_model_stops_the_engine_at_start_up(tmp_path: Path) -> None:
    config = transformers.AutoConfig.for_model(
        "deepseek_v3", hidden_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64
    )
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="DeepSeek-style MLA"):
        LLMEngine(EngineSettings(model=str(tmp_path)))


def test_an_attention_keyword_not_honoured_is_refused_by_name(
    family_model_dir: FamilyDir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model whose attention call passes a keyword the paged attention does not honour stops at
    start-up with the keyword's name (here a llama whose layers ask for non-causal attention)."""
    from transformers.models.llama import modeling_llama

    forward = modeling_llama.LlamaAttention.forward

    def non_causal(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        return forward(self, *args, is_causal=False, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", non_causal)
    with pytest.raises(ValueError, match="is_causal=False"):
        family_engine(family_model_dir("llama"))


def test_dynamic_rope_caps_the_context(family_model_dir: FamilyDir) -> None:
    """dynamic changes its frequencies with the longest position of every forward, which no fixed choice
    matches: a context past where it does not is refused by name, before any weight is read."""
    with pytest.raises(ValueError, match="'dynamic' changes its frequencies"):
        family_engine(family_model_dir("llama-dynamic"), max_model_len=1100, num_kv_blocks=140)


def test_longrope_up_to_the_original_keeps_the_short_factor(
    family_model_dir: FamilyDir, caplog: pytest.LogCaptureFixture
) -> None:
    """longrope served at most original_max_position_embeddings (512) tokens: the context is capped
    there and the short factor stays (greedy == generate: test_greedy_matches_generate[llama-longrope])."""
    caplog.set_level(logging.INFO)
    engine = family_engine(family_model_dir("llama-longrope"), max_model_len=512, num_kv_blocks=80)
    assert engine.max_model_len == 512
    assert "context length capped at 512: RoPE scaling 'longrope'" in caplog.text
    assert "long factor" not in caplog.text


def test_longrope_past_the_original_uses_the_long_factor_everywhere(
    family_model_dir: FamilyDir, caplog: pytest.LogCaptureFixture
) -> None:
    """longrope served past original_max_position_embeddings (512; the context is the config's 1024):
    the long factor at every position, logged at start-up. Prompts past 512 tokens, for which generate
    uses the long factor throughout, give generate's greedy output although their first prefill chunks
    (64 tokens a step) end below 512, where transformers would pick the short factor; a short prompt
    packed with them gives what it gives alone (one request's length changes no other's frequencies)."""
    caplog.set_level(logging.INFO)
    model_dir = family_model_dir("llama-longrope")
    rng = random.Random(7)
    long_items: Workload = [
        (step, [rng.randrange(5, FAMILY_VOCAB) for _ in range(n)], 4) for step, n in ((0, 530), (2, 560))
    ]
    settings = dict(max_model_len=0, num_kv_blocks=160, max_num_batched_tokens=64, max_num_seqs=4)
    engine = family_engine(model_dir, **settings)
    assert engine.max_model_len == 1024
    chosen = "longrope: the long factor for every position, since max_model_len 1024 > original 512"
    assert chosen in caplog.text
    short: Workload = [(1, [rng.randrange(5, FAMILY_VOCAB) for _ in range(20)], 4)]
    got = run_engine(engine, long_items + short)
    assert {k: got[k] for k in ("0", "1")} == reference(model_dir, long_items)
    alone = run_engine(family_engine(model_dir, **settings), [(0, short[0][1], 4)])
    assert got["2"] == alone["0"]


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-OSS (attention sinks on every layer, a window alternating with full layers, YaRN),
    its experts run by transformers' own code: the carrier of sinks through the engine."""
    from sluice.model import tiny
    from sluice.model.families import spread_weights

    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512, "rope_theta": 1e4}
    fields = {
        **tiny.common_fields(),
        **tiny.PRESETS["test"],
        "vocab_size": FAMILY_VOCAB,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": False,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {**rope, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
    }
    config = transformers.AutoConfig.for_model("gpt_oss", **tiny.special_ids(), **fields)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    spread_weights(model, 0)
    return tiny.write_model_dir(tmp_path_factory.mktemp("gpt_oss") / "model", model, {"family": "gpt_oss"})


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_sinks_match_generate(backend: str, gpt_oss_dir: Path) -> None:
    if backend == "cpu" and (TEST_DEVICE != "cpu" or cpu_kernels.load() is None):
        pytest.skip("the CPU paged kernel does not run here")
    items = family_workload(seed=7, n=6 if backend == "torch" else 4)
    engine = family_engine(gpt_oss_dir, attention_backend=backend)
    spec = engine.runner.attention  # type: ignore[attr-defined]
    assert spec.sinks == (True, True) and spec.windows == (8, 0)
    assert run_engine(engine, items) == reference(gpt_oss_dir, items)
