"""Turns the logits of one step into one token per sampling request, vectorised over the batch.

Per row, in order: logit bias, penalties (repetition over prompt and output, presence and frequency over
the output), EOS / stop ids suppressed before `min_new_tokens`, the grammar mask (`GrammarBatch.mask_`),
then argmax (greedy) or temperature → top-k → top-p → min-p → a draw, `argmax(probs / q)` with `q ~
Exp(1)` (a seeded request's `q` from its own generator: its tokens never depend on the batch). A step
with no bias or grammar skips their work. Log-probabilities are those of the raw distribution. `launch` never
waits on the device: inputs go by non-blocking copies, results (ids, requested logprobs) come back in one
copy behind an event that `SampleHandle.result()` alone waits for; ids stay on the device
(`SampleHandle.token_ids`) for async scheduling. `verify` samples d + 1 rows per drafted request exactly
as `launch` would and keeps drafts while they match: docs/architecture.md ("Prompt-lookup speculation").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.core.params import TokenLogprob
from services.engine.core.request import PLACEHOLDER, Request
from services.engine.executor.grammar_mask import GrammarBatch


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


@dataclass
class VerifyResult:
    """Per request of a `Sampler.verify` call: the accepted drafts then one more token, and a log-probability
    entry for each of them (None entries when the request did not ask for log-probabilities)."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprob | None]]


@dataclass
class _LogprobLayout:
    """Where the log-probabilities sit in the packed result: rows `rows` asked for them, k columns each."""

    rows: list[int]
    k: int
    wanted: list[int]  # per row of `rows`, how many top entries the request asked for


class SampleHandle:
    """One step's sampling, launched on the device. `token_ids`: (N,) int64 on the device, row i for
    request i; `result()` blocks until the one device→host copy of the step has landed and returns the
    host values (once; later calls return the same object)."""

    def __init__(
        self,
        token_ids: torch.Tensor,
        packed: torch.Tensor,
        n: int,
        layout: _LogprobLayout | None,
    ) -> None:
        self.token_ids = token_ids
        self._n = n
        self._layout = layout
        self._event: torch.cuda.Event | None = None
        self._result: SampleResult | None = SampleResult([], []) if n == 0 else None
        if packed.device.type == "cuda" and n:
            host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._host = host
        else:
            self._host = packed

    def result(self) -> SampleResult:
        if self._result is None:
            if self._event is not None:
                self._event.synchronize()
            self._result = self._unpack(self._host.tolist())
        return self._result

    def _unpack(self, values: list) -> SampleResult:
        n = self._n
        tokens = [int(t) for t in values[:n]]
        logprobs: list[TokenLogprob | None] = [None] * n
        layout = self._layout
        if layout is not None:
            r, k = len(layout.rows), layout.k
            chosen = values[n : n + r]
            top_ids = values[n + r : n + r + r * k]
            top_vals = values[n + r + r * k : n + r + 2 * r * k]
            for j, (i, want) in enumerate(zip(layout.rows, layout.wanted, strict=True)):
                ids = [int(t) for t in top_ids[j * k : j * k + want]]
                logprobs[i] = TokenLogprob(chosen[j], ids, top_vals[j * k : j * k + want])
        return SampleResult(tokens, logprobs)


class Sampler:
    """`grammar`: the engine's mask builder when it serves structured outputs (None: requests with a
    grammar state must not come)."""

    def __init__(self, device: torch.device, seed: int = 0, grammar: GrammarBatch | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self.grammar = grammar

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SampleResult:
        """logits: (N, V), row i for reqs[i]. Launches and waits: `launch(...).result()`."""
        return self.launch(logits, reqs).result()

    def launch(self, logits: torch.Tensor, reqs: Sequence[Request]) -> SampleHandle:
        """Samples one token per row without waiting for the device (see the module docstring).

        Requests with penalties or a grammar need the host values of their output tokens: none may hold
        a placeholder (`Request.prev_row >= 0`) here; the engine reads the previous step's results first."""
        return self._launch(logits, reqs, None)

    def prompt_logprobs(self, logits: torch.Tensor, targets: Sequence[int], k: int) -> SampleHandle:
        """Log-probabilities of prompt tokens under the model's raw distribution, without waiting for the
        device: logits (R, V), row j predicting `targets[j]`; `result().logprobs[j]` holds its log-prob
        and its top-k (0..20) alternatives."""
        n = len(targets)
        if n == 0:
            empty = torch.empty((0,), dtype=torch.long, device=logits.device)
            return SampleHandle(empty, empty, 0, None)
        lp = torch.log_softmax(logits.float(), dim=-1)  # (R, V)
        tokens = self._to_device(list(targets), torch.long)  # (R,)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        return _with_logprobs(tokens, lp, chosen, _LogprobLayout(list(range(n)), k, [k] * n))

    def verify(
        self, logits: torch.Tensor, reqs: Sequence[Request], drafts: Sequence[Sequence[int]]
    ) -> VerifyResult:
        """Verifies drafted tokens (see the module docstring); synchronous, one read-back.

        logits: (sum(len(d) + 1 for d in drafts), V); request i owns len(drafts[i]) + 1 consecutive rows,
        in order, row j being the distribution after its first j drafts. Returns, per request, the
        accepted drafts then one more token (greedy: the argmax of the first row that disagrees with its
        draft, or of the last row; sampling: rejection sampling, exact). A request without drafts gets
        what `launch` would give it. Requests with drafts may have no penalties nor grammar and must be
        past `min_new_tokens` (their rows are processed alone, without the drafts before them)."""
        if len(drafts) != len(reqs):
            raise ValueError(f"{len(reqs)} requests but {len(drafts)} draft lists")
        rows: list[Request] = []
        rewind: dict[int, list[torch.Tensor]] = {}
        for r, d in zip(reqs, drafts, strict=True):
            if d:
                assert not r.sampling.has_penalties, "drafts for a request with penalties"
                assert r.grammar is None, "drafts for a request with a grammar"
                assert r.num_output_tokens >= r.stopping.min_new_tokens, "drafts before min_new_tokens"
                if r.sampling.seed is not None and not r.sampling.greedy:
                    rewind[id(r)] = []
            rows.extend([r] * (len(d) + 1))
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} verification rows")
        out = self._launch(logits, rows, rewind).result()
        tokens: list[list[int]] = []
        logprobs: list[list[TokenLogprob | None]] = []
        start = 0
        for r, d in zip(reqs, drafts, strict=True):
            row_tokens = out.token_ids[start : start + len(d) + 1]
            accepted = 0
            while accepted < len(d) and row_tokens[accepted] == d[accepted]:
                accepted += 1
            tokens.append(row_tokens[: accepted + 1])
            logprobs.append(out.logprobs[start : start + accepted + 1])
            states = rewind.get(id(r))
            if states and accepted < len(d):
                r.generator.set_state(states[accepted])
            start += len(d) + 1
        return VerifyResult(tokens, logprobs)

    def _launch(
        self, logits: torch.Tensor, reqs: Sequence[Request], rewind: dict[int, list[torch.Tensor]] | None
    ) -> SampleHandle:
        """`launch`; `rewind` (verify): its keys are ids of seeded requests whose generator state after
        each of their rows' draws is appended to their list."""
        n = len(reqs)
        if n == 0:
            empty = torch.empty((0,), dtype=torch.long, device=logits.device)
            return SampleHandle(empty, empty, 0, None)
        raw = logits.float()
        if all(r.plain_greedy for r in reqs):
            tokens = raw.max(dim=-1).indices
            return SampleHandle(tokens, tokens, n, None)
        x = self._add_logit_bias(raw, reqs)
        pen_rows = [i for i, r in enumerate(reqs) if r.sampling.has_penalties]
        if pen_rows:
            x = x.clone() if x is raw else x
            self._apply_penalties(x, [reqs[i] for i in pen_rows], pen_rows)
        x = self._suppress_early_stops(x, reqs, x is raw)
        if any(r.grammar is not None for r in reqs):
            assert self.grammar is not None, "a grammar request reached a sampler without a mask builder"
            x = x.clone() if x is raw else x
            self.grammar.mask_(x, [r.grammar for r in reqs])
        tokens = x.max(dim=-1).indices  # (N,) the first maximum, as argmax; faster on CPU
        sampled_rows = [i for i, r in enumerate(reqs) if not r.sampling.greedy]
        if sampled_rows:
            idx = self._to_device(sampled_rows, torch.long)
            sampled = [reqs[i] for i in sampled_rows]
            drawn = self._draw(self._probs(x.index_select(0, idx), sampled), sampled, rewind)
            tokens = tokens.index_copy(0, idx, drawn)
        lp_rows = [i for i, r in enumerate(reqs) if r.sampling.logprobs > 0]
        if not lp_rows:
            return SampleHandle(tokens, tokens, n, None)
        idx = self._to_device(lp_rows, torch.long)
        lp = torch.log_softmax(raw.index_select(0, idx), dim=-1)  # (R, V)
        chosen = lp.gather(1, tokens.index_select(0, idx)[:, None])[:, 0]
        wanted = [reqs[i].sampling.logprobs for i in lp_rows]
        return _with_logprobs(tokens, lp, chosen, _LogprobLayout(lp_rows, max(wanted), wanted))

    def _to_device(self, values: Sequence[float] | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of host values on the sampler's device without a blocking copy (pinned staging
        and a non-blocking copy on CUDA; the pinned block is not reused before the copy has run)."""
        if self.device.type != "cuda":
            return torch.tensor(values, dtype=dtype, device=self.device)
        staged = torch.tensor(values, dtype=dtype, pin_memory=True)
        return staged.to(self.device, non_blocking=True)

    # ---- processors ----------------------------------------------------------------------------

    def _add_logit_bias(self, raw: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """raw (N, V) itself when no request has a logit bias, else a copy with the biases added."""
        rows: list[int] = []
        cols: list[int] = []
        values: list[float] = []
        for i, r in enumerate(reqs):
            for token, bias in r.sampling.logit_bias:
                rows.append(i)
                cols.append(token)
                values.append(bias)
        if not rows:
            return raw
        index = (self._to_device(rows, torch.long), self._to_device(cols, torch.long))
        return raw.index_put(index, self._to_device(values, raw.dtype), accumulate=True)

    def _apply_penalties(self, x: torch.Tensor, reqs: Sequence[Request], rows: list[int]) -> None:
        """In place on x rows `rows` (N, V)."""
        vocab = x.shape[1]
        seen_rows: list[int] = []
        seen_cols: list[int] = []
        out_rows: list[int] = []
        out_cols: list[int] = []
        for j, r in enumerate(reqs):
            assert r.prev_row < 0 and PLACEHOLDER not in r.token_ids, "penalties need the host's tokens"
            seen = {min(max(t, 0), vocab - 1) for t in r.token_ids}
            seen_rows.extend([j] * len(seen))
            seen_cols.extend(seen)
            out = r.output_ids
            out_rows.extend([j] * len(out))
            out_cols.extend(out)
        row_idx = self._to_device(rows, torch.long)
        sub = x.index_select(0, row_idx)  # (P, V)
        seen_mask = torch.zeros(sub.shape, dtype=torch.bool, device=x.device)
        seen_mask[self._to_device(seen_rows, torch.long), self._to_device(seen_cols, torch.long)] = True
        out_counts = torch.zeros_like(sub)
        if out_rows:
            out_idx = (self._to_device(out_rows, torch.long), self._to_device(out_cols, torch.long))
            out_counts.index_put_(out_idx, torch.ones(len(out_rows), device=x.device), accumulate=True)
        values = [
            (r.sampling.repetition_penalty, r.sampling.presence_penalty, r.sampling.frequency_penalty)
            for r in reqs
        ]
        params = self._to_device([v for row in values for v in row], torch.float32).view(len(reqs), 3)
        rep, pres, freq = params[:, 0:1], params[:, 1:2], params[:, 2:3]
        penalised = torch.where(sub > 0, sub / rep, sub * rep)
        sub = torch.where(seen_mask, penalised, sub)
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
        x[self._to_device(rows, torch.long), self._to_device(cols, torch.long)] = float("-inf")
        return x

    def _probs(self, x: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """x: (S, V) logits of the sampling rows after penalties and suppression → (S, V) the
        distribution each row is drawn from: temperature → top-k → top-p → min-p (zeroed, not
        renormalised: the draw does not need it)."""
        s = len(reqs)
        params = self._to_device(
            [v for r in reqs for v in (r.sampling.temperature, r.sampling.top_p, r.sampling.min_p)],
            torch.float32,
        ).view(s, 3)
        x = x / params[:, 0:1]
        top_k = [r.sampling.top_k for r in reqs]
        top_p = [r.sampling.top_p for r in reqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            x = self._top_k_top_p(x, top_k, params[:, 1:2])
        probs = torch.softmax(x, dim=-1)
        if any(r.sampling.min_p > 0 for r in reqs):
            thresh = params[:, 2:3] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < thresh, torch.zeros_like(probs), probs)
        return probs

    def _draw(
        self,
        probs: torch.Tensor,
        reqs: Sequence[Request],
        rewind: dict[int, list[torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        """probs: (S, V) from `_probs` → (S,) token ids, row j drawn with probability proportional to
        probs[j]. `rewind`: see `_launch`."""
        dev = probs.device
        s = len(reqs)
        q = torch.empty_like(probs)
        unseeded = [j for j, r in enumerate(reqs) if r.sampling.seed is None]
        if unseeded:
            noise = torch.empty((len(unseeded), probs.shape[1]), device=dev).exponential_(
                generator=self.generator
            )
            if len(unseeded) == s:
                q = noise
            else:
                q[self._to_device(unseeded, torch.long)] = noise
        for j, r in enumerate(reqs):
            if r.sampling.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.sampling.seed)
                q[j].exponential_(generator=r.generator)
                if rewind and id(r) in rewind:
                    rewind[id(r)].append(r.generator.get_state())
        return (probs / q.clamp_min_(1e-20)).max(dim=-1).indices

    def _top_k_top_p(self, x: torch.Tensor, top_k: list[int], p: torch.Tensor) -> torch.Tensor:
        """x: (S, V); top_k per row (0 = off); p: (S, 1) top-p per row on the device."""
        dev = x.device
        vocab = x.shape[1]
        sorted_x, order = torch.sort(x, dim=-1, descending=True)  # (S, V)
        k = self._to_device([k if 0 < k < vocab else vocab for k in top_k], torch.long)[:, None]
        ranks = torch.arange(vocab, device=dev)[None, :]
        drop = ranks >= k
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        sorted_probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of strictly better tokens
        drop = drop | ((before >= p) & (ranks > 0))
        sorted_x = sorted_x.masked_fill(drop, float("-inf"))
        return torch.empty_like(x).scatter_(1, order, sorted_x)


def _with_logprobs(
    tokens: torch.Tensor, lp: torch.Tensor, chosen: torch.Tensor, layout: _LogprobLayout
) -> SampleHandle:
    """The handle of `tokens` (N,) with the log-probabilities of rows `layout.rows` (`lp`, (R, V); `chosen`,
    (R,) those of their tokens) and their top `layout.k`, packed as float64 [tokens (N), chosen (R), top-k
    ids (R*k), top-k log-probs (R*k)] (ids below 2**53 are exact)."""
    top_vals, top_ids = lp.topk(layout.k, dim=-1)
    parts = (tokens, chosen, top_ids.reshape(-1), top_vals.reshape(-1))
    return SampleHandle(tokens, torch.cat([t.to(torch.float64) for t in parts]), len(tokens), layout)
