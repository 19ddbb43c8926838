"""The embedded model maker: directories load through the ordinary Hugging Face path and behave."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from sluice.model import tiny
from sluice.model.corpus import build_corpus
from sluice.model.tokenizer import (
    BOS,
    BOS_ID,
    EOS_DOC_ID,
    GENERATION_EOS_IDS,
    IM_END,
    IM_END_ID,
    IM_START,
    IM_START_ID,
    PAD_ID,
    train_tokenizer,
)
from sluice.model.train import TrainConfig, _batch, encode_corpus
from tests.conftest import TinyModelFactory

TEXTS = [
    "Hello, world! def f(x): return x ** 2",
    "日本語のテキストと中文文本, 한국어",
    "emoji 😀🎉 👩‍💻 👨‍👩‍👧‍👦 🇯🇵 👍🏽",
    "cafe\u0301 vs café, Zürich, Ελληνικά, привет",
    "  leading spaces\n\ttabs and trailing  ",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
]


def test_directory_has_the_hugging_face_files(tiny_model_dir: Path) -> None:
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        tiny.MARKER,
    } <= names
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == (BOS, IM_END, "<pad>")
    assert config["model_max_length"] == 2048
    assert "chat_template" in config


def test_loads_with_auto_classes_and_runs(tiny_model_dir: Path) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama"
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    ) == (64, 2, 4, 2, 128)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == config.vocab_size
    ids = tok("a short prompt", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tiny_model_dir: Path, text: str) -> None:
    raw = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    enc = raw.encode(text, add_special_tokens=False)
    assert raw.decode(enc.ids, skip_special_tokens=False) == text
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = tok(text)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert ids[1:] == enc.ids
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_special_tokens_have_fixed_ids(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (PAD_ID, BOS_ID, IM_END_ID)
    assert tok.convert_tokens_to_ids([IM_START, IM_END]) == [IM_START_ID, IM_END_ID]
    ids = tok(f"{IM_START}user\nhi{IM_END}", add_special_tokens=False)["input_ids"]
    assert ids[0] == IM_START_ID and ids[-1] == IM_END_ID


def test_chat_template_renders_chatml_with_one_bos(tiny_model_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    expected = BOS + "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in MESSAGES)
    assert text == expected + f"{IM_START}assistant\n"
    ids = list(tok.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    assert ids.count(BOS_ID) == 1 and ids[0] == BOS_ID
    assert ids.count(IM_START_ID) == len(MESSAGES) + 1
    assert ids.count(IM_END_ID) == len(MESSAGES)
    assert tok.decode(ids) == text
    without_prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert without_prompt == expected


def test_generation_eos_ids_are_valid_and_end_the_turn(tiny_model_dir: Path) -> None:
    gen = GenerationConfig.from_pretrained(tiny_model_dir)
    config = AutoConfig.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos = gen.eos_token_id
    assert isinstance(eos, list) and eos == GENERATION_EOS_IDS
    assert all(0 <= i < config.vocab_size for i in eos)
    assert tok.eos_token_id in eos and EOS_DOC_ID in eos
    assert tok.convert_ids_to_tokens(eos) == [IM_END, "</s>"]
    assert (gen.bos_token_id, gen.pad_token_id) == (BOS_ID, PAD_ID)


@pytest.mark.parametrize(("arch", "cls"), [("qwen2", "Qwen2ForCausalLM"), ("mistral", "MistralForCausalLM")])
def test_other_architectures_load_and_generate(
    tiny_model_dir_factory: TinyModelFactory, arch: str, cls: str
) -> None:
    path = tiny_model_dir_factory(arch)
    assert AutoConfig.from_pretrained(path).model_type == arch
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == cls
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, return_tensors="pt"
    )
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= ids["input_ids"].shape[1] + 4


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_sliding_window_reaches_the_config(tiny_model_dir_factory: TinyModelFactory, arch: str) -> None:
    config = AutoConfig.from_pretrained(tiny_model_dir_factory(arch, sliding_window=32))
    assert config.sliding_window == 32
    if arch == "qwen2":
        assert config.use_sliding_window
        assert set(config.layer_types) == {"sliding_attention"}


def test_llama_rejects_sliding_window_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        tiny.model_config("test", "llama", sliding_window=32)
    with pytest.raises(ValueError, match="preset"):
        tiny.model_config("huge")
    with pytest.raises(ValueError, match="arch"):
        tiny.model_config("test", "gpt2")


def test_overrides_change_sizes() -> None:
    config = tiny.model_config("chat", "llama", num_hidden_layers=1, hidden_size=128)
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (1, 128, 704)


def test_same_seed_gives_same_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = tiny.make_tiny_model(tmp_path / "again", progress=False)
    a, b = load_file(tiny_model_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = load_file(tiny.make_tiny_model(tmp_path / "other", seed=1, progress=False) / "model.safetensors")
    assert not all(torch.equal(a[k], other[k]) for k in a)


def _loss(model_dir: Path, text: str) -> float:
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss)


def test_short_training_lowers_the_loss_and_saves_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    trained = tiny.make_tiny_model(tmp_path / "trained", train_seconds=2.0, progress=False)
    report = json.loads((trained / tiny.MARKER).read_text())["train_report"]
    assert report["steps"] > 0
    assert report["eval_loss_after"] < report["eval_loss_before"]
    text = build_corpus().texts[0]
    assert _loss(trained, text) < _loss(tiny_model_dir, text)  # same seed: same start, saved weights moved


def test_cache_is_built_once_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_CACHE_DIR", str(tmp_path / "cache"))
    first = tiny.default_model_dir(preset="test", train_seconds=0.5)
    assert first.parent == tmp_path / "cache"
    assert f"r{tiny.RECIPE_VERSION}" in first.name
    marker_mtime = (first / tiny.MARKER).stat().st_mtime_ns

    def no_rebuild(*args: object, **kwargs: object) -> Path:
        raise AssertionError("the cached model was rebuilt")

    monkeypatch.setattr(tiny, "make_tiny_model", no_rebuild)
    second = tiny.default_model_dir(preset="test", train_seconds=0.5)
    assert second == first
    assert (second / tiny.MARKER).stat().st_mtime_ns == marker_mtime
    AutoModelForCausalLM.from_pretrained(second)
    assert [p.name for p in first.parent.iterdir() if not p.name.endswith(".lock")] == [first.name]


def test_an_interrupted_build_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "save_tokenizer", broken)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny_model(tmp_path / "model", progress=False)
    assert list(tmp_path.iterdir()) == []


def test_refuses_to_overwrite_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        tiny.make_tiny_model(tmp_path, progress=False)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_replaces_a_previous_model_directory(tmp_path: Path) -> None:
    out = tiny.make_tiny_model(tmp_path / "m", progress=False)
    tiny.make_tiny_model(out, arch="qwen2", progress=False)
    assert AutoConfig.from_pretrained(out).model_type == "qwen2"
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_cli_writes_a_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli"
    assert tiny.main([str(out), "--preset", "test", "--arch", "mistral", "--sliding-window", "16"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    config = AutoConfig.from_pretrained(out)
    assert (config.model_type, config.sliding_window) == ("mistral", 16)


def test_cli_rejects_bad_arguments(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tiny.main([str(tmp_path / "x"), "--arch", "gpt2"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        tiny.main([])
    with pytest.raises(SystemExit):  # the embedded model has no sliding window
        tiny.main([str(tmp_path / "y"), "--sliding-window", "8"])
    assert tiny.main([str(tmp_path), "--preset", "test", "--arch", "llama", "--sliding-window", "8"]) == 2
    assert "sliding_window" in capsys.readouterr().err


def test_corpus_is_deterministic_and_multilingual() -> None:
    corpus = build_corpus()
    assert corpus == build_corpus.__wrapped__()
    text = "\n".join(corpus.all_text())
    for needle in ("the", "日本語", "👩‍💻", "\u0301", "Zürich"):
        assert needle in text
    assert {role for conv in corpus.conversations for role, _ in conv} == {"system", "user", "assistant"}


def test_chat_preset_has_the_smaller_vocabulary() -> None:
    assert tiny.model_config("chat").vocab_size == 4096
    assert tiny.model_config("test").vocab_size == 8192
    assert tiny.model_config("chat", vocab_size=8192).vocab_size == 8192


def test_corpus_is_prose_and_answers_are_short_sentences() -> None:
    corpus = build_corpus()
    for text in corpus.texts[:1000]:
        assert ">>>" not in text and "::" not in text
    answers = [content for conv in corpus.conversations for role, content in conv if role == "assistant"]
    assert len(answers) > 500
    for answer in answers:
        assert answer.endswith(".") and len(answer) <= 400
        assert "\n" not in answer and ">>>" not in answer


@pytest.mark.parametrize(("chat_fraction", "second"), [(1.0, IM_START_ID), (0.0, None)])
def test_training_windows_start_at_documents(chat_fraction: float, second: int | None) -> None:
    tok = train_tokenizer(4096)
    data = encode_corpus(tok, build_corpus())
    cfg = TrainConfig(seconds=1.0, batch_size=16, seq_len=32, chat_fraction=chat_fraction)
    batch = _batch(data, cfg, torch.Generator().manual_seed(0))
    assert batch.shape == (16, 33)
    assert (batch[:, 0] == BOS_ID).all()
    if second is None:
        assert (batch[:, 1] != IM_START_ID).all()
    else:
        assert (batch[:, 1] == second).all()


def test_cli_writes_the_embedded_model_by_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir_factory: TinyModelFactory
) -> None:
    """`sluice model tiny DIR` writes what `sluice up` serves: a copy of the cached embedded model."""
    embedded = tiny_model_dir_factory(num_hidden_layers=1)  # stands in for the trained chat model
    asked: list[dict[str, object]] = []

    def cached(**kwargs: object) -> Path:
        asked.append(kwargs)
        return embedded

    monkeypatch.setattr(tiny, "default_model_dir", cached)
    out = tmp_path / "embedded"
    assert tiny.main([str(out)]) == 0
    assert AutoConfig.from_pretrained(out).num_hidden_layers == 1
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in embedded.iterdir())
    assert (out / "model.safetensors").read_bytes() == (embedded / "model.safetensors").read_bytes()
    assert asked and asked[0]["arch"] == "llama"
