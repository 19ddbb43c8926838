"""Which replica of a stage gets the next piece of work: one `Picker`, with a policy per stage.

Tokenizer and detokenizer replicas are interchangeable (`round_robin`); the engine replica of each
request is picked by the `routing` policy: `round_robin`, `least_load` (ties in turn) or
`prefix_affinity` (among the candidates whose load exceeds the least loaded one's by at most `margin`
requests or `margin_ratio` of it, whichever is larger, the one holding the longest prefix of the prompt,
then the least loaded, ties in turn). The engines' picker mirrors each replica's `EngineReport` (load,
KV block keys) and hashes a prompt as the engine does (`chain_hashes` at the reported block size, over
`max_hit_blocks`); keys just routed count as held for `PENDING_S`. Load: the larger of this gateway's
requests in flight on the replica and its own running plus waiting, plus one per `TOKENS_PER_LOAD`
queued prompt tokens. Why, and measurements: docs/architecture.md ("Replicas and how work is spread").
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.choices import ROUTING_POLICIES as POLICIES
from services.common.block_keys import BlockHash, chain_hashes, max_hit_blocks
from services.common.pb import engine_pb2

PENDING_S = 5.0  # how long keys of a routed prompt count as held before the engine reports them
TOKENS_PER_LOAD = 4096  # queued prompt tokens that weigh as much as one request in flight


@dataclass
class ReplicaView:
    """What the gateway knows of one engine replica from its reports."""

    reported: bool = False
    block_size: int = 0
    prefix_caching: bool = True
    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    queued_prompt_tokens: int = 0
    keys: set[BlockHash] = field(default_factory=set)
    # key → until (time.monotonic()), oldest first: expired keys are dropped from the front
    pending: OrderedDict[BlockHash, float] = field(default_factory=OrderedDict)

    def apply(self, report: engine_pb2.EngineReport) -> None:
        """Applies one report (a snapshot replaces every key known before)."""
        load = report.load
        self.reported = True
        self.block_size = load.block_size
        self.prefix_caching = report.prefix_caching
        self.running, self.waiting = load.running, load.waiting
        self.kv_blocks_used, self.kv_blocks_total = load.kv_blocks_used, load.kv_blocks_total
        self.queued_prompt_tokens = load.queued_prompt_tokens
        if report.snapshot:
            self.keys = set(report.stored)
        else:
            self.keys.difference_update(report.removed)
            self.keys.update(report.stored)
        for key in report.stored:
            self.pending.pop(key, None)

    def cached_blocks(self, keys: Sequence[BlockHash], now: float) -> int:
        """How many leading `keys` this replica holds (reported, or routed here within PENDING_S)."""
        n = 0
        for key in keys:
            if key not in self.keys:
                until = self.pending.get(key)
                if until is None or until < now:
                    break
            n += 1
        return n

    def expect(self, keys: Sequence[BlockHash], now: float) -> None:
        """Counts `keys` as held until the replica reports them (or PENDING_S passes)."""
        pending = self.pending
        while pending and next(iter(pending.values())) < now:
            pending.popitem(last=False)
        until = now + PENDING_S
        for key in keys:
            if key not in self.keys:
                pending[key] = until
                pending.move_to_end(key)


class Picker:
    """Picks the replica for each new piece of work among candidates, by `policy` (one of POLICIES);
    mirrors the reports of engine replicas for the load- and cache-aware policies.

    `in_flight(address)`: this gateway's requests on that replica now (none counted when not given).
    `margin`, `margin_ratio`: how many requests more than the least loaded candidate a replica may have
    and still win on its cached prefix: `margin`, or `margin_ratio` times the least load when that is
    more."""

    def __init__(
        self,
        policy: str = "round_robin",
        in_flight: Callable[[str], int] | None = None,
        margin: int = 4,
        margin_ratio: float = 0.0,
    ) -> None:
        assert policy in POLICIES, policy  # settings are validated when loaded
        self.policy = policy
        self.margin = margin
        self.margin_ratio = margin_ratio
        self._in_flight = in_flight or (lambda address: 0)
        self._views: dict[str, ReplicaView] = {}
        self._turn = itertools.count()

    def view(self, address: str) -> ReplicaView:
        view = self._views.get(address)
        if view is None:
            view = self._views[address] = ReplicaView()
        return view

    def on_report(self, address: str, report: engine_pb2.EngineReport) -> None:
        self.view(address).apply(report)

    def forget(self, address: str) -> None:
        """The replica's report stream ended: what it reported is no longer known to hold."""
        self._views.pop(address, None)

    def load(self, address: str) -> float:
        """The replica's load in requests (see the module docstring)."""
        view = self._views.get(address)
        own = self._in_flight(address)
        if view is None:
            return float(own)
        return max(own, view.running + view.waiting) + view.queued_prompt_tokens / TOKENS_PER_LOAD

    def pick(self, candidates: Sequence[str], prompt_ids: Sequence[int] = ()) -> str:
        """The replica for a piece of work among `candidates` (not empty); `prompt_ids`, the request's
        prompt, for `prefix_affinity`."""
        assert candidates, "no candidate replica"
        start = next(self._turn) % len(candidates)
        in_turn = [*candidates[start:], *candidates[:start]]
        if self.policy == "round_robin" or len(in_turn) == 1:
            return in_turn[0]
        loads = {a: self.load(a) for a in in_turn}
        if self.policy == "least_load":
            return min(in_turn, key=loads.__getitem__)
        least = min(loads.values())
        allowed = least + max(self.margin, self.margin_ratio * least)
        eligible = [a for a in in_turn if loads[a] <= allowed]
        now = time.monotonic()
        keys_by_size: dict[int, list[BlockHash]] = {}
        hits = {a: self._cached_blocks(a, prompt_ids, keys_by_size, now) for a in eligible}
        chosen = min(eligible, key=lambda a: (-hits[a], loads[a]))
        self._expect(chosen, keys_by_size)
        return chosen

    def _cached_blocks(
        self, address: str, prompt_ids: Sequence[int], keys_by_size: dict[int, list[BlockHash]], now: float
    ) -> int:
        view = self._views.get(address)
        if view is None or not view.block_size or not view.prefix_caching:
            return 0
        keys = keys_by_size.get(view.block_size)
        if keys is None:
            keys = keys_by_size[view.block_size] = prompt_keys(prompt_ids, view.block_size)
        return view.cached_blocks(keys, now)

    def _expect(self, address: str, keys_by_size: dict[int, list[BlockHash]]) -> None:
        view = self._views.get(address)
        if view is not None and view.block_size in keys_by_size:
            view.expect(keys_by_size[view.block_size], time.monotonic())


def prompt_keys(prompt_ids: Sequence[int], block_size: int) -> list[BlockHash]:
    """The cache keys an engine looks up for this prompt (`max_hit_blocks` of its full blocks)."""
    blocks = max_hit_blocks(len(prompt_ids), block_size)
    return chain_hashes(prompt_ids[: blocks * block_size], block_size, 0, None)
