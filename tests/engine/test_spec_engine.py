"""Speculative decoding in the engine: drafts computed with a request's last token and verified in the same
step. Invariants first: greedy output with speculation equals greedy output without, token for token,
whatever the drafts, under chunked prefill, preemption and prefix hits (fake model: the next token is a
hash of the tokens so far; tiny real models: equal to `generate`); the pool returns to full; registered
block hashes cover verified tokens only; the stop rules end a request exactly where they do without
speculation. Then the gates, the figures and metrics, and sampling."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from services.common.block_keys import chain_hashes
from services.common.metrics import EngineMetrics
from services.engine.core.async_engine import AsyncEngine
from services.engine.core.block_manager import BlockManager
from services.engine.core.engine import LLMEngine
from services.engine.core.params import RequestOutput, SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.core.scheduler import Scheduler, SchedulerOutput
from services.engine.core.speculative import SPEC_COOLDOWN, SPEC_GATE_WINDOW, SpecState, Speculator
from services.engine.observability import EngineObserver
from services.engine.settings import EngineSettings
from tests.engine.conftest import VOCAB, make_model_dir
from tests.engine.fakes import FAKE_VOCAB, FakeRunner, expected_output, fake_engine, next_token
from tests.engine.test_model import reference, run_engine, small_engine, workload

GREEDY = SamplingParams()
SPEC = dict(speculative="ngram", speculative_disable_batch_size=64, speculative_min_acceptance=0.0)


class OracleProposer:
    """Proposes the fake model's own continuation, except that the draft at offset j of a proposal for
    a request of n tokens is wrong where `wrong(n, j)`. Records every proposal: (the request's length,
    the drafts, how many of its leading drafts are right: what verification must accept)."""

    def __init__(self, k: int = 4, wrong: Callable[[int, int], bool] = lambda n, j: False) -> None:
        self.k = k
        self.wrong = wrong
        self.proposals: list[tuple[int, list[int], int]] = []

    def propose(self, token_ids: Sequence[int], max_tokens: int, mirror: object = None) -> list[int]:
        toks = list(token_ids)
        drafts: list[int] = []
        right = -1
        for j in range(min(self.k, max_tokens)):
            t = next_token(toks)
            if self.wrong(len(token_ids), j):
                t = 3 + (t - 3 + 1) % (FAKE_VOCAB - 3)  # another token, never EOS
                right = j if right < 0 else right
            drafts.append(t)
            toks.append(t)
        self.proposals.append((len(token_ids), drafts, len(drafts) if right < 0 else right))
        return drafts


def mixed(n: int, j: int) -> bool:
    return (n * 7 + j * 3) % 5 == 0


def spec_engine(
    proposer: OracleProposer, num_blocks: int = 64, **settings: object
) -> tuple[LLMEngine, FakeRunner]:
    engine, runner = fake_engine(num_blocks, **{**SPEC, **settings})
    assert engine.speculator is not None
    engine.speculator.proposer = proposer
    return engine, runner


def check_invariants(engine: LLMEngine) -> None:
    """After a step: no drafts left over, counters behind the tokens, no block kept for rejected drafts,
    registered hashes equal to the hashes of the request's own tokens, reference counts exact."""
    bm = engine.block_manager
    bs = bm.block_size
    held: Counter[int] = Counter()
    for req in engine.scheduler.running:
        assert not req.draft_ids
        assert req.num_computed_tokens < req.num_tokens
        assert -(-req.num_computed_tokens // bs) <= len(req.block_ids) <= -(-req.num_tokens // bs)
        n = req.num_registered_blocks
        assert req.block_hashes[:n] == chain_hashes(req.token_ids[: n * bs], bs, 0, None)
        for i in range(n):
            assert bm.block_hash[req.block_ids[i]] in (None, req.block_hashes[i])
        held.update(req.block_ids)
    assert all(bm.ref_counts[b] == c for b, c in held.items())
    assert bm.num_free_blocks == bm.num_blocks - len(held)
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h


def run(
    engine: LLMEngine, arrivals: Sequence[tuple[int, str, list[int], StoppingParams]] = ()
) -> dict[str, list[RequestOutput]]:
    """Adds requests at their arrival steps, steps until idle checking the invariants after every step,
    and returns the outputs by request; the pool is full at the end."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outs: dict[str, list[RequestOutput]] = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, prompt, stopping = pending.pop(0)
            engine.add_request(rid, prompt, GREEDY, stopping)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
        check_invariants(engine)
        step += 1
        assert step < 10_000
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    for rid, seq in outs.items():
        assert sum(o.finished for o in seq) == 1 and seq[-1].finished, rid
    return outs


def ids(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def fake_workload(seed: int, n: int = 24) -> list[tuple[int, str, list[int], StoppingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, FAKE_VOCAB) for _ in range(20)]
    items = []
    for i in range(n):
        if i % 3 == 0:  # a shared prefix: prefix-cache hits
            prompt = shared + [rng.randrange(3, FAKE_VOCAB) for _ in range(rng.randint(1, 6))]
        else:
            prompt = [rng.randrange(3, FAKE_VOCAB) for _ in range(rng.randint(1, 40))]
        items.append((rng.randint(0, 10), str(i), prompt, StoppingParams(max_new_tokens=rng.randint(1, 30))))
    return items


# ---- invariants on the fake model -----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["right", "mixed", "wrong"])
def test_greedy_equals_without_speculation_under_preemption_and_prefix_hits(kind: str) -> None:
    wrong = {"right": lambda n, j: False, "mixed": mixed, "wrong": lambda n, j: True}[kind]
    proposer = OracleProposer(k=4, wrong=wrong)
    engine, _ = spec_engine(proposer, num_blocks=24, block_size=4, max_num_batched_tokens=24)
    items = fake_workload(seed=3)
    outs = run(engine, items)
    for _, rid, prompt, stopping in items:
        assert ids(outs[rid]) == expected_output(prompt, stopping.max_new_tokens), rid
    st = engine.stats()
    assert st.num_preemptions > 0 and st.prefix_hit_rate > 0
    assert any(len(p) > 24 for _, _, p, _ in items), "some prompts are chunked"
    assert st.spec_proposed_tokens > 0
    assert (st.spec_accepted_tokens > 0) == (kind != "wrong")
    assert st.generated_tokens == sum(len(ids(o)) for o in outs.values())
    assert any(len(o.new_token_ids) > 1 for seq in outs.values() for o in seq) == (kind != "wrong")


def test_stop_token_inside_an_accepted_run_ends_there() -> None:
    prompt = [5, 9, 11, 7]
    full = expected_output(prompt, 40)
    # Drafts start after the first token: runs of 5 tokens (4 accepted + 1) emit outputs 1-5, 6-10, ...
    # A stop token at an output whose run continues past it, not seen before it.
    m = next(i for i in range(1, 40) if (i - 1) % 5 < 4 and full[i] not in full[:i])
    stopping = StoppingParams(max_new_tokens=40, stop_token_ids=[full[m]])
    base = run(fake_engine(64)[0], [(0, "a", prompt, stopping)])["a"]
    spec = run(spec_engine(OracleProposer(k=4))[0], [(0, "a", prompt, stopping)])["a"]
    assert ids(spec) == ids(base) == full[: m + 1]
    assert spec[-1].finish_reason == base[-1].finish_reason == "stop"
    assert len(spec[-1].new_token_ids) < 5, "the stop cut an accepted run"


@pytest.mark.parametrize("max_new", [1, 2, 3, 5, 6, 7, 11])
def test_max_new_tokens_inside_an_accepted_run(max_new: int) -> None:
    prompt = [4, 8, 15, 16, 23]
    proposer = OracleProposer(k=4)
    engine, runner = spec_engine(proposer)
    outs = run(engine, [(0, "a", prompt, StoppingParams(max_new_tokens=max_new))])["a"]
    assert ids(outs) == expected_output(prompt, max_new)
    assert outs[-1].finish_reason == "length"
    # Never more drafts than tokens left to emit after the request's own.
    emitted = 1
    for step in runner.drafts[1:]:
        for _, drafts in step:
            assert len(drafts) <= max_new - emitted - 1
            emitted += len(drafts) + 1


def test_context_length_inside_an_accepted_run() -> None:
    prompt = list(range(3, 13))
    stopping = StoppingParams(max_new_tokens=0)  # the rest of the context: 17 tokens
    base = run(fake_engine(64, max_model_len=27)[0], [(0, "a", prompt, stopping)])["a"]
    proposer = OracleProposer(k=4)
    spec = run(spec_engine(proposer, max_model_len=27)[0], [(0, "a", prompt, stopping)])["a"]
    assert ids(spec) == ids(base) == expected_output(prompt, 17)
    assert spec[-1].finish_reason == base[-1].finish_reason == "length"
    # Never more drafts than tokens left to emit after the request's own.
    assert proposer.proposals and all(len(d) <= 27 - n - 1 for n, d, _ in proposer.proposals)


# ---- gates ---------------------------------------------------------------------------------------


def test_no_drafts_with_more_running_requests_than_the_disable_batch_size() -> None:
    engine, runner = spec_engine(OracleProposer(k=4), speculative_disable_batch_size=2)
    items = [
        (0, "a", [5, 6, 7], StoppingParams(20)),
        (0, "b", [8, 9], StoppingParams(20)),
        (0, "c", [10, 11, 12], StoppingParams(4)),
    ]
    outs = run(engine, items)
    for _, rid, prompt, stopping in items:
        assert ids(outs[rid]) == expected_output(prompt, stopping.max_new_tokens)
    for step, drafts in zip(runner.steps, runner.drafts, strict=True):
        if len(step) > 2:  # every request scheduled was running
            assert not drafts
    assert any(runner.drafts), "drafts once c has finished"


class FixedProposer:
    """Proposes [1, 2, 3] (cut to the room given) for any request."""

    def propose(self, token_ids: Sequence[int], max_tokens: int, mirror: object = None) -> list[int]:
        return [1, 2, 3][:max_tokens]


def gated_speculator(disable_batch_size: int, max_model_len: int) -> Speculator:
    settings = EngineSettings(**{**SPEC, "speculative_disable_batch_size": disable_batch_size})  # type: ignore[arg-type]
    return Speculator(FixedProposer(), settings, max_model_len)


def schedule_with_drafts(sched: Scheduler, speculator: Speculator) -> SchedulerOutput:
    """A step as the engine schedules one: the scheduler's, then the drafts of the requests that pass
    the gate, fitted in."""
    out = sched.schedule()
    if speculator.propose(out, len(sched.running)):
        sched.schedule_drafts(out)
    return out


def test_no_drafts_above_the_disable_batch_size() -> None:
    """The Speculator's batch gate, whatever the proposer offers: drafts only while running <= the size."""
    for running, drafted in ((3, False), (2, True)):
        bm = BlockManager(32, 4)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
        reqs = [Request(str(i), [5, 6, 7], GREEDY, StoppingParams(10)) for i in range(running)]
        for r in reqs:
            sched.add(r)
        sched.advance(sched.schedule())
        for r in reqs:
            r.token_ids.append(9)
        out = schedule_with_drafts(sched, gated_speculator(2, 128))
        assert [n for _, n in out.scheduled] == [4 if drafted else 1] * running
        assert out.num_draft_tokens == (3 * running if drafted else 0)
        assert all(bool(r.draft_ids) == drafted for r in reqs)
        for r in reqs:
            sched.finish(r, "cancelled")
        assert bm.num_free_blocks == 32


def test_no_drafts_in_a_step_that_preempts() -> None:
    bm = BlockManager(3, 4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=12)
    a, b = (Request(r, [5, 6, 7, 8], GREEDY, StoppingParams(6)) for r in "ab")
    sched.add(a)
    sched.add(b)
    sched.advance(sched.schedule())
    for r in (a, b):
        r.token_ids.append(9)
    out = schedule_with_drafts(sched, gated_speculator(4, 12))  # a takes the last free block: b is preempted
    assert out.preempted == [b]
    assert out.scheduled == [(a, 1)] and not a.draft_ids and not b.draft_ids
    sched.finish(a, "cancelled")
    sched.finish(b, "cancelled")
    assert bm.num_free_blocks == 3


def test_acceptance_gate_pauses_a_request_and_lets_it_try_again() -> None:
    k = 4
    proposer = OracleProposer(k=k, wrong=lambda n, j: True)
    engine, _ = spec_engine(proposer, speculative_min_acceptance=0.5)
    prompt = [7, 3, 9]
    outs = run(engine, [(0, "a", prompt, StoppingParams(max_new_tokens=80))])["a"]
    assert ids(outs) == expected_output(prompt, 80)
    # Output lengths at which the request proposed: a window of failed proposals, a cool-down, another
    # window, a cool-down twice as long, ...
    proposed_at = [n - len(prompt) for n, _, _ in proposer.proposals]
    per_window = math.ceil(SPEC_GATE_WINDOW / k)
    expected: list[int] = []
    at, cooldown = 1, SPEC_COOLDOWN
    while at + per_window <= 80:
        expected.extend(range(at, at + per_window))
        at += per_window + cooldown
        cooldown *= 2
    assert proposed_at == expected
    assert engine.stats().spec_accepted_tokens == 0


def test_a_request_that_accepts_keeps_proposing() -> None:
    proposer = OracleProposer(k=4)
    engine, _ = spec_engine(proposer, speculative_min_acceptance=0.9)
    outs = run(engine, [(0, "a", [7, 3, 9], StoppingParams(max_new_tokens=61))])["a"]
    assert [len(o.new_token_ids) for o in outs] == [1] + [5] * 12


def test_budget_goes_to_real_tokens_first_and_trims_drafts() -> None:
    proposer = OracleProposer(k=4)
    engine, runner = spec_engine(proposer, max_num_batched_tokens=7)
    items = [
        (0, "a", [5, 6], StoppingParams(30)),
        (0, "b", [7, 8], StoppingParams(30)),
        (0, "c", [9, 10], StoppingParams(30)),
        (3, "d", [11, 12, 13, 14, 15], StoppingParams(5)),
    ]
    outs = run(engine, items)
    for _, rid, prompt, stopping in items:
        assert ids(outs[rid]) == expected_output(prompt, stopping.max_new_tokens)
    assert runner.steps[1] == [("a", 5), ("b", 1), ("c", 1)], "the budget left after real tokens: 4 drafts"
    admitted = next(i for i, s in enumerate(runner.steps) if any(r == "d" for r, _ in s))
    assert runner.steps[admitted] == [("a", 1), ("b", 1), ("c", 1), ("d", 4)], "the prefill before drafts"
    for step in runner.steps:
        assert sum(n for _, n in step) <= 7


def test_drafts_never_preempt() -> None:
    proposer = OracleProposer(k=4)
    engine, runner = spec_engine(proposer, num_blocks=2, block_size=4)
    items = [(0, "a", [5, 6, 7], StoppingParams(3)), (0, "b", [8, 9, 10], StoppingParams(3))]
    outs = run(engine, items)
    for _, rid, prompt, stopping in items:
        assert ids(outs[rid]) == expected_output(prompt, stopping.max_new_tokens)
    # Step 2: both requests fill their one block with their own token; a draft would need a block.
    assert runner.steps[1] == [("a", 1), ("b", 1)]
    assert [len(d) for _, d, _ in proposer.proposals[:2]] == [1, 1], "proposed, then dropped"


# ---- figures ---------------------------------------------------------------------------------------


def test_stats_and_metrics_count_what_the_proposer_produced() -> None:
    proposer = OracleProposer(k=3, wrong=mixed)
    engine, _ = spec_engine(proposer)
    metrics = EngineMetrics()
    engine.observer = EngineObserver(metrics, stats=engine.recorder, model_name="fake")
    items = fake_workload(seed=8, n=6)
    outs = run(engine, items)
    for _, rid, prompt, stopping in items:
        assert ids(outs[rid]) == expected_output(prompt, stopping.max_new_tokens)
    verified = [(len(d), right) for _, d, right in proposer.proposals if d]
    proposed = sum(n for n, _ in verified)
    accepted = sum(a for _, a in verified)
    assert 0 < accepted < proposed
    st = engine.stats()
    assert st.spec_proposed_tokens == proposed
    assert st.spec_accepted_tokens == accepted
    assert st.spec_acceptance_rate == pytest.approx(accepted / proposed)
    assert st.spec_mean_accepted_length == pytest.approx((accepted + len(verified)) / len(verified))
    reg = metrics.registry
    assert reg.get_sample_value("sluice_spec_proposed_tokens_total") == proposed
    assert reg.get_sample_value("sluice_spec_accepted_tokens_total") == accepted
    assert reg.get_sample_value("sluice_spec_accepted_length_count") == len(verified)
    assert reg.get_sample_value("sluice_spec_accepted_length_sum") == accepted + len(verified)
    assert reg.get_sample_value("sluice_generation_tokens_total") == st.generated_tokens
    engine.reset_stats()
    assert engine.stats().spec_proposed_tokens == 0


# ---- tiny real models ------------------------------------------------------------------------------


def repetitive_workload(seed: int, n: int = 12) -> list[tuple[int, list[int], int]]:
    """Prompts that repeat a span (prompt lookup finds drafts, and a random model tends to copy them),
    mixed with `workload`'s (shared prefixes, long prompts) for preemption and prefix hits."""
    rng = random.Random(seed)
    items = workload(seed, n)
    for _ in range(n):
        span = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 10))]
        items.append((rng.randint(0, 12), span * rng.randint(2, 5), rng.randint(8, 30)))
    return items


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 8})],
)
def test_greedy_matches_generate_with_speculation(
    family: str, overrides: dict[str, object], tmp_path: Path
) -> None:
    model_dir = make_model_dir(tmp_path / family, family, **overrides)
    items = repetitive_workload(seed=4)
    engine = small_engine(model_dir, **SPEC)
    assert run_engine(engine, items) == reference(model_dir, items)
    st = engine.stats()
    assert st.spec_accepted_tokens > 0, "drafts were accepted"
    assert st.prefix_hit_rate > 0
    # A window on every layer frees blocks as they slide out, so this pool needs no preemption there.
    assert st.num_preemptions > 0 or engine.kv_groups[0].window == 8


def test_prefix_hit_over_a_speculated_output(llama_dir: Path) -> None:
    """Blocks registered while speculating hold the verified tokens: a request whose prompt is another's
    prompt and output reuses them and continues as the model does."""
    engine = small_engine(llama_dir, **SPEC)
    prompt = [17, 29, 31, 5, 77, 12] * 4
    stopping = StoppingParams(max_new_tokens=40, ignore_eos=True)
    first = _generate(engine, "a", prompt, stopping)
    assert engine.stats().spec_accepted_tokens > 0
    got = _generate(engine, "b", prompt + first[:32], StoppingParams(max_new_tokens=8, ignore_eos=True))
    assert engine.scheduler.bm.prefix_hit_blocks >= 3, "the blocks of the speculated output were reused"
    assert got == first[32:40]
    assert first == reference(llama_dir, [(0, prompt, 40)])["0"]


def _generate(engine: LLMEngine, rid: str, prompt: list[int], stopping: StoppingParams) -> list[int]:
    engine.add_request(rid, prompt, GREEDY, stopping)
    got: list[int] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            got += o.new_token_ids
    return got


def test_sampling_with_speculation_respects_limits_and_seeds(llama_dir: Path) -> None:
    prompt = [17, 29, 31, 5, 77, 12] * 4

    def sample(seed: int | None, speculative: bool) -> list[int]:
        engine = small_engine(llama_dir, **(SPEC if speculative else {}))
        sampling = SamplingParams(temperature=0.7, top_k=20, seed=seed)
        engine.add_request("x", prompt, sampling, StoppingParams(max_new_tokens=24, ignore_eos=True))
        engine.add_request(
            "y", prompt[:9], SamplingParams(temperature=1.0), StoppingParams(max_new_tokens=17)
        )
        out: dict[str, list[int]] = {"x": [], "y": []}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        assert len(out["x"]) == 24 and 1 <= len(out["y"]) <= 17
        if speculative:
            assert engine.stats().spec_proposed_tokens > 0
        return out["x"]

    a = sample(5, speculative=True)
    assert sample(5, speculative=True) == a, "a seeded request is reproducible"
    assert sample(5, speculative=False) == a, "and draws as it does without speculation"
    assert sample(6, speculative=True) != a


async def test_async_engine_streams_the_accepted_runs() -> None:
    """The engine loop and its callers with speculation: several tokens per output, merged in order."""
    core, _ = spec_engine(OracleProposer(k=4, wrong=mixed))
    engine = AsyncEngine(core)
    engine.start()
    try:
        caller = engine.open_caller()
        prompts = {f"r{i}": [5, 6, i + 3] for i in range(3)}
        for rid, prompt in prompts.items():
            caller.submit(rid, prompt, GREEDY, StoppingParams(max_new_tokens=23))
        caller.close_input()
        got: dict[str, list[int]] = {rid: [] for rid in prompts}
        finished = set()
        while batch := await caller.get():
            for o in batch:
                got[o.request_id] += o.new_token_ids
                if o.finished:
                    finished.add(o.request_id)
        assert finished == set(prompts)
        assert got == {rid: expected_output(p, 23) for rid, p in prompts.items()}
        assert core.stats().spec_accepted_tokens > 0
    finally:
        engine.stop()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


def test_logprobs_line_up_with_the_accepted_runs(llama_dir: Path) -> None:
    prompt = [17, 29, 31, 5, 77, 12] * 4
    sampling = SamplingParams(logprobs=3)
    stopping = StoppingParams(max_new_tokens=30, ignore_eos=True)

    def outputs(speculative: bool) -> list[RequestOutput]:
        engine = small_engine(llama_dir, **(SPEC if speculative else {}))
        engine.add_request("a", prompt, sampling, stopping)
        outs: list[RequestOutput] = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        if speculative:
            assert engine.stats().spec_accepted_tokens > 0
        return outs

    spec, base = outputs(True), outputs(False)
    assert any(len(o.new_token_ids) > 1 for o in spec)
    assert ids(spec) == ids(base)
    spec_lps = [lp for o in spec for lp in o.logprobs or []]
    base_lps = [lp for o in base for lp in o.logprobs or []]
    assert len(spec_lps) == len(base_lps) == 30
    for tok, s, b in zip(ids(spec), spec_lps, base_lps, strict=True):
        assert s.top_ids[0] == tok and s.top_ids == b.top_ids
        assert s.logprob == pytest.approx(b.logprob, abs=1e-4)


def decoding_step(
    reqs: Sequence[Request], *, admit: Sequence[Request] = (), blocks: int = 32
) -> tuple[Scheduler, SchedulerOutput]:
    """A scheduler whose `reqs` have computed their prompts and hold one new token each (decoding), with
    `admit` waiting; and its next step (before drafts)."""
    sched = Scheduler(BlockManager(blocks, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128)
    for r in reqs:
        sched.add(r)
    sched.advance(sched.schedule())
    for r in reqs:
        r.token_ids.append(9)
    for r in admit:
        sched.add(r)
    return sched, sched.schedule()


def test_the_gate_passes_only_decoding_requests_free_to_speculate() -> None:
    plain = Request("plain", [5, 6, 7], GREEDY, StoppingParams(10))
    penalised = Request("penalised", [5, 6, 7], SamplingParams(repetition_penalty=1.2), StoppingParams(10))
    young = Request("young", [5, 6, 7], GREEDY, StoppingParams(10, min_new_tokens=2))
    paused = Request("paused", [5, 6, 7], GREEDY, StoppingParams(10))
    pending = Request("pending", [5, 6, 7], GREEDY, StoppingParams(10))
    admitted = Request("admitted", [5], GREEDY, StoppingParams(10))  # one token to compute, but new
    sched, out = decoding_step([plain, penalised, young, paused, pending], admit=[admitted])
    assert (admitted, 1) in out.scheduled
    speculator = gated_speculator(6, 128)
    paused.spec = SpecState(resume_at=2)
    pending.prev_row = 0
    assert speculator.propose(out, len(sched.running))
    assert {r.request_id for r, _ in out.scheduled if r.draft_ids} == {"plain"}
    assert list(plain.draft_ids) == [1, 2, 3]
    assert not gated_speculator(5, 128).propose(out, len(sched.running)), "six running: above the size"


def test_drafts_never_run_past_max_new_tokens_or_the_context_length() -> None:
    short = Request("a", [5, 6, 7], GREEDY, StoppingParams(3))  # one output so far: room for 3 - 1 - 1
    long = Request("b", [5, 6, 7], GREEDY, StoppingParams(50))  # 4 tokens: room for 7 - 4 - 1 under 7
    sched, out = decoding_step([short, long])
    assert gated_speculator(4, 7).propose(out, len(sched.running))
    assert (list(short.draft_ids), list(long.draft_ids)) == ([1], [1, 2])
    short.spec = long.spec = None
    assert not gated_speculator(4, 5).propose(out, len(sched.running)), "no room left under 5 tokens"
    assert not short.draft_ids and not long.draft_ids


def test_the_acceptance_rule_pauses_doubles_and_resets() -> None:
    req = Request("a", [5, 6, 7], GREEDY, StoppingParams(500))
    settings = EngineSettings(**{**SPEC, "speculative_min_acceptance": 0.5})  # type: ignore[arg-type]
    speculator = Speculator(FixedProposer(), settings, 1000)
    req.spec = SpecState()
    out = SchedulerOutput()

    def window(accepted_per_4: int, outputs: int) -> None:
        for _ in range(SPEC_GATE_WINDOW // 4):
            req.token_ids.extend([9] * outputs)
            speculator.verified(out, req, 4, accepted_per_4)

    window(1, 1)  # 25% < 50%: paused for SPEC_COOLDOWN output tokens
    assert (req.spec.cooldown, req.spec.resume_at) == (SPEC_COOLDOWN, req.num_output_tokens + SPEC_COOLDOWN)
    window(1, 1)
    assert req.spec.cooldown == 2 * SPEC_COOLDOWN, "twice as long after a second failed window"
    window(2, 3)  # 50%: passes
    assert req.spec.cooldown == 0 and req.spec.window_proposed == 0
    assert out.spec_accepted_lengths == [2, 2, 2, 2, 3, 3]
