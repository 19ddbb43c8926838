"""Incremental decoding against the full decode, over random id sequences (hypothesis)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from services.detokenizer.incremental import REPLACEMENT, DecodeState, Session, Vocabulary
from tests.detokenizer.made_tokenizers import byte_level_bpe, sentencepiece_like

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def vocab(kind: str) -> Vocabulary:
    if kind == "byte_level_window":
        return Vocabulary(byte_level_bpe(), byte_table=False)
    makers = {
        "byte_level": byte_level_bpe,
        "sentencepiece": sentencepiece_like,
        "sentencepiece_metaspace": functools.partial(sentencepiece_like, metaspace_decoder=True),
    }
    return Vocabulary(makers[kind]())


# byte_level decodes through its byte table, byte_level_window through the tokenizer.
KINDS = ["byte_level", "byte_level_window", "sentencepiece", "sentencepiece_metaspace"]


def expected_text(v: Vocabulary, context: Sequence[int], generated: Sequence[int], skip: bool) -> str:
    """decode(C + G) minus decode(C), special tokens dropped when asked; byte-fallback tokens at the
    end of the context are not context, and context ending in an incomplete character is none."""
    tok: Tokenizer = v.tokenizer
    ctx = [i for i in context if not (skip and i in v.special_ids)]
    while ctx and ctx[-1] in v.byte_ids:
        ctx.pop()
    prefix = tok.decode(ctx, skip_special_tokens=skip)
    if prefix.endswith(REPLACEMENT):
        ctx, prefix = [], ""
    full = tok.decode(ctx + list(generated), skip_special_tokens=skip)
    assert full.startswith(prefix)
    return full[len(prefix) :]


def settled_text(v: Vocabulary, context: Sequence[int], generated: Sequence[int], skip: bool) -> str:
    """The part of the text that no further id can change: without a trailing open byte-fallback run
    and without trailing U+FFFD."""
    kept = [i for i in generated if not (skip and i in v.special_ids)]
    while kept and kept[-1] in v.byte_ids:
        kept.pop()
    return expected_text(v, context, kept, skip).rstrip(REPLACEMENT)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        out.append(list(ids[i : i + size]))
        i += size
    if i < len(ids):
        out.append(list(ids[i:]))
    return out


def run(state: DecodeState, chunks: Sequence[Sequence[int]]) -> list[str]:
    deltas = [state.add(chunk) for chunk in chunks]
    deltas.append(state.close())
    return deltas


@st.composite
def case(draw: st.DrawFn, kind: str) -> tuple[list[int], list[int], list[int], bool]:
    size = vocab(kind).size
    any_id = st.integers(0, size - 1)
    # Low ids are special tokens and bytes: draw them often, so byte runs and specials mix.
    ids = st.one_of(any_id, st.integers(0, min(size, 300) - 1))
    context = draw(st.lists(ids, max_size=4))
    generated = draw(st.lists(ids, max_size=40))
    sizes = draw(st.lists(st.integers(1, 5), max_size=40))
    return context, generated, sizes, draw(st.booleans())


@pytest.mark.parametrize("kind", KINDS)
def test_deltas_concatenate_to_full_decode(kind: str) -> None:
    v = vocab(kind)

    @PROPERTY
    @given(case(kind), st.lists(st.integers(1, 7), max_size=40))
    def check(c: tuple[list[int], list[int], list[int], bool], other_sizes: list[int]) -> None:
        context, generated, sizes, skip = c
        want = expected_text(v, context, generated, skip)
        deltas = run(DecodeState(v, prompt_ids=context, skip_special_tokens=skip), chunked(generated, sizes))
        assert "".join(deltas) == want
        # A replacement character only where the full decode has one.
        assert sum(d.count(REPLACEMENT) for d in deltas) == want.count(REPLACEMENT)
        if REPLACEMENT not in want:
            assert all(REPLACEMENT not in d for d in deltas)
        # Another chunking, same text.
        state = DecodeState(v, prompt_ids=context, skip_special_tokens=skip)
        again = run(state, chunked(generated, other_sizes))
        assert "".join(again) == want

    check()


def reference_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """(start, end, stop) of the stop string completed first while reading `text` left to right."""
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return end - len(stop), end, stop
    return None


@pytest.mark.parametrize("kind", KINDS)
def test_stop_strings(kind: str) -> None:
    v = vocab(kind)

    @PROPERTY
    @given(
        case(kind),
        st.lists(st.tuples(st.integers(0, 60), st.integers(1, 4)), min_size=1, max_size=3),
        st.booleans(),
        st.text(min_size=1, max_size=3),
    )
    def check(
        c: tuple[list[int], list[int], list[int], bool],
        cuts: list[tuple[int, int]],
        include: bool,
        random_stop: str,
    ) -> None:
        context, generated, sizes, skip = c
        full = expected_text(v, context, generated, skip)
        # Stops taken from the text itself (so they match, often across token boundaries), plus one random.
        stops = [full[a : a + n] for a, n in cuts if full[a : a + n]] + [random_stop]
        stops = [s for s in stops if REPLACEMENT not in s]
        state = DecodeState(
            v, prompt_ids=context, skip_special_tokens=skip, stop=stops, include_stop_str_in_output=include
        )
        out = "".join(run(state, chunked(generated, sizes)))
        ref = reference_stop(full, stops)
        if ref is None:
            assert out == full and state.stop is None
            assert state.num_ids_consumed == len(generated)
            return
        start, end, stop = ref
        assert state.stop == stop
        assert out == (full[:end] if include else full[:start])
        # The id that completed the stop: the first prefix of the ids whose settled text reaches `end`;
        # the last id when only the close settles it.
        consumed = next(
            (
                k
                for k in range(1, len(generated) + 1)
                if len(settled_text(v, context, generated[:k], skip)) >= end
            ),
            len(generated),
        )
        assert state.num_ids_consumed == consumed

    check()


def test_emoji_and_cjk_never_split() -> None:
    """Token by token, every delta is whole characters: no U+FFFD ever appears."""
    for kind in KINDS:
        v = vocab(kind)
        text = "Hi 😀👍🏽 世界 你好 e\u0301 naïve 🇫🇷 漢字テキスト"
        ids = v.tokenizer.encode(text, add_special_tokens=False).ids
        state = DecodeState(v)
        deltas = [state.add([i]) for i in ids] + [state.close()]
        assert "".join(deltas) == v.tokenizer.decode(ids)
        assert all(REPLACEMENT not in d for d in deltas), (kind, deltas)
        assert len([d for d in deltas if d]) > 5  # it did stream, not just flush at the end


def test_leading_space_uses_context() -> None:
    v = vocab("sentencepiece")
    prompt = v.tokenizer.encode("Say hello", add_special_tokens=False).ids
    gen = v.tokenizer.encode("Say hello world", add_special_tokens=False).ids[len(prompt) :]
    with_context = DecodeState(v, prompt_ids=prompt)
    assert "".join(run(with_context, [[i] for i in gen])) == " world"
    no_context = DecodeState(v)
    assert "".join(run(no_context, [[i] for i in gen])) == "world"


def test_stop_across_tokens_holds_only_the_possible_prefix() -> None:
    v = vocab("byte_level")
    ids = v.tokenizer.encode("the quick brown fox jumps", add_special_tokens=False).ids
    state = DecodeState(v, stop=["fox jum", "zzz"])
    out = []
    for i in ids:
        out.append(state.add([i]))
        seen = "".join(out)
        # Only a tail that could still start a stop string is ever held back.
        assert "the quick brown fox jumps".startswith(seen)
        if state.stop is None:
            assert not seen.endswith("fox jum")
    assert state.stop == "fox jum"
    assert "".join(out) == "the quick brown "
    assert state.close() == ""


def test_session_lifecycle() -> None:
    v = vocab("byte_level")
    session = Session(v)
    ids = v.tokenizer.encode("abc def. ghi", add_special_tokens=False).ids
    assert session.start("a", stop=["."]) is None
    assert session.start("b") is None
    assert session.start("a") is not None and session.start("a").error  # already open
    text, num_ids, final = session.chunk("a", ids)
    assert text == "abc def" and final is not None and final.stopped and final.stop == "."
    assert num_ids == final.num_ids_consumed < len(ids)
    assert session.chunk("a", ids) == ("", 0, None)  # after its final: ignored
    assert session.close("a") == ("", 0, None)
    text, _, final = session.chunk("nobody", ids)
    assert text == "" and final is not None and "unknown" in final.error
    text, _, final = session.chunk("b", [v.size + 5])
    assert final is not None and "outside the vocabulary" in final.error
    assert session.start("c") is None
    text, num_ids, final = session.chunk("c", ids)
    assert num_ids == len(ids)
    rest, num_ids, final = session.close("c")
    assert text + rest == "abc def. ghi" and num_ids == len(ids)
    assert final is not None and not final.stopped and final.num_ids_consumed == len(ids) and not final.error
    assert not session.states


PIECE_TEXTS = ["ab € cd. ef gh", "Emoji 😀👍🏽 and CJK 世界你好, e\u0301 combining.", "naïve café\n\nthe end"]


@pytest.mark.parametrize("kind", KINDS)
def test_pieces_are_each_tokens_own_bytes_and_join_to_the_text(kind: str) -> None:
    v = vocab(kind)
    partial = 0
    for text in PIECE_TEXTS:
        ids = v.tokenizer.encode(text, add_special_tokens=False).ids
        pieces = [v.piece(i) for i in ids]
        joined = b"".join(pieces).decode()
        assert joined in (text, " " + text)  # SentencePiece's leading "▁" is the first piece's
        assert joined.endswith(v.decode(ids))
        partial += sum(1 for piece in pieces if not _valid_utf8(piece))
    assert partial > 0  # some tokens hold part of a character ("€" is three of them)
    for token_id in v.byte_ids:
        value = int(v.tokenizer.id_to_token(token_id)[3:5], 16)
        assert v.piece(token_id) == bytes([value])
    im_end = v.tokenizer.token_to_id("<|im_end|>")
    assert v.piece(im_end) == b"<|im_end|>"


def test_pieces_of_the_tiny_model(tiny_model_dir: Path) -> None:
    v = Vocabulary.from_model_dir(tiny_model_dir)
    for text in PIECE_TEXTS:
        ids = v.tokenizer.encode(text, add_special_tokens=False).ids
        assert b"".join(v.piece(i) for i in ids) == text.encode()


def _valid_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("include", [False, True])
def test_a_stop_in_the_middle_of_a_chunk_counts_ids_through_the_one_that_completed_it(
    kind: str, include: bool
) -> None:
    v = vocab(kind)
    ids = v.tokenizer.encode("ab € cd. ef gh", add_special_tokens=False).ids
    through_stop = next(k for k in range(len(ids) + 1) if "d." in v.decode(ids[:k]))
    assert through_stop < len(ids)
    session = Session(v)
    assert session.start("r", stop=["d."], include_stop_str_in_output=include) is None
    first, num_ids, final = session.chunk("r", ids[:2])
    assert num_ids == 2 and final is None
    rest, num_ids, final = session.chunk("r", ids[2:])  # the stop, then more ids, in one chunk
    assert (first + rest).strip() == ("ab € cd." if include else "ab € c")
    assert final is not None and final.stopped
    assert num_ids == final.num_ids_consumed == through_stop
