"""The sampler on hand-made logits: greedy, filters, penalties, seeds, min tokens, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.executor.sampler import Sampler

V = 32


def req(
    sampling: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stopping: StoppingParams | None = None,
) -> Request:
    r = Request("r", prompt or [1, 2, 3], sampling, stopping or StoppingParams(), eos_ids=frozenset([0]))
    r.token_ids.extend(output or [])
    return r


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_pick_the_argmax() -> None:
    x = logits(5)
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=1e-4),
    ]
    out = Sampler(torch.device("cpu")).sample(x, [req(p) for p in params])
    assert out.token_ids == x.argmax(-1).tolist()


def test_top_k_and_top_p_keep_only_the_head() -> None:
    x = logits(1).repeat(200, 1)
    sampler = Sampler(torch.device("cpu"), seed=1)
    top3 = set(x[0].topk(3).indices.tolist())
    got = sampler.sample(x, [req(SamplingParams(temperature=2.0, top_k=3)) for _ in range(200)]).token_ids
    assert set(got) <= top3 and len(set(got)) > 1
    probs = torch.softmax(x[0], -1)
    order = probs.argsort(descending=True).tolist()
    cum = probs[order].cumsum(0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1])
    got = sampler.sample(x, [req(SamplingParams(temperature=1.0, top_p=0.6)) for _ in range(200)]).token_ids
    assert set(got) <= nucleus


def test_sampling_follows_the_distribution() -> None:
    x = torch.log(torch.tensor([[0.6, 0.3, 0.1] + [1e-9] * (V - 3)])).repeat(3000, 1)
    got = (
        Sampler(torch.device("cpu"), seed=2)
        .sample(x, [req(SamplingParams(temperature=1.0))] * 3000)
        .token_ids
    )
    freq = [got.count(i) / 3000 for i in range(3)]
    assert freq == pytest.approx([0.6, 0.3, 0.1], abs=0.04)


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    x = logits(4, seed=3)
    p = SamplingParams(temperature=1.0, seed=42)

    def draw(rows: list[int], steps: int = 6) -> list[list[int]]:
        reqs = [
            req(p if i == 0 else SamplingParams(temperature=1.0, seed=i if i % 2 else None)) for i in rows
        ]
        sampler = Sampler(torch.device("cpu"), seed=9)
        return [sampler.sample(x[rows], reqs).token_ids for _ in range(steps)]

    alone = [step[0] for step in draw([0])]
    crowded = [step[0] for step in draw([0, 1, 2, 3])]
    assert alone == crowded
    assert len(set(alone)) > 1


def test_penalties() -> None:
    x = torch.zeros(1, V)
    x[0, 5] = 2.0
    x[0, 6] = 1.9
    seen = req(SamplingParams(repetition_penalty=2.0), prompt=[5])
    assert Sampler(torch.device("cpu")).sample(x, [seen]).token_ids == [6]
    x[0, 6] = 1.5
    freq = req(SamplingParams(frequency_penalty=0.3), output=[5, 5])
    pres = req(SamplingParams(presence_penalty=0.3), output=[5, 5])
    got = Sampler(torch.device("cpu")).sample(x.repeat(2, 1), [freq, pres]).token_ids
    assert got == [6, 5]  # 2.0 - 2 * 0.3 < 1.5 < 2.0 - 0.3


def test_min_new_tokens_suppress_eos_and_stop_ids() -> None:
    x = torch.zeros(3, V)
    x[:, 0] = 5.0  # EOS
    x[:, 7] = 4.0  # a stop id
    early = req(SamplingParams(), stopping=StoppingParams(min_new_tokens=2, stop_token_ids=(7,)))
    ignore = req(SamplingParams(), stopping=StoppingParams(min_new_tokens=2, ignore_eos=True))
    late = req(SamplingParams(), output=[9, 9], stopping=StoppingParams(min_new_tokens=2))
    got = Sampler(torch.device("cpu")).sample(x, [early, ignore, late]).token_ids
    assert got[0] not in (0, 7) and got[1] == 0 and got[2] == 0


def test_logprobs_are_those_of_the_model() -> None:
    x = logits(2, seed=4)
    reqs = [req(SamplingParams(logprobs=3)), req(SamplingParams())]
    out = Sampler(torch.device("cpu")).sample(x, reqs)
    lp = out.logprobs[0]
    assert out.logprobs[1] is None and lp is not None
    ref = torch.log_softmax(x[0], -1)
    assert lp.logprob == pytest.approx(ref.max().item(), abs=1e-5)
    assert lp.top_ids == ref.topk(3).indices.tolist()
    assert math.fsum(math.exp(v) for v in lp.top_logprobs) < 1.0


def test_launch_keeps_the_ids_on_the_device_and_reads_the_step_back_once() -> None:
    x = logits(4, seed=5)
    params = [
        SamplingParams(logprobs=2),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(logprobs=5, temperature=0.7, seed=4),
        SamplingParams(),
    ]
    handle = Sampler(torch.device("cpu")).launch(x, [req(p) for p in params])
    out = handle.result()
    assert handle.token_ids.dtype == torch.long and handle.token_ids.tolist() == out.token_ids
    assert out.token_ids == Sampler(torch.device("cpu")).sample(x, [req(p) for p in params]).token_ids
    ref = torch.log_softmax(x, -1)
    for i, n in ((0, 2), (2, 5)):
        lp = out.logprobs[i]
        assert lp is not None and len(lp.top_ids) == n
        assert lp.top_ids == ref[i].topk(n).indices.tolist()
        assert lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[1] is None and out.logprobs[3] is None
    assert handle.result() is out


def test_launch_on_the_test_device_matches_the_cpu() -> None:
    """On CUDA (scripts/gpu_check.sh) the parameters go through pinned staging and the results come back
    through one pinned copy behind an event; the values are those of the CPU path."""
    from tests.engine.conftest import TEST_DEVICE

    dev = torch.device(TEST_DEVICE)
    x = logits(6, seed=6)
    params = [
        SamplingParams(logprobs=4),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, logprobs=1),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(),
        SamplingParams(presence_penalty=0.7, logprobs=2),
        SamplingParams(temperature=1e-4),
    ]
    stops = StoppingParams(min_new_tokens=2, stop_token_ids=(3,))

    def run(device: torch.device) -> tuple[list[int], list]:
        reqs = [req(p, output=[4, 4, 9] if i % 2 else [], stopping=stops) for i, p in enumerate(params)]
        out = Sampler(device).launch(x.to(device), reqs).result()
        return out.token_ids, out.logprobs

    want_ids, want_lps = run(torch.device("cpu"))
    got_ids, got_lps = run(dev)
    greedy_rows = [0, 2, 3, 4, 5]  # row 1 draws from a generator of its device
    assert [got_ids[i] for i in greedy_rows] == [want_ids[i] for i in greedy_rows]
    for i in (0, 4):
        assert got_lps[i].top_ids == want_lps[i].top_ids
        assert got_lps[i].top_logprobs == pytest.approx(want_lps[i].top_logprobs, abs=1e-4)
    assert got_lps[1] is not None and len(got_lps[1].top_ids) == 1


def test_a_tiny_positive_temperature_is_greedy() -> None:
    """Dividing the logits by 1e-40 would overflow them to inf (NaN probabilities, token 0): any
    temperature below GREEDY_BELOW takes the argmax, with and without a penalty in the batch."""
    x = logits(3, seed=7)
    x[:, 0] = -50.0  # token 0 is never the argmax
    params = [
        SamplingParams(temperature=1e-40),
        SamplingParams(temperature=1e-6, seed=3),
        SamplingParams(temperature=1e-40, presence_penalty=0.5),
    ]
    out = Sampler(torch.device("cpu"), seed=1).sample(x, [req(p) for p in params])
    assert out.token_ids == x.argmax(-1).tolist()


@pytest.mark.parametrize("penalty", [1e-40, 0.0, 1e6])
def test_a_repetition_penalty_outside_its_range_is_refused_by_name(penalty: float) -> None:
    with pytest.raises(ValueError, match=r"repetition_penalty must be between 0\.01 and 10"):
        SamplingParams(repetition_penalty=penalty).validate()


def test_the_penalty_bounds_pass_as_the_wire_carries_them() -> None:
    """0.01 and 10 as float32 (the protobuf's type) are inside the range."""
    for bound in (0.01, 10.0):
        SamplingParams(repetition_penalty=float(torch.tensor(bound, dtype=torch.float32))).validate()
