"""Two small tokenizers made with `tokenizers` for the detokenizer tests.

- `byte_level_bpe()`: GPT-2 style byte-level BPE trained on text full of emoji, CJK and combining
  characters with a small vocabulary, so many tokens hold part of a character's UTF-8 bytes.
- `sentencepiece_like()`: Metaspace pre-tokenizer, BPE with byte fallback (`<0x00>`…`<0xFF>`) for
  characters outside its small alphabet, and a decoder that fuses the pieces and drops the first
  leading space, as SentencePiece models converted to `tokenizer.json` do (two decoder forms).
Both have special tokens `<s>`, `</s>` and `<|im_end|>`.
"""

from __future__ import annotations

import functools
import json
import string

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_end|>"]

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "Emoji: 😀 😃 😄 😁 🎉 👍🏽 👨‍👩‍👧 🇫🇷 ❤️ 🙂 🚀🚀",
    "CJK: 世界 你好 中文字符 日本語 テキスト 한국어 텍스트 漢字",
    "Combining: e\u0301 a\u0300 n\u0303 o\u0308 Z\u0335\u0317a\u0336l\u0337g\u0338o",
    "Accents: naïve café résumé coöperate façade Ångström",
    "Spaces   and\ttabs\nand new lines\n\n  indented",
    "Code: def f(x): return x ** 2  # comment",
]


def _corpus() -> list[str]:
    return [line for line in CORPUS for _ in range(20)]


@functools.cache
def _byte_level_json() -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # Added tokens outside the byte alphabet, as real models have (e.g. "<tool_call>", "\n\n").
    tok.add_tokens(
        [
            AddedToken("\n\n", normalized=False),
            AddedToken("<tool_call>", normalized=False),
            AddedToken("héllo wörld", normalized=False),
        ]
    )
    return tok.to_str()


@functools.cache
def _sentencepiece_json(metaspace_decoder: bool) -> str:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    if metaspace_decoder:
        tok.decoder = decoders.Sequence(
            [
                decoders.Metaspace(replacement="▁", prepend_scheme="always"),
                decoders.ByteFallback(),
                decoders.Fuse(),
            ]
        )
    else:
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
    # A fixed alphabet (ASCII letters, digits, a little punctuation): everything else is byte fallback.
    alphabet = sorted(set(string.ascii_letters + string.digits + ".,:()#*▁"))
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return json.dumps(data)


def byte_level_bpe() -> Tokenizer:
    return Tokenizer.from_str(_byte_level_json())


def sentencepiece_like(*, metaspace_decoder: bool = False) -> Tokenizer:
    """Llama-style decoder (Replace, ByteFallback, Fuse, Strip), or with `metaspace_decoder` a
    Metaspace, ByteFallback, Fuse one."""
    return Tokenizer.from_str(_sentencepiece_json(metaspace_decoder))
