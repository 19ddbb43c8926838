#!/usr/bin/env bash
# The fake peer's start script, in the layout of the real one: MODEL_DIR PORT; needs $PEERS_DIR's build.
set -euo pipefail
[ -x "$PEERS_DIR/vllm-venv/bin/python" ] || { echo "no build" >&2; exit 1; }
exec "$FAKE_PYTHON" "$(dirname "$0")/fake_openai_server.py" "$1" "$2" vllm "$FAKE_EVENTS"
