"""Turns the logits of one step into one token per sampling request, vectorised over the batch.

Order of operations per row: penalties (repetition over prompt and output, presence and frequency over
the output), suppression of EOS / stop ids before `min_new_tokens`, then either argmax (greedy) or
temperature → top-k → top-p → min-p → a draw. A draw is `argmax(probs / q)` with `q ~ Exp(1)`, which
picks token i with probability probs[i]; a seeded request draws `q` from its own generator, so its
tokens do not depend on what else is in the batch. Log-probabilities are those of the model's raw
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.params import TokenLogprob
from services.engine.request import Request


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SampleResult:
        """logits: (N, V), row i for reqs[i]."""
        n = len(reqs)
        if n == 0:
            return SampleResult([], [])
        raw = logits.float()
        if all(r.plain_greedy for r in reqs):
            return SampleResult(raw.max(dim=-1).indices.tolist(), [None] * n)
        x = raw
        pen_rows = [i for i, r in enumerate(reqs) if r.sampling.has_penalties]
        if pen_rows:
            x = x.clone()
            self._apply_penalties(x, [reqs[i] for i in pen_rows], pen_rows)
        x = self._suppress_early_stops(x, reqs, x is raw)
        tokens = x.max(dim=-1).indices  # (N,) the first maximum, as argmax; faster on CPU
        sampled_rows = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
        if sampled_rows:
            idx = torch.tensor(sampled_rows, device=x.device)
            drawn = self._draw(x.index_select(0, idx), [reqs[i] for i in sampled_rows])
            tokens = tokens.index_copy(0, idx, drawn)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprob | None] = [None] * n
        lp_rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs > 0]
        if lp_rows:
            self._logprobs(raw, tokens, reqs, lp_rows, logprobs)
        return SampleResult(token_list, logprobs)

    # ---- processors ----------------------------------------------------------------------------

    def _apply_penalties(self, x: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
        """In place on x rows `rows` (N, V)."""
        vocab = x.shape[1]
        dev = x.device
        row_idx = torch.tensor(rows, device=dev)
        sub = x.index_select(0, row_idx)  # (P, V)
        out_counts = torch.zeros_like(sub)
        seen = torch.zeros(sub.shape, dtype=torch.bool, device=dev)
        for j, r in enumerate(reqs):
            out_ids = torch.tensor(r.output_ids, dtype=torch.long, device=dev)
            if out_ids.numel():
                out_counts[j].index_add_(0, out_ids, torch.ones(out_ids.shape, device=dev))
            seen[j, torch.tensor(r.token_ids, dtype=torch.long, device=dev).clamp_(0, vocab - 1)] = True
        rep = torch.tensor([r.sampling.repetition_penalty for r in reqs], device=dev)[:, None]
        pres = torch.tensor([r.sampling.presence_penalty for r in reqs], device=dev)[:, None]
        freq = torch.tensor([r.sampling.frequency_penalty for r in reqs], device=dev)[:, None]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen, penalised, sub)
        sub = sub - freq * out_counts - pres * (out_counts > 0).to(sub.dtype)
        x.index_copy_(0, row_idx, sub)

    def _suppress_early_stops(self, x: torch.Tensor, reqs: Sequence[Request], shared: bool) -> torch.Tensor:
        rows: list[int] = []
        cols: list[int] = []
        vocab = x.shape[1]
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.stopping.min_new_tokens:
                stops = set(r.stopping.stop_token_ids)
                if not r.stopping.ignore_eos:
                    stops |= r.eos_ids
                for t in stops:
                    if t < vocab:
                        rows.append(i)
                        cols.append(t)
        if not rows:
            return x
        if shared:
            x = x.clone()
        x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")
        return x

    def _draw(self, x: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """x: (S, V) processed logits of the sampling rows → (S,) token ids."""
        dev = x.device
        temp = torch.tensor([r.sampling.temperature for r in reqs], device=dev)[:, None]
        x = x / temp
        top_k = [r.sampling.top_k for r in reqs]
        top_p = [r.sampling.top_p for r in reqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = self._top_k_top_p(x, top_k, top_p)
        probs = torch.softmax(x, dim=-1)
        min_p = [r.sampling.min_p for r in reqs]
        if any(m > 0 for m in min_p):
            thresh = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(reqs) if r.sampling.seed is None]
        if unseeded:
            noise = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_(
                generator=self.generator
            )
            q[torch.tensor(unseeded, device=dev)] = noise
        for j, r in enumerate(reqs):
            if r.sampling.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.sampling.seed)
                q[j].exponential_(generator=r.generator)
        return (probs / q.clamp_min_(1e-20)).max(dim=-1).indices

    @staticmethod
    def _top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        dev = x.device
        vocab = x.shape[1]
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # (S, V)
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)[:, None]
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= k
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        p = torch.tensor(top_p, device=dev)[:, None]
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        drop = drop | ((before >= p) & (ranks > 0))
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)

    @staticmethod
    def _logprobs(
        raw: torch.Tensor,
        tokens: torch.Tensor,
        reqs: Sequence[Request],
        rows: list[int],
        out: list[TokenLogprob | None],
    ) -> None:
        dev = raw.device
        idx = torch.tensor(rows, device=dev)
        lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)  # (R, V)
        chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0].tolist()
        k = max(reqs[i].sampling.logprobs for i in rows)
        top_vals, top_ids = lp.topk(k, dim=-1)
        top_vals_l = top_vals.tolist()
        top_ids_l = top_ids.tolist()
        for j, i in enumerate(rows):
            n = reqs[i].sampling.logprobs
            out[i] = TokenLogprob(chosen[j], top_ids_l[j][:n], top_vals_l[j][:n])
