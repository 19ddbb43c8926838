#!/usr/bin/env bash
# A start script whose server fails to start.
echo "broken peer: cannot load $1" >&2
exit 3
