"""A model runner without a model: the next token is a hash of the tokens so far, so outputs depend
only on each request's own tokens (any batching, chunking, preemption or speculation must give the same
outputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.core.engine import LLMEngine
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.settings import EngineSettings

FAKE_VOCAB = 64
FAKE_EOS = 2


def next_token(tokens: Sequence[int]) -> int:
    h = 0
    for t in tokens:
        h = (h * 131 + t + 7) % 1_000_003
    return 3 + h % (FAKE_VOCAB - 3)  # never EOS unless forced


class FakeRunner:
    def __init__(self, num_blocks: int, max_len: int = 0, eos_after: dict[int, int] | None = None) -> None:
        """`max_len` 0: no context length of its own, so the engine's is what the pool holds."""
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.vocab_size = FAKE_VOCAB
        self.eos_ids = frozenset([FAKE_EOS])
        self.max_position_embeddings = max_len
        self.last_forward_s = 0.0
        self.engine: LLMEngine | None = None  # the engine it runs for: its block manager is checked
        self.steps: list[list[tuple[str, int]]] = []
        self.fail_next = False
        self.fed_from_device = 0  # decode rows whose input token came from the previous step's ids
        self.drafts: list[list[tuple[str, list[int]]]] = []  # per step: (request, its drafts) computed
        self.prompt_logits: list = []  # prompt logprobs: not computed by this runner

    def prepare(self, max_model_len: int, max_num_seqs: int) -> None:
        pass

    def execute(
        self, scheduled: Sequence[tuple[Request, int]], prev_tokens: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, list[Request]]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected failure")
        assert self.engine is not None
        bm = self.engine.block_manager
        self.steps.append([(r.request_id, n) for r, n in scheduled])
        self.drafts.append([(r.request_id, list(r.draft_ids)) for r, _ in scheduled if r.draft_ids])
        rows: list[list[torch.Tensor]] = []
        sampling: list[list[Request]] = []
        for req, n in scheduled:
            end = req.num_computed_tokens + n
            drafts = len(req.draft_ids)
            assert len(req.block_ids) * bm.block_size >= end, "blocks allocated for every scheduled token"
            first, last = req.num_computed_tokens // bm.block_size, (end - 1) // bm.block_size
            for b in req.block_ids[first : last + 1]:
                assert bm.ref_counts[b] == 1, "a step never writes into a shared block"
            tokens = req.token_ids
            if req.prev_row >= 0:  # async scheduling: the last token is still on the "device"
                assert prev_tokens is not None and n == 1, "a pending token is a decode's input"
                tokens = [*tokens[:-1], int(prev_tokens[req.prev_row])]
                self.fed_from_device += 1
            assert PLACEHOLDER not in tokens, "the model never reads a placeholder"
            if drafts:  # speculative: the last token and the drafts, one row each
                assert end == req.num_tokens + drafts and n == drafts + 1, "drafts come with the last token"
                tokens = [*tokens, *req.draft_ids]
            if end == req.num_tokens + drafts:
                own = []
                for j in range(drafts + 1):
                    row = torch.full((FAKE_VOCAB,), -10.0)
                    row[next_token(tokens[: req.num_tokens + j])] = 10.0
                    own.append(row)
                rows.append(own)
                sampling.append([req] * (drafts + 1))
        # Requests reversed, as a runner may order them as it likes (a request's rows stay together).
        flat = [row for own in rows[::-1] for row in own]
        logits = torch.stack(flat) if flat else torch.empty((0, FAKE_VOCAB))
        return logits, [r for own in sampling[::-1] for r in own]


def fake_engine(num_blocks: int = 64, **settings: object) -> tuple[LLMEngine, FakeRunner]:
    runner = FakeRunner(num_blocks)
    engine = LLMEngine(EngineSettings(**settings), runner=runner)  # type: ignore[arg-type]
    runner.engine = engine
    return engine, runner


def expected_output(prompt: Sequence[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]
