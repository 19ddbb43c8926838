"""Prompt lookup: proposing a request's next tokens from its own earlier tokens (n-gram speculation).

Outputs often copy spans of their context: an edit repeats most of the text it edits, a summary or an
extraction quotes its source, code repeats identifiers and whole lines, and a small model stuck in a loop
repeats itself. Prompt lookup guesses the next tokens by finding the latest earlier place where the last
n tokens of the request (prompt + output) occurred, and proposing the tokens that followed it there. The
engine then runs the proposals as extra positions of the request's chunk in the same forward pass, and the
sampler keeps the longest prefix the model agrees with plus one token of its own (`Sampler.verify`), so
the output is what the model alone would have produced.

Cost: there is no draft model. A proposal is a host-side search over the request's tokens: one
vectorised comparison of the whole array with its last token, then a filter on the few candidates for
each longer n-gram: about 15 µs for a 2,000-token request once the ids are a numpy array (`TokenMirror`
keeps that array up to date incrementally), about 50 µs when the list is converted on every call. The
real cost is on the device: every proposed token is one more position in the forward pass, and a
rejected one is compute thrown away.

When it pays: at small batches, where a decode step is bound by reading the weights and extra positions
are almost free, on outputs that copy their context (acceptance is high). It does not pay when the
batch already fills the device (extra positions cost as much as real ones) or on free-form text (most
proposals are rejected); the engine gates it on both (batch size, per-request acceptance rate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenMirror:
    """A request's token ids as an int64 numpy array, brought up to date incrementally.

    Contract: between two `update` calls for the same request its token list only grows, except that
    the last entry the previous call saw may have changed (a placeholder replaced by its value). For
    anything else (a list that shrank or was edited further back) use a new mirror."""

    def __init__(self) -> None:
        self._buf = np.empty(0, dtype=np.int64)
        self._n = 0

    def update(self, token_ids: Sequence[int]) -> np.ndarray:
        """The whole of `token_ids` as an array (a view valid until the next call); copies only the
        entries not seen before, and the last one seen."""
        n = len(token_ids)
        if n > len(self._buf):
            grown = np.empty(max(n, 2 * len(self._buf), 64), dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        start = max(0, min(self._n, n) - 1)
        if n > start:
            self._buf[start:n] = token_ids[start:n]
        self._n = n
        return self._buf[:n]


class NgramProposer:
    """Prompt-lookup proposals (see the module docstring). Stateless: one instance serves every request;
    per-request state, if wanted, is a `TokenMirror` the caller keeps and passes in."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if num_tokens < 1 or ngram_min < 1 or ngram_max < ngram_min:
            raise ValueError(
                f"need num_tokens >= 1 and 1 <= ngram_min <= ngram_max, got {num_tokens}, "
                f"{ngram_min}, {ngram_max}"
            )
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(
        self, token_ids: Sequence[int], max_tokens: int, mirror: TokenMirror | None = None
    ) -> list[int]:
        """Up to min(num_tokens, max_tokens) tokens: for n from ngram_max down to ngram_min, find the
        latest earlier occurrence of the last n tokens of `token_ids` (prompt + output) and return the
        tokens that followed it; [] when no n-gram matches (or max_tokens <= 0).

        "Earlier" means the occurrence ends before the last token (the suffix never matches itself; it
        may overlap the occurrence). When the tokens that followed run into the end of `token_ids`, the
        proposal continues the same way, with the period of the repetition (after "a b a b" the 2-gram
        "a b" matched two tokens back proposes "a b a b ..."), up to the same limit.

        `mirror`: the request's `TokenMirror`, to avoid converting the whole list on every call."""
        k = min(self.num_tokens, max_tokens)
        n_tokens = len(token_ids)
        if k <= 0 or n_tokens <= self.ngram_min:
            return []
        if mirror is not None:
            arr = mirror.update(token_ids)
        else:
            arr = np.fromiter(token_ids, dtype=np.int64, count=n_tokens)
        end = self._latest_match_end(arr)
        if end < 0:
            return []
        return _continuation(arr, end, k)

    def _latest_match_end(self, arr: np.ndarray) -> int:
        """The end index of the latest earlier occurrence of the longest matching suffix n-gram
        (ngram_min <= n <= ngram_max), or -1."""
        last = len(arr) - 1
        ends = np.flatnonzero(arr[:last] == arr[last])  # every earlier end of a matching 1-gram
        matched, length = ends, 1
        for n in range(2, min(self.ngram_max, last) + 1):
            # The occurrences of the n-gram are those of the (n-1)-gram preceded by the right token.
            ends = ends[ends >= n - 1]
            ends = ends[arr[ends - (n - 1)] == arr[last - (n - 1)]]
            if not len(ends):
                break
            matched, length = ends, n
        if length < self.ngram_min or not len(matched):
            return -1
        return int(matched[-1])


def _continuation(arr: np.ndarray, end: int, k: int) -> list[int]:
    """k tokens after index `end`, continuing periodically past the end of `arr` (period len(arr)-1-end,
    the distance between the occurrence and the suffix it matched)."""
    out = arr[end + 1 : end + 1 + k].tolist()
    period = len(arr) - 1 - end
    while len(out) < k:
        out.append(out[len(out) - period])
    return out
