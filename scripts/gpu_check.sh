#!/usr/bin/env bash
# The engine tests and the engine benchmark on CUDA, in one command.
#
#   scripts/gpu_check.sh                 on a CUDA machine: engine tests on CUDA, then `sluice bench engine`
#   scripts/gpu_check.sh --fetch-wheels  on a machine with network: download the pinned wheels that a
#                                        CUDA machine image may lack into .whl/ (for Python 3.12, x86-64)
#
# Python: .venv/bin/python if its torch sees CUDA; else python3 if its torch sees CUDA (a machine image
# with CUDA torch; then wheels found in .whl/ are installed into a private directory first, with no
# network); else, where there is no .venv yet, a new one installed from constraints.txt (needs network).
# Writes gpu-tests.log, bench-engine-cuda.{log,json,png} to ${OUT:-bench-results}.
# Environment: TEST_ARGS (extra pytest arguments), BENCH_ARGS (extra benchmark arguments).
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${SLUICE_WHEELS:-.whl}  # pinned wheels brought along for a machine with no network (not in git)
PINNED=(transformers protobuf grpcio grpcio-health-checking grpcio-reflection
        opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
        pytest pluggy iniconfig pytest-asyncio pytest-timeout)
# Only these pytest plugins load: an image's other plugins may not work with the pinned pytest.
PYTEST=(-m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout)

pin() { grep -i "^$1==" constraints.txt; }

fetch_wheels() {
  local py=.venv/bin/python
  [[ -x $py ]] || py=python3
  mkdir -p "$WHEELS"
  local name
  for name in "${PINNED[@]}"; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHEELS" "$(pin "$name")"
  done
  ls -l "$WHEELS"
}

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

pick_python() {
  if [[ -x .venv/bin/python ]] && has_cuda .venv/bin/python; then
    PY=.venv/bin/python
  elif has_cuda python3; then
    PY=python3
    if compgen -G "$WHEELS/*.whl" >/dev/null; then
      local site=/tmp/sluice-site
      echo "== installing $(ls "$WHEELS" | wc -l) carried wheels into $site (no network)"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$WHEELS"/*.whl
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
  elif [[ ! -e .venv ]]; then
    echo "== no Python with CUDA torch found; creating .venv from constraints.txt (needs network)"
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt "$(pin torch)"
    .venv/bin/python -m pip install -q -c constraints.txt -e '.[dev]'
    PY=.venv/bin/python
    has_cuda "$PY" || { echo "torch in the new .venv sees no CUDA device" >&2; exit 1; }
  else
    echo "no torch that sees a CUDA device: not in .venv, not in python3" >&2
    exit 1
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
}

versions() {
  echo "== $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi || echo "(nvidia-smi not available)"
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print(f"python {platform.python_version()} at {__import__('sys').executable}")
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {torch.cuda.get_device_name(0)}")
for name in ("transformers", "tokenizers", "grpcio", "protobuf", "pytest", "pytest-asyncio"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
EOF
}

main() {
  if [[ ${1:-} == --fetch-wheels ]]; then
    fetch_wheels
    return
  fi
  local out=${OUT:-bench-results}
  mkdir -p "$out"
  pick_python
  versions
  export PYTHONUNBUFFERED=1 SLUICE_TEST_DEVICE=cuda PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

  echo "== engine tests on CUDA (SLUICE_TEST_DEVICE=cuda)"
  local tests_rc=0
  # shellcheck disable=SC2086  # TEST_ARGS is a list of words
  "$PY" "${PYTEST[@]}" tests/engine ${TEST_ARGS:-} 2>&1 | tee "$out/gpu-tests.log" \
    || tests_rc=$?

  echo "== sluice bench engine --device cuda"
  local bench_rc=0
  # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
  "$PY" -c 'import sys; from sluice.bench.engine import main; sys.exit(main(sys.argv[1:]))' \
    --device cuda --json "$out/bench-engine-cuda.json" --plot "$out/bench-engine-cuda.png" ${BENCH_ARGS:-} \
    2>&1 | tee "$out/bench-engine-cuda.log" || bench_rc=$?

  echo "== engine tests exit $tests_rc, benchmark exit $bench_rc; outputs in $out"
  [[ $tests_rc -eq 0 && $bench_rc -eq 0 ]]
}

main "$@"
