"""tests/deploy/test_compose_up.py builds an image and runs containers: `make compose` runs it (with
SLUICE_COMPOSE_TEST=1, after installing what it needs); `make test` leaves it out."""

from __future__ import annotations

import os

collect_ignore = [] if os.environ.get("SLUICE_COMPOSE_TEST") == "1" else ["test_compose_up.py"]
