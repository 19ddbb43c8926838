"""Tokenizer core: text or chat messages → token ids, for one local Hugging Face model directory.

Knows nothing of gRPC. The tokenizer is what `AutoTokenizer.from_pretrained(dir)` builds for the model's
class; ids come from its Rust backend, batched (`tokenize_many`: each job's ids or its `InvalidInput`).
Special tokens around a text follow tokenizer_config.json's `add_bos_token` / `add_eos_token` where set,
else tokenizer.json's post-processor (`follow_config`); a prompt never starts with bos twice. Chat
templates render as transformers renders them and the text is encoded without special tokens again, so
ids equal `AutoTokenizer.apply_chat_template(..., tokenize=True)`; `chat_message` and `parse_tools` turn
OpenAI's wire form into transformers' convention. The ids that end a generation are
`models.eos_token_ids`, the rule the engine stops by. Details: docs/architecture.md ("Tokenizer").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from services.common.models import eos_token_ids, model_name

# Special-token roles named in tokenizer_config.json, in the order Info lists them.
SPECIAL_ROLES = ("bos", "eos", "pad", "unk")


class InvalidInput(ValueError):
    """The request cannot be tokenized as asked; the message says why (shown to the caller)."""


@dataclass(frozen=True)
class SpecialToken:
    name: str  # bos, eos, pad, unk, or the token's own text for others
    text: str
    id: int


@dataclass(frozen=True)
class Truncation:
    """How to fit the ids into the limit (`max_tokens`, else the context length): side is "" (too
    long is an error), "left" (keep the last ids) or "right" (keep the first ids)."""

    side: str = ""
    max_tokens: int = 0  # 0 = the model's context length


@dataclass(frozen=True)
class TokenizeJob:
    """One request: `text`, or `messages` (template messages, see `chat_message`) and optional `tools`
    for the chat template."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    truncation: Truncation = Truncation()


@dataclass(frozen=True)
class Encoded:
    ids: list[int]
    truncated: bool


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _parse_json(text: str, what: str) -> Any:
    """The JSON value of a field's text; InvalidInput naming the field when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not JSON: {exc}") from None


def _json_or_text(text: str) -> Any:
    """The JSON value of `text`, or `text` itself when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _tool_call(raw: Any, where: str) -> dict[str, Any]:
    """One OpenAI tool call as a template sees it: `function.arguments` decoded from its JSON text
    (empty or missing = `{}`; text that is not JSON stays the string it is)."""
    function = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidInput(f"{where} must be an object with function.name")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments.strip():
        arguments = _json_or_text(arguments)
    elif arguments is None or arguments == "":
        arguments = {}
    call: dict[str, Any] = {"id": raw["id"]} if isinstance(raw.get("id"), str) else {}
    call["type"] = raw.get("type", "function")
    call["function"] = {"name": function["name"], "arguments": arguments}
    return call


def chat_message(
    role: str,
    content: str | None,
    *,
    name: str = "",
    tool_call_id: str = "",
    tool_calls_json: str = "",
    where: str = "message",
) -> dict[str, Any]:
    """One message of an OpenAI chat history in the form chat templates read (transformers'
    convention). `content` None stays None (null) only on an assistant turn that calls tools; elsewhere
    it is "". `name`, `tool_call_id` and `tool_calls` appear only when given. `tool_calls_json` is the
    OpenAI `tool_calls` array as JSON text. Raises InvalidInput naming `where` when it is malformed."""
    message: dict[str, Any] = {"role": role}
    tool_calls: list[dict[str, Any]] = []
    if tool_calls_json:
        raw = _parse_json(tool_calls_json, f"{where}.tool_calls")
        if not isinstance(raw, list):
            raise InvalidInput(f"{where}.tool_calls must be an array")
        tool_calls = [_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(raw)]
    message["content"] = content if content is not None or tool_calls else ""
    if name:
        message["name"] = name
    if tool_call_id:
        message["tool_call_id"] = tool_call_id
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def parse_tools(tools_json: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tools` array from its JSON text, for the template (`""` or `[]` = None: no tools).
    Raises InvalidInput unless it is an array of objects."""
    if not tools_json:
        return None
    tools = _parse_json(tools_json, "tools")
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise InvalidInput("tools must be an array of objects")
    return tools or None


def _pick_chat_template(hf: PreTrainedTokenizerBase, model_dir: Path) -> str | None:
    """The tokenizer's chat template (tokenizer_config.json or chat_template.jinja), else the one of
    chat_template.json (where multimodal repositories keep it for their processor); of a set of named
    templates, the one named `default`."""
    template: Any = hf.chat_template
    if not template:
        template = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def load_backend(model_dir: Path) -> tuple[PreTrainedTokenizerBase, Tokenizer]:
    """`AutoTokenizer.from_pretrained(model_dir)` (local files only) and its Rust backend, with
    padding and truncation off. Raises FileNotFoundError when the directory has no tokenizer and
    ValueError when transformers builds one without a Rust backend."""
    try:
        hf = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except OSError as exc:
        raise FileNotFoundError(f"{model_dir}: no tokenizer transformers can load ({exc})") from exc
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"{model_dir}: {type(hf).__name__} has no Rust (tokenizers) backend")
    backend.no_padding()
    backend.no_truncation()
    return hf, backend


def _adds(backend: Tokenizer) -> tuple[int | None, int | None]:
    """The first and last id `encode(add_special_tokens=True)` adds around a text (None: none)."""
    plain = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a", add_special_tokens=True).ids
    at = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
    before, after = full[:at], full[at + len(plain) :]
    return (before[0] if before else None), (after[-1] if after else None)


def follow_config(
    backend: Tokenizer, tok_config: dict[str, Any], bos_id: int | None, eos_id: int | None
) -> None:
    """Makes `encode(add_special_tokens=True)` add bos and eos as tokenizer_config.json's
    `add_bos_token` and `add_eos_token` say, where they are set (Gemma, Llama and Mistral set
    add_bos_token) and tokenizer.json's post-processor does otherwise. Unset, the post-processor rules.
    Chat prompts are not affected: they are encoded without special tokens (the template writes them)."""
    has_bos, has_eos = _adds(backend)
    want_bos, want_eos = tok_config.get("add_bos_token"), tok_config.get("add_eos_token")
    bos = has_bos if not isinstance(want_bos, bool) else (bos_id if want_bos else None)
    eos = has_eos if not isinstance(want_eos, bool) else (eos_id if want_eos else None)
    if (bos, eos) == (has_bos, has_eos):
        return
    tokens = {i: backend.id_to_token(i) for i in (bos, eos) if i is not None}
    first = f"{tokens[bos]} " if bos is not None else ""
    last = f" {tokens[eos]}" if eos is not None else ""
    backend.post_processor = processors.TemplateProcessing(
        single=f"{first}$A:0{last}",
        pair=f"{first}$A:0{last} {first}$B:1{last}",
        special_tokens=[(text, i) for i, text in tokens.items()],
    )


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` in templates, refusing underscore attributes as transformers does."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")
        super().__setitem__(name, value)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles a chat template in an environment configured like transformers'."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


class TokenizerCore:
    """Tokenizes for one model directory. Thread-safe for concurrent `encode_batch` calls (the
    underlying `tokenizers.Tokenizer` is immutable after loading)."""

    def __init__(self, model_dir: Path | str) -> None:
        self.model_dir = Path(model_dir)
        hf, self.tokenizer = load_backend(self.model_dir)
        tok_config = _read_json(self.model_dir / "tokenizer_config.json")
        model_config = _read_json(self.model_dir / "config.json")
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.context_length = self._context_length(model_config, tok_config)
        self.chat_template = _pick_chat_template(hf, self.model_dir)
        # The special tokens a template sees (`bos_token`, `eos_token`, ...): the tokenizer's
        # `special_tokens_map`, as `apply_chat_template` passes it.
        self.template_vars = {
            name: text for name, text in hf.special_tokens_map.items() if isinstance(text, str)
        }
        self.special_tokens = self._special_tokens()
        self.bos_token_id = self._role_id("bos")
        self.eos_token_ids = eos_token_ids(self.model_dir, self._role_id("eos"))
        follow_config(self.tokenizer, tok_config, self.bos_token_id, self._role_id("eos"))
        self.generation_prompt = self._generation_prompt()

    # ---- model facts -------------------------------------------------------------------------

    @staticmethod
    def _context_length(model_config: dict[str, Any], tok_config: dict[str, Any]) -> int:
        for value in (model_config.get("max_position_embeddings"), tok_config.get("model_max_length")):
            if isinstance(value, int) and 0 < value < 10**8:
                return value
        return 0

    def _special_tokens(self) -> list[SpecialToken]:
        out: list[SpecialToken] = []
        seen: set[int] = set()
        for role in SPECIAL_ROLES:
            text = self.template_vars.get(f"{role}_token")
            token_id = self.tokenizer.token_to_id(text) if text is not None else None
            if text is not None and token_id is not None:
                out.append(SpecialToken(role, text, token_id))
                seen.add(token_id)
        for token_id, added in sorted(self.tokenizer.get_added_tokens_decoder().items()):
            if added.special and token_id not in seen:
                out.append(SpecialToken(added.content, added.content, token_id))
        return out

    def _role_id(self, role: str) -> int | None:
        """The id of the tokenizer's `ROLE_token` (bos, eos, ...), None when it has none."""
        text = self.template_vars.get(f"{role}_token")
        return self.tokenizer.token_to_id(text) if text is not None else None

    def _generation_prompt(self) -> str:
        """What the template appends for `add_generation_prompt`: the difference between a one-turn
        chat rendered with and without it ("" without a template, or when the one does not start with
        the other)."""
        if self.chat_template is None:
            return ""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            bare = self.render_chat(probe, add_generation_prompt=False)
            opened = self.render_chat(probe, add_generation_prompt=True)
        except InvalidInput:
            return ""
        return opened[len(bare) :] if opened.startswith(bare) else ""

    @property
    def model_name(self) -> str:
        return model_name(self.model_dir)

    # ---- requests ----------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The conversation (template messages, see `chat_message`) and its `tools` rendered with the
        model's chat template. Raises InvalidInput when the model has none, the conversation is empty,
        or the template rejects it (its own exception, or a value it cannot combine, such as a null
        content it adds to text)."""
        if self.chat_template is None:
            raise InvalidInput(f"model {self.model_name!r} has no chat template; send text instead")
        if not messages:
            raise InvalidInput("chat has no messages")
        template = compile_chat_template(self.chat_template)
        try:
            return template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.template_vars,
            )
        except (jinja2.exceptions.TemplateError, TypeError) as exc:
            raise InvalidInput(f"chat template rejected the conversation: {exc}") from exc

    def limit(self, truncation: Truncation) -> int:
        """The most ids a request may have: `max_tokens`, else the context length (0 = no limit)."""
        if truncation.max_tokens and self.context_length and truncation.max_tokens > self.context_length:
            raise InvalidInput(
                f"max_tokens {truncation.max_tokens} exceeds the model's context length {self.context_length}"
            )
        return truncation.max_tokens or self.context_length

    def fit(self, ids: list[int], truncation: Truncation) -> Encoded:
        """Applies the length limit: truncates on the asked side, or raises InvalidInput naming the
        numbers. Empty ids are invalid."""
        if not ids:
            raise InvalidInput("input encodes to no tokens")
        limit = self.limit(truncation)
        if not limit or len(ids) <= limit:
            return Encoded(ids, False)
        if truncation.side == "left":
            return Encoded(ids[-limit:], True)
        if truncation.side == "right":
            return Encoded(ids[:limit], True)
        what = "max_tokens" if truncation.max_tokens else "the model's context length"
        raise InvalidInput(
            f"input is {len(ids)} tokens, more than {limit} ({what}); shorten it or ask for truncation"
        )

    def encode_batch(self, texts: Sequence[str], *, add_special_tokens: bool) -> list[list[int]]:
        """Token ids of each text (in the caller's order)."""
        if len(texts) == 1:  # no thread-pool round trip for a lone text
            return [self.encode(texts[0], add_special_tokens=add_special_tokens)]
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        return [self._one_bos(e.ids) for e in encodings]

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return self._one_bos(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def _one_bos(self, ids: list[int]) -> list[int]:
        """`ids` with a doubled bos at the start made single (the tokenizer added one to a text or a
        rendered prompt that already began with it): a prompt never starts with bos twice."""
        bos = self.bos_token_id
        return ids[1:] if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos else ids

    def tokenize_many(self, jobs: Sequence[TokenizeJob]) -> list[Encoded | InvalidInput]:
        """Tokenizes a batch of requests with one `encode_batch` per add_special_tokens value. Each
        result is the job's ids, or the InvalidInput that explains why it has none."""
        results: list[Encoded | InvalidInput | None] = [None] * len(jobs)
        groups: dict[bool, list[tuple[int, str]]] = {True: [], False: []}
        for i, job in enumerate(jobs):
            try:
                text, add_special = self._prepare(job)
            except InvalidInput as exc:
                results[i] = exc
                continue
            groups[add_special].append((i, text))
        for add_special, members in groups.items():
            if not members:
                continue
            all_ids = self.encode_batch([text for _, text in members], add_special_tokens=add_special)
            for (i, _), ids in zip(members, all_ids, strict=True):
                try:
                    results[i] = self.fit(ids, jobs[i].truncation)
                except InvalidInput as exc:
                    results[i] = exc
        return [r for r in results if r is not None]

    def _prepare(self, job: TokenizeJob) -> tuple[str, bool]:
        """The text to encode and whether to add special tokens (never for chat: the template did)."""
        if job.messages is not None:
            prompt = job.add_generation_prompt
            return self.render_chat(job.messages, add_generation_prompt=prompt, tools=job.tools), False
        if not job.text:
            raise InvalidInput("empty input: give a non-empty text or a chat")
        return job.text, job.add_special_tokens
