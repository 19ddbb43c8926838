"""Prompt-lookup proposals and the verification of drafts in the sampler, on hand-made tokens and logits."""

from __future__ import annotations

import pytest
import torch

from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.core.speculative import NgramProposer, TokenMirror
from services.engine.executor.sampler import Sampler

V = 32
CPU = torch.device("cpu")


def req(
    sampling: SamplingParams | None = None,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    stopping: StoppingParams | None = None,
) -> Request:
    r = Request(
        "r",
        prompt or [1, 2, 3],
        sampling or SamplingParams(),
        stopping or StoppingParams(),
        eos_ids=frozenset([0]),
    )
    r.token_ids.extend(output or [])
    return r


def logits(rows: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def propose(tokens: list[int], k: int = 4, lo: int = 1, hi: int = 4, max_tokens: int = 100) -> list[int]:
    """The proposal with and without a mirror, checked to agree."""
    proposer = NgramProposer(k, lo, hi)
    plain = proposer.propose(tokens, max_tokens)
    assert proposer.propose(tokens, max_tokens, TokenMirror()) == plain
    return plain


# ---- the proposer ------------------------------------------------------------------------------------


def test_the_longest_ngram_wins_over_a_later_shorter_one() -> None:
    # "7 8 9" occurs at the start (followed by 1 2); "8 9" alone occurs later (followed by 5 6).
    tokens = [7, 8, 9, 1, 2, 3, 3, 8, 9, 5, 6, 4, 4, 7, 8, 9]
    assert propose(tokens, k=2) == [1, 2]
    assert propose(tokens, k=2, hi=2) == [5, 6]  # with 2-grams at most, the latest "8 9" wins


def test_the_latest_occurrence_wins() -> None:
    tokens = [5, 6, 10, 11, 5, 6, 20, 21, 5, 6]
    assert propose(tokens, k=2) == [20, 21]


def test_the_suffix_does_not_match_itself() -> None:
    assert propose([1, 2, 3, 4]) == []
    assert propose([4, 1, 2, 3, 4], k=3) == [1, 2, 3]  # only the earlier 4 counts


def test_max_tokens_and_num_tokens_bound_the_proposal() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2]
    assert propose(tokens, k=5) == [3, 4, 5, 6, 7]
    assert propose(tokens, k=5, max_tokens=2) == [3, 4]
    assert propose(tokens, k=5, max_tokens=0) == []
    assert propose(tokens, k=5, max_tokens=-1) == []


def test_nothing_to_propose_without_a_match_of_at_least_ngram_min() -> None:
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([]) == [] and propose([1]) == []
    tokens = [1, 2, 9, 3, 2]  # only the 1-gram "2" matches
    assert propose(tokens, lo=1) == [9, 3, 2, 9]
    assert propose(tokens, lo=2) == []


def test_matches_in_the_prompt_and_in_the_output() -> None:
    prompt = [40, 41, 42, 43, 44, 45, 46]
    r = req(prompt=prompt, output=[9, 41, 42])
    assert propose(r.token_ids, k=3) == [43, 44, 45]  # copying from the prompt
    r.token_ids.extend([50, 51, 52, 53, 7, 50, 51])
    assert propose(r.token_ids, k=3) == [52, 53, 7]  # copying from the output


def test_a_proposal_continues_a_repetition_past_the_end() -> None:
    assert propose([3, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert propose([9, 9, 9], k=3) == [9, 9, 9]


def test_a_mirror_follows_a_growing_request_and_a_replaced_last_token() -> None:
    proposer = NgramProposer(3, 1, 3)
    mirror = TokenMirror()
    tokens = [1, 2, 3, 4, 5, -1]
    assert proposer.propose(tokens, 10, mirror) == []
    tokens[-1] = 2  # a placeholder replaced by its value
    assert proposer.propose(tokens, 10, mirror) == [3, 4, 5]
    for t in range(100, 300):  # grows past the mirror's first capacity
        tokens.append(t)
    tokens.extend([1, 2, 3])
    assert proposer.propose(tokens, 10, mirror) == [4, 5, 2]
    assert mirror.update(tokens).tolist() == tokens


def test_proposer_settings_are_checked() -> None:
    for bad in ((0, 1, 2), (3, 0, 2), (3, 3, 2)):
        with pytest.raises(ValueError):
            NgramProposer(*bad)


# ---- greedy verification ----------------------------------------------------------------------------


def test_greedy_all_accepted_gives_the_drafts_and_a_bonus_token() -> None:
    x = logits(4, seed=1)
    drafts = x[:3].argmax(-1).tolist()
    out = Sampler(CPU).verify(x, [req()], [drafts])
    assert out.token_ids == [[*drafts, int(x[3].argmax())]]
    assert out.logprobs == [[None] * 4]


@pytest.mark.parametrize("miss", [0, 1, 2])
def test_greedy_first_mismatch_ends_with_the_argmax_of_its_row(miss: int) -> None:
    x = logits(4, seed=2)
    drafts = x[:3].argmax(-1).tolist()
    drafts[miss] = (drafts[miss] + 1) % V
    out = Sampler(CPU).verify(x, [req()], [drafts])
    assert out.token_ids == [[*drafts[:miss], int(x[miss].argmax())]]


def test_several_requests_with_different_draft_counts_and_logprobs() -> None:
    x = logits(1 + 4 + 2 + 1, seed=3)
    best = x.argmax(-1).tolist()
    reqs = [req(), req(SamplingParams(logprobs=3)), req(SamplingParams(logprobs=2)), req()]
    # request 0: no drafts (row 0); 1: three drafts, the second wrong (rows 1-4); 2: one draft, right
    # (rows 5-6); 3: no drafts (row 7).
    drafts = [[], [best[1], (best[2] + 5) % V, best[3]], [best[5]], []]
    out = Sampler(CPU).verify(x, reqs, drafts)
    assert out.token_ids == [[best[0]], [best[1], best[2]], [best[5], best[6]], [best[7]]]
    ref = torch.log_softmax(x, -1)
    assert out.logprobs[0] == [None] and out.logprobs[3] == [None]
    for i, row0, want in ((1, 1, 3), (2, 5, 2)):
        assert len(out.logprobs[i]) == len(out.token_ids[i])
        for j, (tok, lp) in enumerate(zip(out.token_ids[i], out.logprobs[i], strict=True)):
            assert lp is not None and len(lp.top_ids) == want
            assert lp.logprob == pytest.approx(ref[row0 + j, tok].item(), abs=1e-5)
            assert lp.top_ids == ref[row0 + j].topk(want).indices.tolist()


def test_requests_without_drafts_get_what_launch_gives() -> None:
    x = logits(6, seed=4)
    stops = StoppingParams(min_new_tokens=2, stop_token_ids=(3,))
    params = [
        SamplingParams(logprobs=4),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=1, logprobs=1),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(),
        SamplingParams(temperature=1.0, presence_penalty=0.7, logprobs=2),
        SamplingParams(temperature=1.2),
    ]

    def reqs() -> list[Request]:
        return [req(p, output=[4, 4, 9] if i % 2 else [], stopping=stops) for i, p in enumerate(params)]

    want = Sampler(CPU, seed=5).launch(x, reqs()).result()
    got = Sampler(CPU, seed=5).verify(x, reqs(), [[] for _ in params])
    assert got.token_ids == [[t] for t in want.token_ids]
    assert got.logprobs == [[lp] for lp in want.logprobs]


# ---- rejection sampling -----------------------------------------------------------------------------


def target_probs(row: torch.Tensor, p: SamplingParams) -> list[float]:
    """The distribution a sampled row is drawn from, computed here from the definitions on a small
    vocabulary: temperature, then top-k, top-p (the smallest head whose mass reaches top_p), min-p."""
    probs = torch.softmax(row.double() / p.temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    keep = order[: p.top_k] if p.top_k else order
    head = [probs[t] for t in keep]
    kept = []
    mass = 0.0
    for t, q in zip(keep, head, strict=True):
        if kept and mass / sum(head) >= p.top_p:
            break
        kept.append(t)
        mass += q
    kept_probs = {t: probs[t] for t in kept}
    top = max(kept_probs.values())
    kept_probs = {t: q for t, q in kept_probs.items() if q >= p.min_p * top}
    total = sum(kept_probs.values())
    return [kept_probs.get(t, 0.0) / total for t in range(len(probs))]


def outcome_probs(rows: list[list[float]], drafts: list[int]) -> dict[tuple[int, ...], float]:
    """The law of the emitted tokens when the target model generates them one by one: the first row's
    token; if it equals the draft, the next row's; and so on."""
    law: dict[tuple[int, ...], float] = {}
    prefix_mass = 1.0
    for j, row in enumerate(rows):
        for t, q in enumerate(row):
            if j == len(drafts) or t != drafts[j]:
                law[(*drafts[:j], t)] = prefix_mass * q
        if j < len(drafts):
            prefix_mass *= row[drafts[j]]
    return law


SMALL_V = 6
N_SAMPLES = 12_000
# A chi-square statistic above this (at most 17 degrees of freedom here) has probability < 1e-6 for a
# correct sampler; the draws are seeded, so the test is deterministic. Wrong samplers give thousands.
CHI2_LIMIT = 70.0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.15),
    ],
    ids=["plain", "top_k", "top_p", "min_p"],
)
def test_rejection_sampling_emits_the_target_distribution(params: SamplingParams) -> None:
    x = torch.tensor(
        [
            [1.0, 0.6, 0.2, -0.3, 0.8, -1.0],
            [0.1, 1.2, -0.5, 0.9, 0.4, 0.0],
            [-0.2, 0.3, 1.1, 0.5, -0.7, 0.9],
        ]
    )
    drafts = [4, 3]  # each the second most likely token of its row: accepted some of the time
    rows = [target_probs(r, params) for r in x]
    law = outcome_probs(rows, drafts)
    assert sum(law.values()) == pytest.approx(1.0)
    reqs = [req(params)] * N_SAMPLES  # one unseeded request object serves every row
    out = Sampler(CPU, seed=11).verify(x.repeat(N_SAMPLES, 1), reqs, [drafts] * N_SAMPLES)
    counts: dict[tuple[int, ...], int] = {}
    for tokens in out.token_ids:
        counts[tuple(tokens)] = counts.get(tuple(tokens), 0) + 1
    impossible = {k: c for k, c in counts.items() if law.get(k, 0.0) == 0.0}
    assert not impossible, f"outcomes the target model cannot produce: {impossible}"
    chi2 = sum((counts.get(k, 0) - N_SAMPLES * q) ** 2 / (N_SAMPLES * q) for k, q in law.items() if q > 0)
    assert chi2 < CHI2_LIMIT, (chi2, counts, law)


def test_a_draft_outside_the_filtered_head_is_never_accepted() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0, -2.0, -3.0]] * 2)
    params = SamplingParams(temperature=1.0, top_k=2)
    reqs = [req(params) for _ in range(500)]
    out = Sampler(CPU, seed=12).verify(x.repeat(500, 1), reqs, [[2]] * 500)
    assert {len(t) for t in out.token_ids} == {1}
    assert {t[0] for t in out.token_ids} == {0, 1}


# ---- seeds and equivalence with decoding one token at a time ----------------------------------------


def toy_model(context: list[int]) -> torch.Tensor:
    """(V,) logits that depend on the last two tokens only, peaked enough to make outputs repeat."""
    key = 1 + 97 * context[-1] + context[-2]
    return torch.randn(V, generator=torch.Generator().manual_seed(key)) * 2.5


def decode_one_by_one(params: SamplingParams, steps: int, dev: torch.device) -> list[int]:
    r = req(params, prompt=[5, 6, 7])
    sampler = Sampler(dev, seed=21)
    for _ in range(steps):
        r.token_ids.append(sampler.sample(toy_model(r.token_ids)[None].to(dev), [r]).token_ids[0])
    return r.output_ids


def decode_with_drafts(
    params: SamplingParams, steps: int, reference: list[int], dev: torch.device
) -> list[int]:
    """Each step drafts up to 3 tokens of `reference` (the one-by-one output), some with one token
    replaced by a wrong one, and verifies them; a second seeded request without drafts rides along."""
    r = req(params, prompt=[5, 6, 7])
    other = req(SamplingParams(temperature=1.0, seed=99), prompt=[5, 6, 7])
    sampler = Sampler(dev, seed=22)
    step = 0
    while r.num_output_tokens < steps:
        done = r.num_output_tokens
        drafts = reference[done : done + min(3, steps - done - 1)]
        if drafts and step % 3:
            wrong = step % len(drafts)
            drafts[wrong] = (drafts[wrong] + 1) % V
        rows = [toy_model(r.token_ids + drafts[:j]) for j in range(len(drafts) + 1)]
        rows.append(toy_model(other.token_ids))
        out = sampler.verify(torch.stack(rows).to(dev), [r, other], [drafts, []])
        r.token_ids.extend(out.token_ids[0])
        other.token_ids.extend(out.token_ids[1])
        step += 1
    assert step < steps  # some drafts were accepted
    return r.output_ids


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.9, top_k=8, seed=7)],
    ids=["greedy", "seeded"],
)
def test_drafts_do_not_change_greedy_or_seeded_outputs(params: SamplingParams) -> None:
    """On the test device (scripts/gpu_check.sh runs it on CUDA, with CUDA generators)."""
    from tests.engine.conftest import TEST_DEVICE

    dev = torch.device(TEST_DEVICE)
    reference = decode_one_by_one(params, 40, dev)
    assert len(set(reference)) > 3
    assert decode_with_drafts(params, 40, reference, dev) == reference


def test_seeded_requests_give_the_same_tokens_for_the_same_logits_and_drafts() -> None:
    x = logits(4 + 4, seed=8)
    params = SamplingParams(temperature=1.5, seed=3)
    drafts = [x[:3].argmax(-1).tolist(), x[4:7].argmax(-1).tolist()]

    def run(sampler_seed: int) -> list[list[int]]:
        sampler = Sampler(CPU, seed=sampler_seed)
        reqs = [req(params), req(params)]
        return [tok for _ in range(5) for tok in sampler.verify(x, reqs, drafts).token_ids]

    first = run(1)
    assert first == run(2)
    assert len({tuple(t) for t in first}) > 1


def test_verify_refuses_inconsistent_inputs() -> None:
    sampler = Sampler(CPU)
    with pytest.raises(ValueError):
        sampler.verify(logits(3), [req()], [[1]])  # two rows needed
    with pytest.raises(ValueError):
        sampler.verify(logits(2), [req(), req()], [[]])
    with pytest.raises(AssertionError):
        sampler.verify(logits(2), [req(SamplingParams(presence_penalty=0.5))], [[1]])
    early = req(stopping=StoppingParams(min_new_tokens=1))
    with pytest.raises(AssertionError):
        sampler.verify(logits(2), [early], [[1]])
