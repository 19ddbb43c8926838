#!/usr/bin/env bash
# The fake peer's start script, in the layout of the real one: MODEL_DIR PORT; needs $PEERS_DIR's build.
set -euo pipefail
[ -x "$PEERS_DIR/llama.cpp/build/bin/llama-server" ] || { echo "no build" >&2; exit 1; }
echo "args llama.cpp ctx=${LLAMACPP_CTX:-} ${*:3}" >> "$FAKE_EVENTS"
exec "$FAKE_PYTHON" "$(dirname "$0")/fake_openai_server.py" "$1" "$2" llama.cpp "$FAKE_EVENTS"
