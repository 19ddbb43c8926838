"""The core's ids equal `AutoTokenizer.from_pretrained(dir)`'s for Llama, Qwen2 and Mistral directories,
also where `tokenizer.json`'s pre-tokenizer differs from the default of the model's tokenizer class
(transformers builds Qwen2's own pre-tokenizer then)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from services.tokenizer.core import Encoded, TokenizeJob, TokenizerCore
from tests.conftest import TinyModelFactory
from tests.tokenizer.conftest import variant_dir

TEXTS = [
    "Hello   world!! It's 12345 times 😀 世界\n\n  café's THE end.  ",
    "x",
    "  leading spaces, tabs\tand\r\nCRLF lines\n\n\n",
    "ABC's DEF'll 3.14159 <|im_start|>user\nhi<|im_end|>",
]

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Wie geht's? 1234 😀"}]

# Splits on whitespace only: unlike the ByteLevel regex of the project's tokenizer.json and unlike the
# pattern Qwen2's tokenizer class sets.
WHITESPACE_PRE_TOKENIZER = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "WhitespaceSplit"},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": False},
    ],
}


def _qwen2_edited(factory: TinyModelFactory, dst: Path) -> Path:
    path = variant_dir(factory(arch="qwen2"), dst)
    tokenizer_json = json.loads((path / "tokenizer.json").read_text())
    tokenizer_json["pre_tokenizer"] = WHITESPACE_PRE_TOKENIZER
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    return path


@pytest.fixture(params=["llama", "qwen2", "mistral", "qwen2-edited-pre-tokenizer"])
def arch_dir(
    request: pytest.FixtureRequest, tiny_model_dir_factory: TinyModelFactory, tmp_path: Path
) -> Path:
    if request.param == "qwen2-edited-pre-tokenizer":
        return _qwen2_edited(tiny_model_dir_factory, tmp_path / "qwen2-edited")
    return tiny_model_dir_factory(arch=request.param)


def _ids(results: list[Encoded | Exception]) -> list[list[int]]:
    assert all(isinstance(r, Encoded) for r in results), results
    return [r.ids for r in results if isinstance(r, Encoded)]


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_text_ids_equal_auto_tokenizer(arch_dir: Path, add_special_tokens: bool) -> None:
    core = TokenizerCore(arch_dir)
    hf = AutoTokenizer.from_pretrained(arch_dir)
    want = [hf(text, add_special_tokens=add_special_tokens)["input_ids"] for text in TEXTS]
    jobs = [TokenizeJob(text=text, add_special_tokens=add_special_tokens) for text in TEXTS]
    assert _ids(core.tokenize_many(jobs)) == want  # batched
    assert [core.encode(text, add_special_tokens=add_special_tokens) for text in TEXTS] == want  # one by one


def test_chat_ids_equal_auto_tokenizer(arch_dir: Path) -> None:
    core = TokenizerCore(arch_dir)
    hf = AutoTokenizer.from_pretrained(arch_dir)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert _ids(core.tokenize_many([TokenizeJob(messages=MESSAGES)])) == [list(want)]


def test_edited_pre_tokenizer_changes_the_raw_file_ids(
    tiny_model_dir_factory: TinyModelFactory, tmp_path: Path
) -> None:
    """The edited directory is a real case: its raw `tokenizer.json` and transformers disagree."""
    path = _qwen2_edited(tiny_model_dir_factory, tmp_path / "qwen2-edited")
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    hf = AutoTokenizer.from_pretrained(path)
    assert raw.encode(TEXTS[0]).ids != hf(TEXTS[0])["input_ids"]
