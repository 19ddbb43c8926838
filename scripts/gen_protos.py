"""Generates the Python gRPC stubs from protos/sluice/v1/*.proto into services/common/pb/.

protoc writes imports as `from sluice.v1 import x_pb2`; they are rewritten to the package the stubs
live in, so that the stubs import as `services.common.pb.x_pb2`.

Usage: python scripts/gen_protos.py [OUT_DIR]   (default: services/common/pb)
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
PACKAGE = "services.common.pb"
IMPORT_RE = re.compile(r"^from sluice\.v1 import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs (and an __init__.py) into out_dir; returns the files written."""
    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "sluice" / "v1").glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *protos,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((Path(tmp) / "sluice" / "v1").iterdir()):
            text = IMPORT_RE.sub(f"from {PACKAGE} import ", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text('"""Generated gRPC stubs for protos/sluice/v1 (make protos). Do not edit."""\n')
    written.append(init)
    return written


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "services" / "common" / "pb"
    if out_dir.exists() and out_dir == ROOT / "services" / "common" / "pb":
        shutil.rmtree(out_dir)
    for path in generate(out_dir):
        print(path.relative_to(out_dir.parent) if out_dir.parent in path.parents else path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
