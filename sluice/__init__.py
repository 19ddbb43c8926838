"""sluice's command line, models and benchmarks."""

import services  # noqa: F401  (quiets libraries' import-time warnings before anything imports them)
