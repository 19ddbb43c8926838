"""The committed stubs are exactly what `make protos` generates from protos/."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "services" / "common" / "pb"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_stubs_match_committed(tmp_path: Path) -> None:
    written = _load_generator().generate(tmp_path)
    fresh = {p.name: p.read_text() for p in written}
    committed = {
        p.name: p.read_text() for p in COMMITTED.iterdir() if p.is_file() and p.suffix in (".py", ".pyi")
    }
    assert sorted(fresh) == sorted(committed), "stub files differ: run `make protos`"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"stale generated stubs, run `make protos`: {stale}"


def test_every_proto_has_a_stub() -> None:
    protos = sorted(p.stem for p in (ROOT / "protos" / "sluice" / "v1").glob("*.proto"))
    assert protos == ["common", "detokenizer", "engine", "gateway", "tokenizer"]
    for stem in protos:
        assert (COMMITTED / f"{stem}_pb2.py").is_file()
        assert (COMMITTED / f"{stem}_pb2_grpc.py").is_file()


def test_stubs_import_from_their_package() -> None:
    from services.common.pb import engine_pb2, gateway_pb2

    out = engine_pb2.EngineOut(
        entries=[engine_pb2.StepEntry(chunk=engine_pb2.TokenChunk(request_id="r", token_ids=[1]))]
    )
    assert engine_pb2.EngineOut.FromString(out.SerializeToString()) == out
    request = gateway_pb2.PublicGenerateRequest(prompt="hi")
    assert request.WhichOneof("input") == "prompt"
