"""KV groups of a hybrid model (sliding-window layers beside full-attention ones): the scheduler keeps a
block table per group, frees the sliding group's blocks as they leave the window, never overflows either
pool, takes prefix hits only as long as every group can serve them, and gives every block back; the
pool's split among the groups (kv_sizing.KVLayout) is exact."""

from __future__ import annotations

import random

import pytest

from services.engine.core.block_manager import BlockManager, KVGroupSpec
from services.engine.core.params import SamplingParams, StoppingParams
from services.engine.core.request import Request
from services.engine.core.scheduler import Scheduler
from services.engine.executor.kv_sizing import KVLayout, group_layers, window_blocks

BS = 4
WINDOW = 8
GREEDY = SamplingParams()


Hybrid = tuple[Scheduler, BlockManager, BlockManager]


def hybrid(full_blocks: int, sliding_blocks: int, **kw: object) -> Hybrid:
    """A scheduler over a full-attention group and a sliding group (window 8, blocks of 4)."""
    full, sliding = BlockManager(full_blocks, BS), BlockManager(sliding_blocks, BS)
    settings: dict[str, object] = dict(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=96)
    settings.update(kw)
    sched = Scheduler(full, extra_groups=[(sliding, WINDOW)], **settings)  # type: ignore[arg-type]
    return sched, full, sliding


def step(sched: Scheduler, rng: random.Random) -> None:
    """One step: schedule, count, and append a sampled token to every request that sampled; a request
    past its token limit finishes."""
    out = sched.schedule()
    sched.advance(out)
    for req, _ in out.scheduled:
        if req.num_computed_tokens == req.num_tokens:
            req.token_ids.append(rng.randrange(5, 50))
            if req.num_output_tokens >= req.stopping.max_new_tokens:
                sched.finish(req, "length")


def held(bm: BlockManager, table: list[int]) -> int:
    return sum(b != bm.hole for b in table)


def test_every_group_returns_whole_after_a_random_workload_with_preemption() -> None:
    """The invariant: whatever runs, is preempted, hits the prefix cache or is aborted, once every request
    has finished both pools hold every block free; meanwhile each table has one entry per logical block,
    a sliding table holds at most ceil((window - 1) / block_size) + 1 blocks between steps, and the
    sliding group never holds more than `window_blocks` allows."""
    rng = random.Random(0)
    sched, full, sliding = hybrid(20, window_blocks(WINDOW, BS, 4, 12))
    shared = [rng.randrange(5, 50) for _ in range(20)]
    for i in range(30):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(5, 50) for _ in range(rng.randint(1, 30))]
        sched.add(Request(str(i), prompt, GREEDY, StoppingParams(max_new_tokens=rng.randint(1, 12))))
        if i % 5 == 4 and sched.running:
            sched.finish(rng.choice(sched.running), "abort")
        for _ in range(rng.randint(0, 3)):
            step(sched, rng)
            for req in sched.running:
                assert len(req.block_ids) == len(req.group_block_ids[0])
                assert held(sliding, req.group_block_ids[0]) <= -(-(WINDOW - 1) // BS) + 1
                assert held(full, req.block_ids) == len(req.block_ids)
    while sched.running or sched.waiting:
        step(sched, rng)
    assert sched.num_preemptions > 0, "the full group's 20 blocks are too few for all: preemption"
    assert full.prefix_hit_blocks > 0
    assert full.num_free_blocks == full.num_blocks and sliding.num_free_blocks == sliding.num_blocks
    assert all(b == 0 for b in full.ref_counts) and all(b == 0 for b in sliding.ref_counts)


def test_a_prefix_hit_covers_what_the_sliding_group_still_holds() -> None:
    """A finished request's blocks stay cached in both groups: a later request with its prompt starts
    past the cached prefix, its sliding table holes before the window of its first computed position.
    Once the sliding group has reused those window blocks, the hit stops where it still holds a window."""
    rng = random.Random(1)
    sched, _, sliding = hybrid(40, 12)
    prompt = [rng.randrange(5, 50) for _ in range(30)]
    first = Request("a", prompt, GREEDY, StoppingParams(max_new_tokens=1))
    sched.add(first)
    while not first.finished:
        step(sched, rng)
    again = Request("b", list(prompt), GREEDY, StoppingParams(max_new_tokens=1))
    sched.add(again)
    out = sched.schedule()
    assert out.scheduled == [(again, 2)], "7 full blocks cached of 30 tokens: 28 computed"
    table = again.group_block_ids[0]
    assert table[:5] == [sliding.hole] * 5, "positions 21.. are the window of position 28"
    assert all(b != sliding.hole for b in table[5:])
    sched.finish(again, "abort")
    # Reuse the sliding group's free blocks (the cached ones last): the window of block 7 is lost.
    hog = sliding.allocate(sliding.num_free_blocks)
    sliding.free_blocks(hog)
    third = Request("c", list(prompt), GREEDY, StoppingParams(max_new_tokens=1))
    sched.add(third)
    out = sched.schedule()
    assert out.scheduled == [(third, 12)], "nothing of the window is cached: computed from the start"
    assert third.num_cached_tokens == 0


def test_a_hit_is_the_longest_every_group_serves() -> None:
    """The full group holds the prefix up to block 5, the sliding group a window ending at block 3 only:
    the hit is 3 blocks, at which both serve."""
    full, sliding = BlockManager(16, BS), BlockManager(16, BS)
    hashes = list(range(100, 106))
    for i, h in enumerate(hashes):
        full.register(i, h)  # type: ignore[arg-type]
    sliding.register(1, hashes[1])  # type: ignore[arg-type]
    sliding.register(2, hashes[2])  # type: ignore[arg-type]
    assert full.longest_hit(hashes, 0, 6) == 6  # type: ignore[arg-type]
    assert sliding.longest_hit(hashes, WINDOW, 6) == 3  # type: ignore[arg-type]
    assert sliding.hit_table(hashes[:3], WINDOW) == [sliding.hole, 1, 2]  # type: ignore[arg-type]
    assert full.longest_hit(hashes, 0, 3) == 3  # type: ignore[arg-type]


def test_groups_full_attention_first_then_the_widest_window() -> None:
    assert group_layers([8, 0, 8, 0]) == [(0, (1, 3)), (8, (0, 2))]
    assert group_layers([4, 16, 4]) == [(16, (1,)), (4, (0, 2))]
    assert group_layers([0, 0]) == [(0, (0, 1))]


def test_window_blocks_bounds_what_a_step_can_hold() -> None:
    # 4 requests × (ceil(7 / 4) + 2) + ceil(12 / 4)
    assert window_blocks(8, 4, 4, 12) == 4 * 4 + 3
    assert window_blocks(512, 16, 256, 2048) == 256 * 34 + 128


@pytest.mark.parametrize("budget_blocks", [1, 5, 50, 1000])
def test_the_layout_splits_a_budget_exactly(budget_blocks: int) -> None:
    """Two full layers and two sliding layers, 100 bytes per layer-block: the sliding group gets at most
    its bound (4 × 4 + 3 = 19 blocks), the full group the rest of the bytes; the pool is the largest that
    fits, so one block more would not."""
    layout = KVLayout(((0, (1, 3)), (8, (0, 2))), BS, 100, 4, 12)
    budget = budget_blocks * 4 * 100  # what budget_blocks blocks of every layer would take
    n = layout.blocks_for_bytes(budget)
    assert layout.pool_bytes(n) <= budget < layout.pool_bytes(n + 1)
    sizes = layout.group_blocks(n)
    assert sizes == [n, min(n, 19)]
    assert layout.pool_bytes(n) == (2 * sizes[0] + 2 * sizes[1]) * 100
    if budget_blocks <= 19:
        assert n == budget_blocks, "below the bound both groups get the same blocks"
    else:
        assert n == (budget - 2 * 19 * 100) // 200, "past it the sliding layers take 19 blocks only"
    assert layout.specs(n) == [KVGroupSpec(0, (1, 3), n), KVGroupSpec(8, (0, 2), min(n, 19))]
    assert layout.describe(n) == f"full: 2 layers × {n} blocks; window 8: 2 layers × {min(n, 19)} blocks"


def test_one_group_keeps_the_old_arithmetic() -> None:
    layout = KVLayout(((0, (0, 1, 2)),), BS, 100, 4, 12)
    assert layout.blocks_for_bytes(300 * 7 + 299) == 7
    assert layout.pool_bytes(7) == 2100
