"""Mixture-of-experts families through the whole pipeline (`sluice up`, four processes): a random-weight
Mixtral, Qwen3-MoE and GPT-OSS (sluice/model/moe.py) stream the same greedy text as transformers'
`generate` decoded, with a pool and a step budget small enough that prompts are chunked, and usually share
cached blocks and are preempted (asserted on a fixed schedule in tests/engine/test_moe.py); the engine's
/metrics counts the tokens routed to each expert of each layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.model.moe import make_moe_model
from sluice.ports import free_port_run
from tests.e2e.conftest import start_pipeline
from tests.e2e.test_families import assert_equals_generate, stream_prompts
from tests.observability.processes import scrape

pytestmark = pytest.mark.e2e

# 16 blocks of 8 tokens for four requests of about 50-90 tokens each: preemption; 16 tokens a step:
# chunked prefill.
ENGINE_ENV = {
    "SLUICE_NUM_KV_BLOCKS": "16",
    "SLUICE_BLOCK_SIZE": "8",
    "SLUICE_MAX_NUM_BATCHED_TOKENS": "16",
    "SLUICE_MAX_MODEL_LEN": "128",
}
EXPERT_TOKENS = "sluice_moe_expert_tokens_total"


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_streamed_greedy_text_equals_generate(family: str, tmp_path: Path) -> None:
    model_dir = make_moe_model(tmp_path / family, family)
    metrics_base = free_port_run(3)  # tokenizer, engine, detokenizer
    pipeline = start_pipeline(
        model_dir, "--standby", "0", "--metrics-base-port", str(metrics_base), env=ENGINE_ENV
    )
    try:
        got = stream_prompts(pipeline.ws_url)
        samples = scrape(f"http://127.0.0.1:{metrics_base + 1}/metrics")
    finally:
        code = pipeline.stop()
    assert code == 0, pipeline.output()
    assert_equals_generate(model_dir, family, got)
    per_layer = [
        sum(samples[f'{EXPERT_TOKENS}{{expert="{e}",layer="{layer}"}}'] for e in range(8)) for layer in (0, 1)
    ]
    # Every token computed goes through both layers, to 2 experts in each.
    assert per_layer[0] == per_layer[1] > 0 and per_layer[0] % 2 == 0, per_layer
    assert samples["sluice_moe_expert_load_ratio_count"] > 0
    # Preemption and prefix hits depend here on when the four requests reach the engine (a request that
    # finishes before the last one arrives frees its blocks): tests/engine/test_moe.py asserts both on a
    # fixed schedule; the text above must be exact whether or not they happened in this run.
