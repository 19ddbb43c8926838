"""Workloads of `sluice bench serve`: lists of `BenchRequest` made from a seed (words of the fixed `WORDS`,
about one token each) or read from a file.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_VOCABULARY = """
    the of and to in is was for on that with as by at from his her they this had not are but be have one
    which you were all she there would their we him been has when who will more no if out so said what up
    its about into than them can only other new some time could these two may then do first any my now
    such like our over man me even most made after also did many before must through back years where
    much your way well down should because each just those people how too little state good very make
    world still own see men work long get here between both life being under never day same another know
    while last might us great old year off come since against go came right used take three states
    himself few house use during without again place around however home small found thought went say
    part once general high upon school every left number course war until always away something fact
    though water less public put think almost hand enough far took head yet government system better set
    told nothing night end why called did eyes find going look asked later knew point next program city
    business give group toward young days let room president side social given present several order
    national possible rather second face per among form important often things looked early white case
    john become large big need four within felt along children saw best church ever least power development
    light thing seemed family interest want members mind country area others done turned although open
    god service certain kind problem began different door thus help sense means whole matter perhaps
    itself york times law human line above name example action company hands local show five history
    whether gave either act today feet across taken past quite anything having seen death experience body
    word half really field car words already themselves information tell together college shall money
    period held keep sure probably free seems political real behind question air office making brought
    whose special heard major problems ago became federal moment study available known result street
    economic boy reason change position south board individual job society areas west close turn love
    community true court force full seem policy wife future age voice center woman control common
    necessary following front sometimes six girl clear further land run students provide feeling party
    able mother music education university child effect level stood military short town morning total
    outside rate figure class art century washington north usually plan leave therefore evidence top
    million sound black strong hard various says believe type value play surface soon mean near lines
    table peace modern tax road red book personal process situation minutes increase schools idea english
    alone women gone nor amount doing living private letter basis
"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(_VOCABULARY.split()))


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, sent as a completion prompt (no chat template), or as the one user
    message of a chat."""

    prompt: str
    output_len: int  # max_tokens; with ignore_eos the exact number of tokens asked for
    prompt_len: int = 0  # the dataset's own estimate of prompt tokens (0 when unknown)


def _words(rng: np.random.Generator, count: int) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=count))


def lognormal_lengths(rng: np.random.Generator, num: int, mean: int, sigma: float) -> np.ndarray:
    """`num` integer lengths, log-normal with mean `mean` before clipping to [1, 4 × mean] (sigma 0: all
    `mean`). Shape (num,)."""
    mu = math.log(mean) - sigma * sigma / 2  # E[exp(N(mu, sigma²))] = mean
    values = rng.lognormal(mu, sigma, size=num) if sigma else np.full(num, float(mean))
    return np.clip(np.rint(values), 1, 4 * mean).astype(np.int64)


def synthetic_requests(
    num: int, seed: int, *, input_len: int = 128, output_len: int = 128, sigma: float = 0.5
) -> list[BenchRequest]:
    """`num` requests of random words, prompt and output lengths drawn log-normal around `input_len` and
    `output_len` (sigma of the underlying normal; 0 = fixed lengths). Same arguments, same requests."""
    if num < 1 or input_len < 1 or output_len < 1 or sigma < 0:
        raise ValueError("num and lengths must be at least 1, sigma at least 0")
    rng = np.random.default_rng(seed)
    ins, outs = (lognormal_lengths(rng, num, mean, sigma).tolist() for mean in (input_len, output_len))
    return [BenchRequest(_words(rng, n_in), n_out, n_in) for n_in, n_out in zip(ins, outs, strict=True)]


def shared_prefix_requests(
    num: int,
    seed: int,
    *,
    num_prefixes: int = 4,
    prefix_len: int = 512,
    suffix_len: int = 32,
    output_len: int = 64,
) -> list[BenchRequest]:
    """`num` requests from `num_prefixes` tenants: each tenant has one long context of `prefix_len`
    words, each request is its tenant's context plus a question of its own (`suffix_len` words).
    Tenants take turns, in an order shuffled by the seed."""
    if min(num, num_prefixes, prefix_len, suffix_len, output_len) < 1:
        raise ValueError("every count and length must be at least 1")
    rng = np.random.default_rng(seed)
    prefixes = [_words(rng, prefix_len) for _ in range(num_prefixes)]
    tenants = rng.permutation(np.arange(num) % num_prefixes)
    prompt_len = prefix_len + suffix_len
    return [
        BenchRequest(f"{prefixes[t]}\nquestion: {_words(rng, suffix_len)}", output_len, prompt_len)
        for t in tenants.tolist()
    ]


def _jsonl_request(obj: Any) -> BenchRequest:
    """One parsed line as a request; raises ValueError saying what is wrong."""
    if not isinstance(obj, dict):
        raise ValueError("a line must be a JSON object")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("'prompt' must be a non-empty string")
    key = "output_len" if "output_len" in obj else "max_tokens"
    length = obj.get(key)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError("'output_len' (or 'max_tokens') must be an integer >= 1")
    return BenchRequest(prompt, length)


def jsonl_requests(path: Path) -> list[BenchRequest]:
    """The requests of a JSON Lines file, one object per line: `{"prompt": str, "output_len": int}`
    (or `"max_tokens"` for the length); blank lines are skipped. Raises ValueError naming the line of
    the first bad one, or when the file holds no request."""
    requests = []
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                requests.append(_jsonl_request(json.loads(line)))
            except ValueError as exc:
                raise ValueError(f"{path}, line {number}: {exc}") from None
    if not requests:
        raise ValueError(f"{path}: no requests in the file")
    return requests


def uniform_requests(
    num: int, seed: int, *, prompt_words: tuple[int, int] = (12, 200), output_len: tuple[int, int] = (8, 256)
) -> list[BenchRequest]:
    """`num` requests of random words, prompt words and output tokens uniform in the inclusive ranges
    (the pipeline benchmark's workload). Same arguments, same requests."""
    for lo, hi in (prompt_words, output_len):
        if not 1 <= lo <= hi:
            raise ValueError(f"a length range must satisfy 1 <= min <= max, got {lo}..{hi}")
    if num < 1:
        raise ValueError(f"num must be at least 1, got {num}")
    rng = np.random.default_rng(seed)
    words = rng.integers(prompt_words[0], prompt_words[1] + 1, size=num).tolist()
    outs = rng.integers(output_len[0], output_len[1] + 1, size=num).tolist()
    return [BenchRequest(_words(rng, n), out, n) for n, out in zip(words, outs, strict=True)]
