"""Where a service finds its model: a local directory, a Hugging Face Hub id, or the embedded model.

`resolve_model_dir(model, revision)`: empty = the embedded chat model (made and cached on first use); a
path that exists = that directory; a Hub id `ORG/NAME` (`revision` a branch, tag or commit; default
`main`) = its snapshot directory in the Hugging Face cache, looked up without the network, else
downloaded (`DOWNLOAD_PATTERNS` only: no pickles, no remote code; `HF_TOKEN` sent). Raises
`ModelNotFound` naming the id when it is neither, or not cached while `HF_HUB_OFFLINE` (or
`TRANSFORMERS_OFFLINE`) is set. `model_name` gives a directory's served name (`ORG/NAME` for a cache
snapshot, else the directory's own); `eos_token_ids` is the one rule for which ids end a generation.
The cache's layout and `sluice up`'s single resolution: README ("Running"), docs/architecture.md.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# ORG/NAME as the Hub spells repository ids (letters, digits, `-`, `_`, `.`; no `..`, no leading `-`).
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
# The files a server reads from a Hub repository (weights in safetensors only: no pickled checkpoints).
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken")
_TRUE = frozenset({"1", "on", "yes", "true"})


class ModelNotFound(ValueError):
    """`--model` names neither a directory nor a Hub id that can be had; the message says why."""


def resolve_model_dir(model: str, revision: str = "") -> Path:
    """The local directory of `model`: the embedded model when empty, the
    path when it exists, else the Hub id's snapshot (cached, or downloaded when online). Raises
    ModelNotFound when it is none of these; a path is not checked for being a model directory here."""
    if not model:
        if revision:
            raise ModelNotFound("--revision needs a Hub id in --model (ORG/NAME)")
        from sluice.model.tiny import default_model_dir

        return default_model_dir()
    path = Path(model).expanduser()
    if path.exists() or not HUB_ID.fullmatch(model):
        if revision:
            raise ModelNotFound(f"--revision applies to Hub ids (ORG/NAME), not to the directory {model!r}")
        if not path.exists():
            raise ModelNotFound(f"model {model!r} is neither a directory nor a Hub id (ORG/NAME)")
        return path
    return hub_snapshot(model, revision or "main")


def hub_cache_dir() -> Path:
    """The Hugging Face Hub cache as huggingface_hub finds it: HF_HUB_CACHE, else HF_HOME/hub, else
    ~/.cache/huggingface/hub (read from the environment at each call)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """Whether the Hub may not be reached: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is true."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().lower() in _TRUE


def cached_snapshot(repo_id: str, revision: str, cache: Path | None = None) -> Path | None:
    """The cached snapshot of `repo_id` at `revision` (a branch, tag or commit), or None when the cache
    has no complete one (a snapshot without config.json is not one). Reads only the disk."""
    repo = (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    commit = revision if COMMIT.fullmatch(revision) else None
    ref = repo / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text(encoding="utf-8").strip()
    if commit is None:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def hub_snapshot(repo_id: str, revision: str) -> Path:
    """The snapshot directory of a Hub id: from the cache, else downloaded.
    Raises ModelNotFound naming the id when it is not cached and cannot be downloaded."""
    cache = hub_cache_dir()
    found = cached_snapshot(repo_id, revision, cache)
    if found is not None:
        log.info("model %s@%s: %s (Hugging Face cache)", repo_id, revision, found)
        return found
    where = f"model {repo_id!r} (revision {revision!r})"
    if hub_offline():
        raise ModelNotFound(
            f"{where} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set, so it cannot "
            "be downloaded: download it where the Hub can be reached, or unset HF_HUB_OFFLINE"
        )
    return _download(repo_id, revision, cache, where)


def _download(repo_id: str, revision: str, cache: Path, where: str) -> Path:
    import huggingface_hub
    from huggingface_hub import errors

    log.info("model %s@%s: downloading from the Hugging Face Hub into %s", repo_id, revision, cache)
    try:
        folder = huggingface_hub.snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=cache,
            allow_patterns=list(DOWNLOAD_PATTERNS),
            token=os.environ.get("HF_TOKEN") or None,
        )
    except errors.GatedRepoError:
        raise ModelNotFound(f"{where} is gated: accept its licence on the Hub and set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFound(f"{where} is not on the Hugging Face Hub (or is private: set HF_TOKEN)") from None
    except errors.RevisionNotFoundError:
        raise ModelNotFound(f"{where}: the Hub has no such revision") from None
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, OSError) as exc:
        raise ModelNotFound(f"{where} is not cached and could not be downloaded: {exc}") from None
    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"{where} has no config.json: it is not a transformers model")
    return path


def model_name(model_dir: Path) -> str:
    """The name a model directory is served under: `ORG/NAME` for a snapshot of the Hub cache
    (`.../models--ORG--NAME/snapshots/COMMIT`), else the directory's name."""
    parts = model_dir.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        org_name = parts[-3][len("models--") :].split("--", 1)
        if len(org_name) == 2:
            return "/".join(org_name)
    return model_dir.name


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language part (`text_config`), where the eos lives for such models."""
    text = config.get("text_config")
    return text if isinstance(text, dict) else {}


def eos_token_ids(model_dir: Path, tokenizer_eos: int | None = None) -> list[int]:
    """The ids that end a generation, in order, each once: generation_config.json's `eos_token_id`
    (an id or a list), then config.json's (or its `text_config`'s), then the tokenizer's eos token
    (`tokenizer_eos`, the id of tokenizer_config.json's `eos_token`). The engine stops on these and
    the tokenizer reports them: one rule for both."""
    generation = _read_json(model_dir / "generation_config.json")
    config = _read_json(model_dir / "config.json")
    ids = _ids(generation.get("eos_token_id"))
    ids += _ids(config.get("eos_token_id")) or _ids(_text_config(config).get("eos_token_id"))
    if tokenizer_eos is not None:
        ids.append(tokenizer_eos)
    return list(dict.fromkeys(ids))


def tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`, found without loading the tokenizer: in
    tokenizer_config.json's `added_tokens_decoder`, else tokenizer.json's `added_tokens` or vocabulary."""
    tok_config = _read_json(model_dir / "tokenizer_config.json")
    eos = tok_config.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    for token_id, added in (tok_config.get("added_tokens_decoder") or {}).items():
        if isinstance(added, dict) and added.get("content") == eos and str(token_id).isdigit():
            return int(token_id)
    tokenizer = _read_json(model_dir / "tokenizer.json")
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == eos and isinstance(added.get("id"), int):
            return int(added["id"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(eos), int):
        return int(vocab[eos])
    return None


@functools.cache
def tokenizer_size(model_dir: Path) -> int | None:
    """How many ids tokenizer.json knows (its vocabulary with the added tokens, as the detokenizer counts
    them: the ids it can turn into text), or None without one. Cached: the engine's runner and grammar
    compiler both ask, and building a large tokenizer takes about a second."""
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True))
