"""Workloads of `sluice bench serve`: lists of `BenchRequest` made from a seed (words of the fixed `WORDS`,
about one token each) or read from a file; the output constraints and tools a workload may carry
(`with_structure`), and the checks of an output against them (`check_output`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
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


STRUCTURED_KINDS = ("json_schema", "regex", "choice")


@dataclass(frozen=True)
class Constraint:
    """An output constraint a request carries. `spec` by kind: json_schema, a JSON Schema object;
    regex, a pattern in the syntax Python's `re` and the engine's (Rust) regexes read alike, matched
    against the whole output; choice, a list of strings, one of which is the whole output."""

    kind: str  # one of STRUCTURED_KINDS
    spec: Any
    name: str = ""  # json_schema: the schema's name (OpenAI's json_schema.name)

    @property
    def text(self) -> str:
        """The spec as the gRPC API's `StructuredOutput.text`: the regex, or JSON text."""
        return self.spec if self.kind == "regex" else json.dumps(self.spec, separators=(",", ":"))

    def check(self, output: str) -> bool:
        """Whether `output` satisfies the constraint: JSON that validates against the schema, a full
        match of the regex, or one of the choices."""
        if self.kind == "json_schema":
            return _valid_json(output, self.spec)
        if self.kind == "regex":
            return re.fullmatch(self.spec, output) is not None
        return output in self.spec


@dataclass(frozen=True)
class ToolCall:
    """One call an answer made: the tool's name and its arguments as the JSON text the server sent."""

    name: str
    arguments: str


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload, sent as a completion prompt (no chat template), or as the one user
    message of a chat; with an output constraint, or tools the answer must call (chat only)."""

    prompt: str
    output_len: int  # max_tokens; with ignore_eos the exact number of tokens asked for
    prompt_len: int = 0  # the dataset's own estimate of prompt tokens (0 when unknown)
    constraint: Constraint | None = None
    tools: tuple[dict[str, Any], ...] = ()  # OpenAI function tools; sent with tool_choice "required"


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


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    """A closed JSON object schema whose properties are all required."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _string(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _integer(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


# Fixed constraints, rotated over a workload's requests. Every string and number is bounded, and JSON
# whitespace is bounded by the engine, so each output ends within a few dozen tokens.
WEATHER = ["sunny", "rain", "wind", "snow"]
SCHEMAS = {
    "pet": {"name": _string(12), "kind": {"enum": ["cat", "dog", "fish"]}, "age": _integer(0, 30)},
    "order": {"item": _string(16), "quantity": _integer(1, 99), "express": {"type": "boolean"}},
    "forecast": {"city": _string(16), "tags": {"type": "array", "items": {"enum": WEATHER}, "maxItems": 3}},
}  # fmt: skip
REGEXES = (r"[A-Z][a-z]{2,9} [0-9]{1,3}", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r"(yes|no|maybe), [a-z]{3,12}\.")
CHOICES = (
    ["positive", "negative", "neutral"],
    ["red", "green", "blue", "yellow"],
    ["north", "south", "east", "west"],
)
CONSTRAINTS: dict[str, tuple[Constraint, ...]] = {
    "json_schema": tuple(Constraint("json_schema", _object(props), name) for name, props in SCHEMAS.items()),
    "regex": tuple(Constraint("regex", pattern) for pattern in REGEXES),
    "choice": tuple(Constraint("choice", choices) for choices in CHOICES),
}


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    function = {"name": name, "description": description, "parameters": _object(properties)}
    return {"type": "function", "function": function}


UNITS = ["celsius", "fahrenheit"]
TOOLS: tuple[dict[str, Any], ...] = (
    _tool("get_weather", "The current weather in a city", {"city": _string(20), "unit": {"enum": UNITS}}),
    _tool("get_time", "The current time in a time zone", {"timezone": _string(24)}),
)  # fmt: skip


def with_structure(
    requests: Sequence[BenchRequest], structured: str | None, tools: bool
) -> list[BenchRequest]:
    """`requests` with request i carrying `CONSTRAINTS[structured][i % 3]` (None: no constraint) and,
    when `tools`, the two `TOOLS`."""
    if structured is not None and structured not in CONSTRAINTS:
        raise ValueError(f"unknown constraint {structured!r}; choose from {', '.join(STRUCTURED_KINDS)}")
    pool = CONSTRAINTS[structured] if structured is not None else (None,)
    given = TOOLS if tools else ()
    return [
        dataclasses.replace(r, constraint=pool[i % len(pool)], tools=given) for i, r in enumerate(requests)
    ]


def check_output(request: BenchRequest, text: str, tool_calls: Sequence[ToolCall]) -> bool | None:
    """Whether an answer to `request` is valid: with tools, at least one call, each naming a declared
    tool with arguments that validate against its parameters; with a constraint, `text` satisfies it.
    None when the request asks for neither (nothing to check)."""
    if request.tools:
        declared = {t["function"]["name"]: t["function"]["parameters"] for t in request.tools}
        valid = [c.name in declared and _valid_json(c.arguments, declared[c.name]) for c in tool_calls]
        return bool(valid) and all(valid)
    return None if request.constraint is None else request.constraint.check(text)


def _valid_json(text: str, schema: dict[str, Any]) -> bool:
    """Whether `text` is one JSON value that validates against `schema`."""
    import jsonschema  # a development dependency, needed only when outputs are checked

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)
