"""Prompt logprobs and cached tokens: the log-probability of every prompt token after the first equals
transformers' forward (log_softmax, fp32) within 1e-4, whole or split over chunks, async or not, beside
other requests; it comes once, with the first token; such a request takes no prefix hit. cached_tokens
is the prefix hit of a request's prompt. The servicer maps all new fields both ways."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import transformers

from services.common.pb import common_pb2, engine_pb2
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams, TokenLogprob
from services.engine.core.request import Request
from services.engine.servicer import chunk_to_proto, final_to_proto, params_from_proto
from tests.engine.conftest import TEST_DEVICE, VOCAB
from tests.engine.test_model import small_engine

TOL = 1e-4


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def model(llama_dir: Path) -> transformers.PreTrainedModel:
    made = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).to(TEST_DEVICE)
    return made.eval()


def reference(model: transformers.PreTrainedModel, prompt: list[int]) -> torch.Tensor:
    """(P - 1, V) log-probabilities: row j is the distribution of prompt token j + 1."""
    with torch.inference_mode():
        logits = model(torch.tensor([prompt], device=TEST_DEVICE)).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def assert_matches(entries: list[TokenLogprob], prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert len(entries) == len(prompt) - 1
    for j, entry in enumerate(entries):
        assert abs(entry.logprob - ref[j, prompt[j + 1]].item()) < TOL, j
        assert len(entry.top_ids) == len(entry.top_logprobs) == k
        want = ref[j].topk(k).values.tolist() if k else []
        assert all(abs(a - b) < TOL for a, b in zip(entry.top_logprobs, want, strict=True)), j
        assert all(
            abs(ref[j, t].item() - v) < TOL for t, v in zip(entry.top_ids, entry.top_logprobs, strict=True)
        )


def run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling, StoppingParams(max_new_tokens=4))
    outs: dict[str, list[RequestOutput]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def sent_once(seq: list[RequestOutput]) -> list[TokenLogprob]:
    """The prompt logprobs of a request's outputs: in its first output with a token, in no other."""
    with_prompt = [o for o in seq if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0] is next(o for o in seq if o.new_token_ids)
    return with_prompt[0].prompt_logprobs or []


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=512),  # the whole prompt in one step
        dict(max_num_batched_tokens=24),  # split over several chunks, decode rows beside them
        dict(max_num_batched_tokens=24, async_scheduling="on"),
    ],
)
def test_prompt_logprobs_equal_the_forward_of_transformers(
    llama_dir: Path, model: transformers.PreTrainedModel, settings: dict[str, object]
) -> None:
    engine = small_engine(llama_dir, num_kv_blocks=64, **settings)
    long, short = prompt_of(1, 90), prompt_of(2, 17)
    outs = run(
        engine,
        {
            "plain": (prompt_of(3, 5), SamplingParams()),
            "top5": (long, SamplingParams(prompt_logprobs=5)),
            "top0": (short, SamplingParams(temperature=1.0, seed=3, prompt_logprobs=0)),
            "one": ([7], SamplingParams(prompt_logprobs=2)),
        },
    )
    assert_matches(sent_once(outs["top5"]), long, reference(model, long), 5)
    assert_matches(sent_once(outs["top0"]), short, reference(model, short), 0)
    assert sent_once(outs["one"]) == []  # a one-token prompt: nothing before its first token to predict
    assert all(o.prompt_logprobs is None for o in outs["plain"])


def test_prompt_logprobs_survive_preemption_in_the_middle_of_a_chunked_prefill(
    llama_dir: Path, model: transformers.PreTrainedModel
) -> None:
    engine = small_engine(llama_dir, num_kv_blocks=16, max_num_batched_tokens=64, max_model_len=200)
    partial: list[str] = []  # requests preempted with some, not all, of their prompt logprobs
    preempt = engine.scheduler._preempt

    def spy(req: Request) -> None:
        if 0 < len(req.prompt_logprobs) < req.num_prompt_tokens - 1:
            partial.append(req.request_id)
        preempt(req)

    engine.scheduler._preempt = spy  # type: ignore[method-assign]
    prompts = {f"p{i}": prompt_of(10 + i, 100 + 20 * i) for i in range(4)}
    outs = run(engine, {rid: (prompt, SamplingParams(prompt_logprobs=2)) for rid, prompt in prompts.items()})
    assert partial, "the pool holds 256 tokens: a request is preempted in the middle of its prefill"
    for rid, prompt in prompts.items():
        assert_matches(sent_once(outs[rid]), prompt, reference(model, prompt), 2)


def test_a_prompt_logprobs_request_takes_no_prefix_hit_and_cached_tokens_report_the_hit(
    llama_dir: Path, model: transformers.PreTrainedModel
) -> None:
    engine = small_engine(llama_dir, num_kv_blocks=64)
    prompt = prompt_of(4, 50)
    first = run(engine, {"a": (prompt, SamplingParams())})
    again = run(engine, {"b": (prompt, SamplingParams())})
    echo = run(engine, {"c": (prompt, SamplingParams(prompt_logprobs=1))})
    assert first["a"][-1].cached_tokens == 0
    assert again["b"][-1].cached_tokens == 48  # three full blocks of 16; the last token is computed
    assert echo["c"][-1].cached_tokens == 0
    assert_matches(sent_once(echo["c"]), prompt, reference(model, prompt), 1)
    tokens = [[t for o in seq for t in o.new_token_ids] for seq in (first["a"], again["b"], echo["c"])]
    assert tokens[0] == tokens[1] == tokens[2]  # greedy: the same tokens, hit or no hit


def test_the_servicer_maps_the_new_fields_both_ways() -> None:
    request = engine_pb2.GenerateRequest(
        request_id="r",
        prompt_ids=[5, 6],
        sampling=common_pb2.SamplingParams(
            structured=common_pb2.StructuredOutput(
                kind="json_schema", text='{"type": "object"}', strict=True
            ),
            logit_bias={7: 2.5, 3: -100.0},
            prompt_logprobs=0,
        ),
    )
    sampling, _ = params_from_proto(request)
    assert sampling.grammar is not None and sampling.grammar.kind == "json_schema" and sampling.grammar.strict
    assert json.loads(sampling.grammar.text) == {"type": "object"}
    assert sampling.logit_bias == ((3, -100.0), (7, 2.5))
    assert sampling.prompt_logprobs == 0  # set to 0: the logprobs without alternatives
    unset, unset_stopping = params_from_proto(engine_pb2.GenerateRequest(request_id="u", prompt_ids=[5]))
    assert unset.grammar is None and unset.logit_bias == () and unset.prompt_logprobs is None
    assert unset_stopping.max_new_tokens == 0  # the rest of the context: the engine fills it in
    bad = engine_pb2.GenerateRequest(
        request_id="b", sampling=common_pb2.SamplingParams(structured=common_pb2.StructuredOutput(kind="xml"))
    )
    with pytest.raises(ValueError, match="unknown grammar kind 'xml'"):
        params_from_proto(bad)
    out = RequestOutput(
        "r",
        [9],
        None,
        True,
        "stop",
        2,
        1,
        prompt_logprobs=[TokenLogprob(-1.5, [4], [-0.5])],
        cached_tokens=16,
    )
    chunk = chunk_to_proto(out)
    assert [(p.logprob, list(p.top_token_ids), list(p.top_logprobs)) for p in chunk.prompt_logprobs] == [
        (-1.5, [4], [-0.5])
    ]
    assert final_to_proto(out).usage.cached_tokens == 16
