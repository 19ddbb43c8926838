"""Byte-level BPE tokenizer for the embedded model, trained with `tokenizers` on the project's corpus.

Special tokens have fixed ids before every learned token: 0 `<pad>`, 1 `<s>` (bos, put in front by the
post-processor with `add_special_tokens=True`; the chat template writes it itself), 2 `</s>` (end of a
plain-text document), 3 `<|im_start|>` and 4 `<|im_end|>` (ChatML turns; `<|im_end|>` is `eos_token`).
`GENERATION_EOS_IDS` = [4, 2] goes to generation_config.json, so chat and plain text both stop.
Invariant: `ByteLevel` pre-tokenizer and decoder, no normalizer, so `decode(encode(text)) == text` for
any Unicode text (combining characters and emoji included).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from sluice.model.corpus import build_corpus

PAD, BOS, EOS_DOC, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, BOS, EOS_DOC, IM_START, IM_END)
PAD_ID, BOS_ID, EOS_DOC_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
GENERATION_EOS_IDS = [IM_END_ID, EOS_DOC_ID]
DEFAULT_VOCAB_SIZE = 8192

# ChatML with a leading bos, and tools in the Hermes style. Rendered with `add_special_tokens=False` (as
# transformers does for chat templates), so bos appears exactly once. A chat without tools and tool calls
# renders as `{bos}<|im_start|>{role}\n{content}<|im_end|>\n`... exactly as the trainer's `render_chat`.
# With `tools` (OpenAI tool objects), a system turn first lists them as JSON lines inside <tools></tools>
# after the conversation's own system message (merged into it). An assistant turn's `tool_calls`
# (transformers' convention: `function.arguments` a dict; a JSON string is written as it is) follow its
# content as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, separated by newlines; a
# `tool` turn wraps its content in <tool_response></tool_response>. A null content renders as nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set system_first = messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{% if system_first and messages[0]['content'] %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{% endif %}"
    "{% for message in messages %}"
    "{% set content = message['content'] | default('', true) %}"
    "{% if tools and loop.first and system_first %}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>tool\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content }}"
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    "{% if content or not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<tool_call>\\n{\"name\": ' + function['name'] | tojson + ', \"arguments\": ' }}"
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}"
    "{{ '}\\n</tool_call>' }}"
    "{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_chat(turns: tuple[tuple[str, str], ...] | list[tuple[str, str]]) -> str:
    """The chat template applied to `(role, content)` turns, without bos and generation prompt."""
    return "".join(f"{IM_START}{role}\n{content}{IM_END}\n" for role, content in turns)


@functools.cache
def _train(vocab_size: int) -> str:
    corpus = build_corpus()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.all_text(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0",
        pair=f"{BOS} $A:0 {BOS}:1 $B:1",
        special_tokens=[(BOS, BOS_ID)],
    )
    return tok.to_str()


def train_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """A fresh byte-level BPE tokenizer trained on the corpus; training runs once per process and
    vocabulary size (the result is cached), each call returns an independent object."""
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be at least 512 (256 bytes + merges), got {vocab_size}")
    tok = Tokenizer.from_str(_train(vocab_size))
    for token, expected in zip(SPECIAL_TOKENS, range(len(SPECIAL_TOKENS)), strict=True):
        assert tok.token_to_id(token) == expected
    return tok


def tokenizer_config(model_max_length: int) -> dict[str, object]:
    """Contents of `tokenizer_config.json` (special tokens, chat template, class)."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END, EOS_DOC],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, out_dir: Path, *, model_max_length: int) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {k: config[k] for k in ("bos_token", "eos_token", "pad_token", "additional_special_tokens")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
