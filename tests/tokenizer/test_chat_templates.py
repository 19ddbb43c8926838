"""Chat templates rendered by the core equal `AutoTokenizer.apply_chat_template`, for templates that
use what transformers' Jinja environment offers (trim_blocks, lstrip_blocks, loop controls,
raise_exception, namespace, tojson, bos/eos variables)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.tokenizer.core import InvalidInput, TokenizerCore
from tests.tokenizer.conftest import variant_dir

LLAMA2_STYLE = """{% if messages[0]['role'] == 'system' %}
    {% set loop_messages = messages[1:] %}
    {% set system_message = messages[0]['content'] %}
{% else %}
    {% set loop_messages = messages %}
    {% set system_message = false %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {% if loop.index0 == 0 and system_message != false %}
        {% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}
    {% else %}
        {% set content = message['content'] %}
    {% endif %}
    {% if message['role'] == 'user' %}
        {{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}
    {% elif message['role'] == 'assistant' %}
        {{ ' '  + content.strip() + ' ' + eos_token }}
    {% endif %}
{% endfor %}"""

NAMESPACE_LOOPCONTROLS = """{%- set ns = namespace(count=0) -%}
{%- for m in messages -%}
  {%- if m['role'] == 'skip' -%}{%- continue -%}{%- endif -%}
  {%- set ns.count = ns.count + 1 -%}
  <|im_start|>{{ m['role'] }} #{{ ns.count }}
{{ m['content'] | trim }}<|im_end|>
  {%- if ns.count >= 4 -%}{%- break -%}{%- endif %}

{% endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant {{ {'n': ns.count, 'é': 'ü'} | tojson }}
{% endif -%}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Why is the sky blue?  "},
        {"role": "assistant", "content": "Rayleigh scattering."},
        {"role": "user", "content": "世界 😀"},
    ],
    [{"role": "user" if i % 2 == 0 else "assistant", "content": c} for i, c in enumerate("abcde")],
]

NS_CONVERSATIONS = [
    [
        {"role": "user", "content": " x "},
        {"role": "skip", "content": "hidden"},
        {"role": "assistant", "content": "y\n"},
    ],
    [{"role": "user", "content": str(i)} for i in range(6)],
]


@pytest.mark.parametrize(
    ("template", "conversations"),
    [(LLAMA2_STYLE, CONVERSATIONS), (NAMESPACE_LOOPCONTROLS, NS_CONVERSATIONS)],
    ids=["llama2", "namespace"],
)
def test_matches_transformers(
    model_dir: Path, tmp_path: Path, template: str, conversations: list[list[dict[str, str]]]
) -> None:
    path = variant_dir(model_dir, tmp_path / "m", chat_template=template)
    core = TokenizerCore(path)
    hf = AutoTokenizer.from_pretrained(path)
    for messages in conversations:
        for add_generation_prompt in (True, False):
            want_text = hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            want_ids = hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
            )
            text = core.render_chat(messages, add_generation_prompt=add_generation_prompt)
            assert text == want_text
            assert core.encode(text, add_special_tokens=False) == list(want_ids)


def test_template_exception_is_invalid_input(model_dir: Path, tmp_path: Path) -> None:
    core = TokenizerCore(variant_dir(model_dir, tmp_path / "m", chat_template=LLAMA2_STYLE))
    with pytest.raises(InvalidInput, match="roles must alternate"):
        core.render_chat(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], add_generation_prompt=True
        )


def test_chat_template_jinja_file_wins(model_dir: Path, tmp_path: Path) -> None:
    path = variant_dir(model_dir, tmp_path / "m")
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    core = TokenizerCore(path)
    assert core.render_chat([{"role": "user", "content": "q"}], add_generation_prompt=True) == "[q]"
    hf = AutoTokenizer.from_pretrained(path)
    assert hf.apply_chat_template([{"role": "user", "content": "q"}], tokenize=False) == "[q]"
