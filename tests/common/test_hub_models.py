"""`--model ORG/NAME`: a Hub id resolved from a Hugging Face cache the test lays out as the Hub does
(`models--ORG--NAME/refs/REVISION`, `snapshots/COMMIT/` with files symlinked into `blobs/`), with the
network off. No test here touches the network: the one download is a stand-in for
`huggingface_hub.snapshot_download`."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from services.common import models
from services.common.models import ModelNotFound, model_name, resolve_model_dir
from sluice import launcher, plan
from tests.conftest import TinyModelFactory

REPO = "acme/tiny-chat"
MAIN = "a" * 40
OLD = "b" * 40


def lay_out(
    cache: Path, repo_id: str, commit: str, files_from: Path, *, refs: tuple[str, ...] = ("main",)
) -> Path:
    """Puts the files of `files_from` into `cache` as the Hub client does: each file's bytes once in
    `blobs/` (named by their hash), symlinked from `snapshots/COMMIT/`, and `refs/REF` naming the commit.
    Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for src in sorted(p for p in files_from.rglob("*") if p.is_file()):
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / src.relative_to(files_from)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(Path("..", "..", "blobs", blob.name) if link.parent == snapshot else blob)
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache in HF_HUB_CACHE, with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return cache


def _no_download(*args: object, **kwargs: object) -> None:
    raise AssertionError("the network was asked for")


def test_hub_id_resolves_from_the_cache_offline(
    offline_cache: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_download)
    snapshot = lay_out(offline_cache, REPO, MAIN, tiny_model_dir)
    path = resolve_model_dir(REPO)
    assert path == snapshot
    assert (path / "config.json").is_symlink() and (path / "config.json").is_file()
    assert model_name(path) == REPO


def test_revision_branch_tag_and_commit(offline_cache: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    old_files = tmp_path / "old"
    shutil.copytree(tiny_model_dir, old_files)
    (old_files / "marker.txt").write_text("old")
    lay_out(offline_cache, REPO, MAIN, tiny_model_dir)
    old = lay_out(offline_cache, REPO, OLD, old_files, refs=("v1.0",))
    assert resolve_model_dir(REPO).name == MAIN
    assert resolve_model_dir(REPO, "v1.0") == old  # a tag, through refs/
    assert resolve_model_dir(REPO, OLD) == old  # a commit, directly
    with pytest.raises(
        ModelNotFound, match=r"'acme/tiny-chat' \(revision 'v2'\) is not in the Hugging Face cache"
    ):
        resolve_model_dir(REPO, "v2")


def test_missing_model_offline_is_a_clear_error(offline_cache: Path) -> None:
    with pytest.raises(ModelNotFound) as info:
        resolve_model_dir("acme/absent")
    message = str(info.value)
    assert "'acme/absent'" in message
    assert "not in the Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


def test_a_snapshot_without_config_is_not_cached(offline_cache: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "tokenizer.json").write_text("{}")
    lay_out(offline_cache, REPO, MAIN, partial)
    with pytest.raises(ModelNotFound, match="not in the Hugging Face cache"):
        resolve_model_dir(REPO)


def test_local_directory_wins_and_other_names_are_refused(
    offline_cache: Path, tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model_dir(str(tiny_model_dir)) == tiny_model_dir
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_model_dir, tmp_path / "acme" / "tiny-chat")
    assert resolve_model_dir(REPO) == Path(REPO)  # a directory of that name is the model
    with pytest.raises(ModelNotFound, match="neither a directory nor a Hub id"):
        resolve_model_dir("no/such/dir")
    with pytest.raises(ModelNotFound, match="--revision applies to Hub ids"):
        resolve_model_dir(str(tiny_model_dir), "main")


def test_online_and_not_cached_downloads_once_with_the_token(
    offline_cache: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, a model not in the cache is fetched with snapshot_download (HF_TOKEN sent, server files
    only); the next resolution finds it in the cache without asking again."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    calls: list[dict[str, object]] = []

    def fake_download(repo_id: str, **kwargs: object) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        return str(lay_out(Path(str(kwargs["cache_dir"])), repo_id, MAIN, tiny_model_dir))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    path = resolve_model_dir(REPO)
    assert path == offline_cache / "models--acme--tiny-chat" / "snapshots" / MAIN
    [call] = calls
    assert call["repo_id"] == REPO and call["revision"] == "main" and call["token"] == "hf_test_token"
    assert "*.safetensors" in call["allow_patterns"] and "*.bin" not in call["allow_patterns"]  # type: ignore[operator]
    monkeypatch.setattr(huggingface_hub, "snapshot_download", _no_download)
    assert resolve_model_dir(REPO) == path


def test_gated_model_names_hf_token(offline_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import httpx
    import huggingface_hub
    from huggingface_hub import errors

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def gated(repo_id: str, **kwargs: object) -> str:
        response = httpx.Response(401, request=httpx.Request("GET", "https://huggingface.co"))
        raise errors.GatedRepoError("gated", response=response)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    with pytest.raises(ModelNotFound, match=r"'acme/tiny-chat'.*gated.*HF_TOKEN"):
        resolve_model_dir(REPO)


def test_sluice_up_resolves_once_and_hands_the_directory_down(
    offline_cache: Path, tiny_model_dir: Path
) -> None:
    snapshot = lay_out(offline_cache, REPO, MAIN, tiny_model_dir)
    args = launcher.parse_args(["--model", REPO, "--revision", "main"])
    model = launcher.resolve_model(args.model, args.revision)
    assert model == str(snapshot)
    stages = [c for c in plan.plan_children(args, model) if "--model" in c.flags]
    assert {c.kind for c in stages} == {"tokenizer", "engine", "detokenizer"}
    for child in stages:
        assert child.flags[child.flags.index("--model") + 1] == str(snapshot)
        assert "--revision" not in child.flags
    with pytest.raises(SystemExit, match=r"'acme/absent'.*not in the Hugging Face cache"):
        launcher.resolve_model("acme/absent", "")


def test_sharded_bf16_checkpoint_from_the_cache_on_cpu(
    offline_cache: Path, tiny_model_dir_factory: TinyModelFactory, tmp_path: Path
) -> None:
    """A bf16 checkpoint in several safetensors shards (model.safetensors.index.json), resolved by its
    Hub id offline, loads on a CPU in the dtype the CPU does fast (bf16 only with AMX or AVX512-BF16),
    with every weight as saved."""
    from services.engine.executor.model_runner import ModelRunner, resolve_dtype
    from services.engine.settings import EngineSettings

    source = tiny_model_dir_factory()
    model = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(source / name, sharded / name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    lay_out(offline_cache, REPO, MAIN, sharded)

    # The loaded weights as dense tensors (oneDNN's packed linear layers: tests/engine/test_cpu_linear.py).
    settings = EngineSettings(model=REPO, device="cpu", num_kv_blocks=8, block_size=16, cpu_linear="torch")
    runner = ModelRunner(settings)
    fast = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert runner.dtype == (torch.bfloat16 if fast else torch.float32)
    assert runner.dtype == resolve_dtype("auto", torch.device("cpu"), torch.bfloat16)
    saved = model.state_dict()
    for name, tensor in runner.model.state_dict().items():
        assert torch.equal(tensor, saved[name].to(runner.dtype)), name


def test_cpu_dtype_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto on a CPU: bf16 for a half-precision checkpoint where the CPU has bf16 instructions, fp32
    otherwise; an fp32 checkpoint stays fp32."""
    from services.engine.executor.model_runner import resolve_dtype

    cpu = torch.device("cpu")
    for amx, avx in ((True, False), (False, True), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda avx=avx: avx)
        fast = amx or avx
        assert resolve_dtype("auto", cpu, torch.bfloat16) == (torch.bfloat16 if fast else torch.float32)
        assert resolve_dtype("auto", cpu, torch.float16) == (torch.bfloat16 if fast else torch.float32)
        assert resolve_dtype("auto", cpu, torch.float32) == torch.float32
        assert resolve_dtype("auto", cpu, None) == torch.float32
        assert resolve_dtype("float32", cpu, torch.bfloat16) == torch.float32


def test_hub_cache_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert models.hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert models.hub_cache_dir() == tmp_path / "elsewhere"
