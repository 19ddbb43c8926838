"""Tokenizer directories in the manner of today's model families, made by the tests (no download).

`family_tokenizer_dir(family, out)` writes tokenizer.json, tokenizer_config.json (its chat template,
special tokens, `add_bos_token`), config.json and generation_config.json (an eos list) shaped like a
released model of the family, with a small tokenizer trained here:

- `gemma`: SentencePiece-like (Metaspace, byte fallback), `<bos>` added by the post-processor and
  written by the template, turns `<start_of_turn>ROLE ... <end_of_turn>`, the assistant called
  `model`, eos list `[<eos>, <end_of_turn>]`.
- `llama3`: byte-level BPE, `<|begin_of_text|>` from the post-processor and the template, headers
  `<|start_header_id|>ROLE<|end_header_id|>`, turns end `<|eot_id|>`, tools as JSON in the user turn
  and calls written as `{"name": ..., "parameters": ...}` (the llama3_json format).
- `qwen3`: byte-level BPE, no bos, ChatML, tools in `<tools>` and calls in `<tool_call>` blocks
  (hermes), `<think>` blocks; eos list `[<|im_end|>, <|endoftext|>]`.
- `qwen3_thinking`: as qwen3, but the generation prompt opens `<think>` (as DeepSeek-R1's does).
- `mistral`: SentencePiece-like, `<s>` from the post-processor and the template, `[INST] ... [/INST]`,
  tools in `[AVAILABLE_TOOLS]`, calls written `[TOOL_CALLS][{"name": ..., "arguments": ...}]`.

The templates are written for these tests in each family's manner; they are not the released files.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

FAMILIES = ("gemma", "llama3", "qwen3", "qwen3_thinking", "mistral")

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. What is the weather in Paris today?",
    "The answer is 42. Let me think about it: first the units, then the sum. 12345 + 678 = 13023.",
    'get_weather {"city": "Paris", "unit": "celsius"} name arguments parameters function call result',
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u4e16\u754c \U0001f600 emoji and CJK text, tabs\tand\nnew lines",
]

GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}<end_of_turn>
{% endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\\n' }}
{%- endif -%}"""

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools %}
    {{- 'Environment: ipython\\n' }}
{%- endif %}
{{- system_message }}
{{- '<|eot_id|>' }}
{%- for message in messages %}
    {%- if tools and loop.first and message['role'] == 'user' %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}
        {{- 'Answer with a function call as JSON {"name": function name, "parameters": arguments}.\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- elif message['role'] == 'assistant' and message.tool_calls %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' }}
    {%- elif message['role'] == 'tool' %}
        {{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' }}
        {{- message['content'] | tojson + '<|eot_id|>' }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}"""

QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
    {{- '# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>' }}
    {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
    {{- '\\n</tools>\\n\\nFor each call, return ' }}
    {{- '<tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call>' }}
    {{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' %}
        {%- set content = message.content or '' %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\\n' + content }}
        {%- for call in message.tool_calls or [] %}
            {%- if loop.first and content or not loop.first %}{{- '\\n' }}{%- endif %}
            {{- '<tool_call>\\n{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == 'tool' %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# As QWEN3_TEMPLATE, but the generation prompt opens the think block itself.
QWEN3_THINKING_TEMPLATE = QWEN3_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' }}\n    {%- if enable_thinking",
    "{{- '<|im_start|>assistant\\n<think>\\n' }}\n    {%- if enable_thinking",
)

MISTRAL_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {%- if tools and loop.last %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'system' %}
        {{- '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}
    {%- elif message['role'] == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS][' }}
        {%- for call in message.tool_calls %}
            {{- '{"name": "' + call.function.name + '", "arguments": ' }}
            {{- call.function.arguments | tojson + '}' }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message['role'] == 'assistant' %}
        {{- message['content'] + eos_token }}
    {%- elif message['role'] == 'tool' %}
        {{- '[TOOL_RESULTS]' + message['content'] + '[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception('Only user, system, assistant and tool roles are supported') }}
    {%- endif %}
{%- endfor %}"""


def _specials(names: list[str]) -> list[AddedToken]:
    return [AddedToken(n, special=True, normalized=False) for n in names]


@functools.cache
def _byte_level(specials: tuple[str, ...], extra: tuple[str, ...]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in extra])  # added, not special
    return tok.to_str()


@functools.cache
def _sentencepiece(specials: tuple[str, ...]) -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=list(specials), show_progress=False)
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return json.dumps(data)


def _with_bos(json_text: str, bos: str) -> Tokenizer:
    tok = Tokenizer.from_str(json_text)
    bos_id = tok.token_to_id(bos)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
    )
    return tok


def _family(family: str) -> tuple[Tokenizer, dict[str, Any], list[str], str]:
    """(tokenizer, tokenizer_config fields, generation eos tokens, config eos token) of a family."""
    if family == "gemma":
        specials = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
        tok = _with_bos(_sentencepiece(specials), "<bos>")
        fields = dict(bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
        fields |= dict(add_bos_token=True, add_eos_token=False, chat_template=GEMMA_TEMPLATE)
        return tok, fields, ["<eos>", "<end_of_turn>"], "<eos>"
    if family == "llama3":
        specials = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>")
        specials += ("<|eot_id|>", "<|eom_id|>", "<|python_tag|>")
        tok = _with_bos(_byte_level(specials, ()), "<|begin_of_text|>")
        fields = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", chat_template=LLAMA3_TEMPLATE)
        return tok, fields, ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "<|end_of_text|>"
    if family in ("qwen3", "qwen3_thinking"):
        specials = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
        extra = ("<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>", "</tool_response>")
        tok = Tokenizer.from_str(_byte_level(specials, extra))
        template = QWEN3_TEMPLATE if family == "qwen3" else QWEN3_THINKING_TEMPLATE
        fields = dict(
            bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
        )
        fields |= dict(add_bos_token=False)
        return tok, fields, ["<|im_end|>", "<|endoftext|>"], "<|endoftext|>"
    if family == "mistral":
        specials = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[ARGS]")
        specials += ("[AVAILABLE_TOOLS]",)
        specials += (
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
            "[SYSTEM_PROMPT]",
            "[/SYSTEM_PROMPT]",
        )
        tok = _with_bos(_sentencepiece(specials), "<s>")
        fields = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=MISTRAL_TEMPLATE)
        fields |= dict(add_bos_token=True, add_eos_token=False)
        return tok, fields, ["</s>"], "</s>"
    raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")


MODEL_TYPES = {"gemma": "gemma3_text", "llama3": "llama", "qwen3": "qwen3", "qwen3_thinking": "qwen3"}
MODEL_TYPES["mistral"] = "mistral"


def family_tokenizer_dir(family: str, out: Path) -> Path:
    """Writes a tokenizer directory of `family` (one of FAMILIES) at `out` and returns it."""
    tok, fields, generation_eos, config_eos = _family(family)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(token_id): {"content": t.content, "special": t.special, "normalized": False}
        for token_id, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added}
    config |= {k: v for k, v in fields.items() if v is not None}
    config["model_max_length"] = 4096
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    ids = [tok.token_to_id(t) for t in generation_eos]
    bos = fields.get("bos_token")
    generation = {"eos_token_id": ids, **({"bos_token_id": tok.token_to_id(bos)} if bos else {})}
    (out / "generation_config.json").write_text(json.dumps(generation))
    model = {"model_type": MODEL_TYPES[family], "max_position_embeddings": 4096}
    model["eos_token_id"] = tok.token_to_id(config_eos)
    (out / "config.json").write_text(json.dumps(model))
    return out


def token_id(model_dir: Path, text: str) -> int:
    """The id of an added token of a family directory."""
    found = Tokenizer.from_file(str(model_dir / "tokenizer.json")).token_to_id(text)
    assert found is not None, text
    return found
