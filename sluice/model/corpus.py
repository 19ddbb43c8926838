"""Training text for the embedded model, built from the Python installation itself (no download).

`build_corpus()` returns a `Corpus`: plain-text documents (prose paragraphs of `pydoc_data.topics` and
of the standard library's docstrings, read with `ast`, so nothing is imported or run; generated
multi-byte text) and `Conversation` tuples of chat turns, which the trainer renders with the chat
template. Contract: deterministic for a given installation and seed (sorted topic keys and file names).
Prose is paragraphs without code, grammar rules, doctests or tables, hard wraps joined into spaces.
Why each part is there: docs/architecture.md ("The embedded model").
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_MIN_PARAGRAPH_CHARS = 80
_MAX_DOC_CHARS = 4000
_MAX_ANSWER_CHARS = 400


@dataclass(frozen=True)
class Corpus:
    """Plain-text documents and chat conversations (each a tuple of `(role, content)` turns)."""

    texts: tuple[str, ...]
    conversations: tuple[tuple[tuple[str, str], ...], ...]

    def all_text(self) -> list[str]:
        """Every string in the corpus, for tokenizer training."""
        return list(self.texts) + [content for conv in self.conversations for _, content in conv]


def _clean(text: str) -> str:
    """Trailing spaces removed from every line, runs of blank lines collapsed to one."""
    text = re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _paragraphs(text: str) -> list[str]:
    parts = [_clean(p) for p in re.split(r"\n\s*\n", text)]
    return [p for p in parts if p]


def _is_prose(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    return (
        not any(line[:1].isspace() for line in lines)
        and not any(mark in paragraph for mark in ("::", ">>>", "***", "|", "+--", "==="))
        and paragraph[:1].isalpha()
        and paragraph.rstrip()[-1:] in ".:!?)"
    )


def prose_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of `text` (see module docstring), each on one line."""
    return [" ".join(p.split()) for p in _paragraphs(text) if _is_prose(p)]


def _answer(paragraphs: list[str]) -> str:
    """Whole sentences from the start of `paragraphs`, up to `_MAX_ANSWER_CHARS`, ending with a period;
    empty if the first sentence alone is too long or no sentence ends."""
    text = " ".join(paragraphs)
    if len(text) <= _MAX_ANSWER_CHARS and text.endswith("."):
        return text
    end = text.rfind(". ", 0, _MAX_ANSWER_CHARS + 1)  # the period at index < _MAX_ANSWER_CHARS
    return text[: end + 1] if end > 0 else ""


def pydoc_topic_texts() -> list[tuple[str, str]]:
    """`(topic, text)` pairs from the documentation topics shipped with Python, in sorted order."""
    from pydoc_data import topics

    return [(key, topics.topics[key]) for key in sorted(topics.topics)]


@functools.cache
def stdlib_docstrings() -> list[tuple[str, str]]:
    """`(name, docstring)` of the top-level public standard-library modules and their public classes and
    functions (`name` is `module` or `module.Name`), in file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[tuple[str, str]] = []
    for path in sorted(root.glob("*.py")):
        if path.stem.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        module = path.stem
        nodes: list[tuple[str, ast.AST]] = [(module, tree)]
        nodes += [
            (f"{module}.{n.name}", n)
            for n in tree.body
            if isinstance(n, ast.ClassDef | ast.FunctionDef) and not n.name.startswith("_")
        ]
        for name, node in nodes:
            doc = ast.get_docstring(node)  # type: ignore[arg-type]
            if doc and len(doc) >= _MIN_PARAGRAPH_CHARS:
                docs.append((name, _clean(doc[:_MAX_DOC_CHARS])))
    return docs


_MULTIBYTE_WORDS = (
    "café",
    "naïve",
    "façade",
    "Zürich",
    "São Paulo",
    "crème brûlée",
    "jalapeño",
    "Ångström",
    "Øresund",
    "smörgåsbord",
    "déjà vu",
    "Kraków",
    "Dvořák",
    "İstanbul",
    "Straße",
    "œuvre",
    "piñata",
    "über",
    "Ελληνικά",
    "Москва",
    "привет мир",
    "日本語のテキスト",
    "東京",
    "こんにちは世界",
    "中文文本",
    "你好，世界",
    "北京",
    "한국어",
    "안녕하세요",
    "สวัสดี",
    "नमस्ते",
    "مرحبا",
    "שלום",
)
_EMOJI = ("😀", "🎉", "🐍", "🚀", "❤️", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🇯🇵", "🇫🇷", "✨", "🔥", "🌍", "☕", "🍣")
_COMBINING = ("e\u0301", "a\u0300", "o\u0308", "n\u0303", "c\u0327", "u\u030a", "i\u0302", "z\u030c")
_TEMPLATES = (
    "The word {w} is written with characters outside ASCII {e}.",
    "In {w}, people say hello {e} and the text stays valid UTF-8.",
    'A string like "{w}" has more bytes than characters {e}.',
    "She wrote {w} and {w2} in the same line {e}{e2}.",
    "Combining marks such as {c} and {c2} decompose accented letters.",
    "{w} {e} {w2}",
)


def multibyte_texts(n: int = 400, seed: int = 0) -> list[str]:
    """Generated sentences mixing ASCII with multi-byte characters (deterministic for a seed)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        template = rng.choice(_TEMPLATES)
        lines.append(
            template.format(
                w=rng.choice(_MULTIBYTE_WORDS),
                w2=rng.choice(_MULTIBYTE_WORDS),
                e=rng.choice(_EMOJI),
                e2=rng.choice(_EMOJI),
                c=rng.choice(_COMBINING),
                c2=rng.choice(_COMBINING),
            )
        )
    return ["\n".join(lines[i : i + 8]) for i in range(0, len(lines), 8)]


_QUESTIONS = (
    "What is {t}?",
    "Tell me about {t}.",
    "Explain {t} in Python.",
    "How does {t} work?",
    "Can you describe {t}?",
    "What should I know about {t}?",
)
_SYSTEM = "You are a helpful assistant that answers questions about Python."


def conversations(seed: int = 0) -> list[tuple[tuple[str, str], ...]]:
    """One conversation per documentation topic and per documented stdlib name whose text starts with
    prose: a question, answered by its first sentences; a quarter of them start with a system turn."""
    rng = random.Random(seed)
    sources = [(key.replace("-", " "), text) for key, text in pydoc_topic_texts()]
    sources += [(f"`{name}`", doc) for name, doc in stdlib_docstrings()]
    convs = []
    for topic, text in sources:
        answer = _answer(prose_paragraphs(text))
        if not answer:
            continue
        turns: tuple[tuple[str, str], ...] = (
            ("user", rng.choice(_QUESTIONS).format(t=topic)),
            ("assistant", answer),
        )
        if rng.random() < 0.25:
            turns = (("system", _SYSTEM), *turns)
        convs.append(turns)
    return convs


@functools.cache
def build_corpus(seed: int = 0) -> Corpus:
    """The whole training corpus (see module docstring); deterministic for one Python installation."""
    texts: list[str] = []
    for _, text in pydoc_topic_texts() + stdlib_docstrings():
        texts.extend(p for p in prose_paragraphs(text) if len(p) >= _MIN_PARAGRAPH_CHARS)
    texts.extend(multibyte_texts(seed=seed))
    return Corpus(texts=tuple(texts), conversations=tuple(conversations(seed=seed)))
