"""The tokenizer side of each model family (tests/tokenizer/families.py): the family's chat template
rendered as transformers renders it, bos once, the eos list the engine stops by, special tokens kept
out of text, and what the gateway learns of the template (Info)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from services.common.models import eos_token_ids, tokenizer_eos_id
from services.detokenizer.incremental import DecodeState, Vocabulary
from services.tokenizer.core import TokenizeJob, TokenizerCore, chat_message, parse_tools
from tests.tokenizer.families import FAMILIES, family_tokenizer_dir, token_id

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris? \u4e16\u754c \U0001f600"},
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ],
]
BOS = {"gemma": "<bos>", "llama3": "<|begin_of_text|>", "mistral": "<s>"}
EOS = {
    "gemma": ["<eos>", "<end_of_turn>"],
    "llama3": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    "qwen3": ["<|im_end|>", "<|endoftext|>"],
    "qwen3_thinking": ["<|im_end|>", "<|endoftext|>"],
    "mistral": ["</s>"],
}
TOOL_FAMILIES = ("llama3", "qwen3", "mistral")


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    family = str(request.param)
    return family, family_tokenizer_dir(family, tmp_path_factory.mktemp(family))


def _tool_history() -> list[dict[str, object]]:
    function = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    call = json.dumps([{"id": "call_1", "type": "function", "function": function}])
    return [
        chat_message("user", "What is the weather in Paris?"),
        chat_message("assistant", None, tool_calls_json=call),
        chat_message("tool", "sunny", tool_call_id="call_1"),
    ]


def test_chat_template_renders_as_transformers(family_dir: tuple[str, Path]) -> None:
    family, path = family_dir
    core = TokenizerCore(path)
    hf = AutoTokenizer.from_pretrained(path)
    cases: list[tuple[list[dict[str, object]], list[dict[str, object]] | None]] = [
        (c, None) for c in CONVERSATIONS
    ]
    if family in TOOL_FAMILIES:
        cases += [(CONVERSATIONS[0], TOOLS), (_tool_history(), TOOLS)]
    for messages, tools in cases:
        for add_generation_prompt in (True, False):
            want = hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            want_ids = hf.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
            job = TokenizeJob(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt)
            assert (
                core.render_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools) == want
            )
            [got] = core.tokenize_many([job])
            assert not isinstance(got, Exception), got
            assert got.ids == list(want_ids)


def test_text_ids_equal_transformers(family_dir: tuple[str, Path]) -> None:
    _, path = family_dir
    core, hf = TokenizerCore(path), AutoTokenizer.from_pretrained(path)
    for text in ("Hello world, what is 12345?", "caf\u00e9 \U0001f600\n\n  x"):
        for add in (True, False):
            assert core.encode(text, add_special_tokens=add) == hf(text, add_special_tokens=add)["input_ids"]


def test_bos_exactly_once(family_dir: tuple[str, Path]) -> None:
    """Families with a bos (Gemma needs it) get exactly one, in chat (the template writes it) and in text
    (the tokenizer adds it), even when the text already begins with it; the others get none."""
    family, path = family_dir
    core = TokenizerCore(path)
    [chat] = core.tokenize_many([TokenizeJob(messages=CONVERSATIONS[1])])
    assert not isinstance(chat, Exception)
    text = core.encode("Hello", add_special_tokens=True)
    if family not in BOS:
        assert core.bos_token_id is None
        return
    bos = token_id(path, BOS[family])
    assert core.bos_token_id == bos
    for ids in (chat.ids, text, core.encode(BOS[family] + "Hello", add_special_tokens=True)):
        assert ids[0] == bos and ids[1] != bos
        assert ids.count(bos) == 1


def test_eos_list_from_generation_config_agrees_with_the_engine(family_dir: tuple[str, Path]) -> None:
    family, path = family_dir
    core = TokenizerCore(path)
    want = [token_id(path, t) for t in EOS[family]]
    assert core.eos_token_ids[: len(want)] == want
    # The engine's stop rule (model_runner.read_eos_ids) is the same function, with the same eos token.
    assert eos_token_ids(path, tokenizer_eos_id(path)) == core.eos_token_ids


def test_special_tokens_kept_out_of_text(family_dir: tuple[str, Path]) -> None:
    """A generated turn decoded with skip_special_tokens has no turn markers or eos."""
    family, path = family_dir
    core = TokenizerCore(path)
    vocab = Vocabulary.from_model_dir(path)
    turn = core.render_chat(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sunny today."}],
        add_generation_prompt=False,
    )
    generated = [*core.encode(turn, add_special_tokens=False), core.eos_token_ids[0]]
    text = vocab.decode(generated, skip_special_tokens=True)
    assert "Sunny today." in text
    for special in core.special_tokens:
        assert special.text not in text, (family, special.text)
    assert core.eos_token_ids[0] in vocab.special_ids


def test_generation_prompt(family_dir: tuple[str, Path]) -> None:
    family, path = family_dir
    want = {
        "gemma": "<start_of_turn>model\n",
        "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "qwen3": "<|im_start|>assistant\n",
        "qwen3_thinking": "<|im_start|>assistant\n<think>\n",
        "mistral": "",
    }
    assert TokenizerCore(path).generation_prompt == want[family]


@pytest.mark.parametrize(
    ("add_bos_token", "post_processor_bos", "want_bos"),
    [(True, False, True), (False, True, False), (None, True, True), (None, False, False)],
)
def test_add_bos_token_in_the_config_decides(
    tmp_path: Path, add_bos_token: bool | None, post_processor_bos: bool, want_bos: bool
) -> None:
    """`add_bos_token` set in tokenizer_config.json decides whether a text gets bos, whatever
    tokenizer.json's post-processor does; unset, the post-processor decides."""
    path = family_tokenizer_dir("gemma", tmp_path / "m")
    if not post_processor_bos:
        tokenizer = json.loads((path / "tokenizer.json").read_text())
        tokenizer["post_processor"] = None
        (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("add_bos_token")
    if add_bos_token is not None:
        config["add_bos_token"] = add_bos_token
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    core = TokenizerCore(path)
    ids = core.encode("Hello", add_special_tokens=True)
    assert (ids[0] == token_id(path, "<bos>")) is want_bos
    assert core.encode("Hello", add_special_tokens=False)[0] != token_id(path, "<bos>")


def test_chat_template_json_file(tmp_path: Path) -> None:
    """A template shipped only as chat_template.json (multimodal repositories keep it there for their
    processor, which AutoTokenizer does not read) is the one used."""
    path = family_tokenizer_dir("qwen3", tmp_path / "m")
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    core = TokenizerCore(path)
    assert core.render_chat([{"role": "user", "content": "q"}], add_generation_prompt=True) == "<<q>>"


def test_tools_reach_the_template(tmp_path: Path) -> None:
    path = family_tokenizer_dir("mistral", tmp_path / "m")
    core = TokenizerCore(path)
    text = core.render_chat(
        [{"role": "user", "content": "Weather?"}],
        add_generation_prompt=True,
        tools=parse_tools(json.dumps(TOOLS)),
    )
    assert text.startswith("<s>[AVAILABLE_TOOLS][{") and "get_weather" in text


def test_a_parsers_marks_are_kept_while_other_special_tokens_are_skipped(tmp_path: Path) -> None:
    """Mistral's [TOOL_CALLS] and [ARGS] are special tokens: the detokenizer keeps the ids it is asked
    to keep (the tool-call parser's marks) and still skips the rest (eos)."""
    path = family_tokenizer_dir("mistral", tmp_path / "m")
    core, vocab = TokenizerCore(path), Vocabulary.from_model_dir(path)
    marks = [token_id(path, "[TOOL_CALLS]"), token_id(path, "[ARGS]")]
    written = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    ids = [*core.encode(written, add_special_tokens=False), token_id(path, "</s>")]
    assert marks[0] == ids[0] and marks[1] in ids
    kept = DecodeState(vocab, skip_special_tokens=True, keep_special_ids=marks)
    assert kept.add(ids) + kept.close() == written
    skipped = DecodeState(vocab, skip_special_tokens=True)
    assert skipped.add(ids) + skipped.close() == 'get_weather{"city": "Paris"}'
