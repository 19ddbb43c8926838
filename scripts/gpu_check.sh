#!/usr/bin/env bash
# The engine tests and the engine benchmarks on CUDA, in one command, within 9 minutes (time limits below),
# ending with ONE table (tests passed/failed; per model and concurrency each method's tok/s, × hf-static,
# forward share, CUDA graphs on/off; decode-only steps against the memory roofline; speculative decoding and
# quantized weights against the plain engine; sluice-continuous's ratios).
#
#   scripts/gpu_check.sh                 on a CUDA machine: the stages below, then the table
#   scripts/gpu_check.sh --dry-run       print each stage's command and time limit; run nothing
#   scripts/gpu_check.sh --fetch-wheels  on a machine with network: download the pinned wheels that a
#                                        CUDA machine image may lack into .whl/ (for Python 3.12, x86-64)
#
# Stages, each under its own time limit, which its commands share: one slow stage cannot eat the others'.
#   tests        tests/engine with SLUICE_TEST_DEVICE=cuda                                 TESTS_TIMEOUT_S=170
#   tiny         sluice bench engine: hf-static, sluice-continuous, sluice-continuous-eager at 256
#                requests; scripts/decode_roofline.py: decode-only steps at batch 64 (CUDA graphs on and
#                off)                                                                        TINY_TIMEOUT_S=90
#   qwen2-0.5b   sluice bench engine: hf-static, sluice-continuous at 64 and 256 requests (bf16);
#                scripts/decode_roofline.py: decode-only steps at batch 64 against the memory roofline
#                                                                                           MODEL_TIMEOUT_S=190
#   latency      sluice bench latency: off / ngram / int8 / fp8 engines at batch 1 and 64 at once on the
#                embedded chat model (the tiny preset when it is not built on the machine: carry
#                ~/.cache/sluice/tiny-chat-* and set SLUICE_CACHE_DIR for it and its perplexity);
#                scripts/gpu_latency_extras.py: batch-1 decode of off / int8 / fp8 on the qwen2-0.5b shape,
#                fp8 KV blocks at one budget                                              LATENCY_TIMEOUT_S=70
#   BENCH_PRESETS="llama-1b llama-8b" adds those presets (each MODEL_TIMEOUT_S more: beyond the 9 minutes,
#   which is why they are left out by default).
# GPU_CHECK_DEVICE=cpu runs the same stages on the CPU, each in a --quick version (one small test file, 4
# requests, tiny model only unless BENCH_PRESETS): a check of the script itself, for machines without a GPU.
#
# Python: .venv/bin/python if its torch sees CUDA; else python3 if its torch sees CUDA (a machine image
# with CUDA torch; then wheels found in .whl/ are installed into a private directory first, with no
# network); else, where there is no .venv yet, a new one installed from constraints.txt (needs network).
# Writes gpu-tests.{log,xml}, bench-<stage>.{log,json}, decode-<stage>.json (bench-latency and
# latency-extras.json too) and summary.txt to ${OUT:-bench-results}.
# Environment: TEST_ARGS (extra pytest arguments), BENCH_ARGS (extra arguments of every benchmark),
# the *_TIMEOUT_S above.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=${SLUICE_WHEELS:-.whl}  # pinned wheels brought along for a machine with no network (not in git)
PINNED=(transformers protobuf grpcio grpcio-health-checking grpcio-reflection
        opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions
        pytest pluggy iniconfig pytest-asyncio pytest-timeout torchao)
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

DEVICE=${GPU_CHECK_DEVICE:-cuda}
TESTS_TIMEOUT_S=${TESTS_TIMEOUT_S:-170}
TINY_TIMEOUT_S=${TINY_TIMEOUT_S:-90}
MODEL_TIMEOUT_S=${MODEL_TIMEOUT_S:-190}
LATENCY_TIMEOUT_S=${LATENCY_TIMEOUT_S:-70}
BENCH=(-m sluice.cli bench engine --no-progress)
DECODE=(scripts/decode_roofline.py --no-progress)
LATENCY=(-m sluice.cli bench latency --no-progress)
EXTRAS=(scripts/gpu_latency_extras.py --no-progress)

# The engine benchmark's arguments of a stage: one word per line (stage name as $1).
bench_args() {
  if [[ $DEVICE == cpu ]]; then
    printf '%s\n' --device cpu --quick --threads 1 --concurrency 4
    case $1 in
      tiny) printf '%s\n' --preset tiny --methods hf-static,sluice-continuous,sluice-continuous-eager ;;
      *) printf '%s\n' --preset "$1" --methods hf-static,sluice-continuous ;;
    esac
    return
  fi
  printf '%s\n' --device cuda
  case $1 in
    tiny) printf '%s\n' --preset tiny --concurrency 256 \
            --methods hf-static,sluice-continuous,sluice-continuous-eager ;;
    *) printf '%s\n' --preset "$1" --dtype bfloat16 --concurrency 64,256 --methods hf-static,sluice-continuous ;;
  esac
}

# The decode steps' arguments of a stage, one word per line (the model and dtype of its engine benchmark).
decode_args() {
  if [[ $DEVICE == cpu ]]; then
    printf '%s\n' --device cpu --quick --threads 1 --preset "$1" --batch 4 --steps 4
  elif [[ $1 == tiny ]]; then
    printf '%s\n' --device cuda --preset tiny --batch 64
  else
    printf '%s\n' --device cuda --preset "$1" --dtype bfloat16 --batch 64
  fi
}

# The latency benchmark's arguments, one word per line. On CUDA the qwen2-0.5b stage has cached that shape
# in bfloat16 already (same seed), so this stage only loads it.
latency_args() {
  if [[ $DEVICE == cpu ]]; then
    printf '%s\n' --device cpu --quick --threads 1 --preset tiny --variants off,ngram,int8 --perplexity-tokens 0
    return
  fi
  printf '%s\n' --device cuda --variants off,ngram,int8,fp8 --if-no-embedded tiny --num-requests 4 \
    --concurrency 64 --output-len 64 --perplexity-tokens 8192
}

# The weight formats on a larger shape, one word per line (on CUDA the qwen2-0.5b stage has cached it).
extras_args() {
  if [[ $DEVICE == cpu ]]; then
    printf '%s\n' --device cpu --quick --threads 1 --preset tiny --variants off,int8
    return
  fi
  printf '%s\n' --device cuda --preset qwen2-0.5b --variants off,int8,fp8 --requests 2 --output-len 32
}

stages() {
  echo tiny
  if [[ $DEVICE == cpu ]]; then
    echo "${BENCH_PRESETS:-}" | tr ', ' '\n\n' | grep -v '^$' || true
  else
    printf '%s\n' qwen2-0.5b $(echo "${BENCH_PRESETS:-}" | tr ',' ' ')
  fi
}

stage_timeout() { [[ $1 == tiny ]] && echo "$TINY_TIMEOUT_S" || echo "$MODEL_TIMEOUT_S"; }

test_args() {
  if [[ $DEVICE == cpu ]]; then
    echo tests/engine/test_stats.py
  else
    echo tests/engine
  fi
}

has_cuda() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }

pick_python() {
  if [[ $DEVICE == cpu ]]; then
    PY=.venv/bin/python
  elif [[ -x .venv/bin/python ]] && has_cuda .venv/bin/python; then
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
  [[ $DEVICE == cpu ]] || nvidia-smi || echo "(nvidia-smi not available)"
  "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print(f"python {platform.python_version()} at {__import__('sys').executable}")
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
print(f"torch {torch.__version__} cuda {torch.version.cuda} device {device}")
for name in ("transformers", "tokenizers", "grpcio", "protobuf", "pytest", "pytest-asyncio"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} MISSING")
EOF
}

# A stage of $1 seconds whose output goes to log $2: its commands (run_part) share that time.
start_stage() {
  STAGE_START=$SECONDS STAGE_END=$((SECONDS + $1)) RC=0 STAGE_LOG=$2
  : >"$STAGE_LOG"
}

# Runs "$@" under `timeout` with the stage's seconds left, output to the terminal and appended to its log;
# RC keeps the stage's first failure (124: no time was left), SECONDS_TAKEN its time so far.
run_part() {
  local left=$((STAGE_END - SECONDS)) rc=0
  if ((left < 1)); then
    rc=124
  else
    timeout --kill-after=10 "$left" "$@" 2>&1 | tee -a "$STAGE_LOG" || rc=$?
  fi
  [[ $RC -ne 0 ]] || RC=$rc
  SECONDS_TAKEN=$((SECONDS - STAGE_START))
}

dry_run() {
  local total=$TESTS_TIMEOUT_S stage
  echo "== tests (timeout ${TESTS_TIMEOUT_S}s): SLUICE_TEST_DEVICE=$DEVICE PY ${PYTEST[*]} $(test_args)" \
    "--junitxml OUT/gpu-tests.xml ${TEST_ARGS:-}"
  for stage in $(stages); do
    total=$((total + $(stage_timeout "$stage")))
    # shellcheck disable=SC2046  # one word per line
    echo "== $stage (timeout $(stage_timeout "$stage")s): PY ${BENCH[*]} $(bench_args "$stage" | tr '\n' ' ')" \
      "--json OUT/bench-$stage.json ${BENCH_ARGS:-}; PY ${DECODE[*]} $(decode_args "$stage" | tr '\n' ' ')" \
      "--json OUT/decode-$stage.json"
  done
  total=$((total + LATENCY_TIMEOUT_S))
  echo "== latency (timeout ${LATENCY_TIMEOUT_S}s): PY ${LATENCY[*]} $(latency_args | tr '\n' ' ')" \
    "--json OUT/bench-latency.json; PY ${EXTRAS[*]} $(extras_args | tr '\n' ' ')--json OUT/latency-extras.json"
  echo "== time limits add up to ${total}s"
}

main() {
  if [[ ${1:-} == --fetch-wheels ]]; then
    fetch_wheels
    return
  fi
  if [[ ${1:-} == --dry-run ]]; then
    dry_run
    return
  fi
  local out=${OUT:-bench-results}
  mkdir -p "$out"
  pick_python
  versions
  export PYTHONUNBUFFERED=1 SLUICE_TEST_DEVICE=$DEVICE PYTEST_DISABLE_PLUGIN_AUTOLOAD=1

  echo "== engine tests on $DEVICE (SLUICE_TEST_DEVICE=$DEVICE, timeout ${TESTS_TIMEOUT_S}s)"
  rm -f "$out/gpu-tests.xml"
  start_stage "$TESTS_TIMEOUT_S" "$out/gpu-tests.log"
  # shellcheck disable=SC2046,SC2086  # test_args and TEST_ARGS are lists of words
  run_part "$PY" "${PYTEST[@]}" $(test_args) --junitxml "$out/gpu-tests.xml" ${TEST_ARGS:-}
  local failed=0
  local summary=(--tests "tests/engine ($DEVICE)" "$out/gpu-tests.xml" "$RC" "$SECONDS_TAKEN")
  [[ $RC -eq 0 ]] || failed=1

  local stage args
  for stage in $(stages); do
    echo "== sluice bench engine and decode steps: $stage (timeout $(stage_timeout "$stage")s)"
    rm -f "$out/bench-$stage.json" "$out/decode-$stage.json"
    start_stage "$(stage_timeout "$stage")" "$out/bench-$stage.log"
    mapfile -t args < <(bench_args "$stage")
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of words
    run_part "$PY" "${BENCH[@]}" "${args[@]}" --json "$out/bench-$stage.json" ${BENCH_ARGS:-}
    mapfile -t args < <(decode_args "$stage")
    run_part "$PY" "${DECODE[@]}" "${args[@]}" --json "$out/decode-$stage.json"
    summary+=(--bench "$stage" "$out/bench-$stage.json:$out/decode-$stage.json" "$RC" "$SECONDS_TAKEN")
    [[ $RC -eq 0 ]] || failed=1
  done

  echo "== sluice bench latency and the weight formats on a larger shape (timeout ${LATENCY_TIMEOUT_S}s)"
  rm -f "$out/bench-latency.json" "$out/latency-extras.json"
  start_stage "$LATENCY_TIMEOUT_S" "$out/bench-latency.log"
  mapfile -t args < <(latency_args)
  run_part "$PY" "${LATENCY[@]}" "${args[@]}" --json "$out/bench-latency.json"
  mapfile -t args < <(extras_args)
  run_part "$PY" "${EXTRAS[@]}" "${args[@]}" --json "$out/latency-extras.json"
  summary+=(--bench latency "$out/bench-latency.json:$out/latency-extras.json" "$RC" "$SECONDS_TAKEN")
  [[ $RC -eq 0 ]] || failed=1

  echo
  echo "== summary ($SECONDS s in all; outputs in $out)"
  "$PY" scripts/gpu_summary.py "${summary[@]}" | tee "$out/summary.txt"
  [[ $failed -eq 0 ]]
}

main "$@"
