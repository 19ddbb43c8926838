"""The `sluice` command: one entry point for every process and tool.

    sluice up [FLAGS]                                   the whole pipeline on this host (sluice/launcher.py)
    sluice serve tokenizer|engine|detokenizer|gateway   one service; its FLAGS go to its `server.main`
    sluice model tiny DIR [--preset test|chat]          write the embedded model (or a preset)
    sluice bench NAME [FLAGS]                           a benchmark (`BENCHMARKS`; older: `BENCHMARK_ALIASES`)
    sluice health HOST:PORT [--tls-ca-file F ...]       exit 0 if the service is SERVING
    sluice models [--markdown]                          model families served, and refused (why)

Argument parsing happens here and in the `main(argv)` of the module each subcommand hands over to.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

SERVICES = {
    "tokenizer": "services.tokenizer.server",
    "engine": "services.engine.server",
    "detokenizer": "services.detokenizer.server",
    "gateway": "gateway.server",
}
MODELS = {"tiny": "sluice.model.tiny"}
BENCHMARKS = ("serve", "engine", "sweep", "tokenizer", "detokenizer")  # `sluice bench NAME`: bench/NAME.py
BENCHMARK_ALIASES = {  # an older name → the command it is a variant or preset of, under that name
    "latency": "engine",
    "compare": "sweep",
    "pipeline": "sweep",
    "routing": "sweep",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="sluice: a gRPC pipeline for serving LLMs (tokenizer → engine → detokenizer, gateway).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("up", help="run the whole pipeline on this host (sluice up --help)", add_help=False)
    serve = sub.add_parser("serve", help="run one service (sluice serve NAME --help)", add_help=False)
    serve.add_argument("name", choices=sorted(SERVICES))
    model = sub.add_parser("model", help="write a model directory (sluice model tiny --help)", add_help=False)
    model.add_argument("kind", choices=sorted(MODELS))
    bench = sub.add_parser("bench", help="run a benchmark (sluice bench NAME --help)", add_help=False)
    bench.add_argument("name", choices=sorted([*BENCHMARKS, *BENCHMARK_ALIASES]))
    sub.add_parser("models", help="model families served and refused (sluice models --help)", add_help=False)
    health = sub.add_parser("health", help="check a service's grpc.health.v1 status")
    health.add_argument("address", help="HOST:PORT")
    health.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for SERVING")
    health.add_argument("--tls-ca-file", default="", help="PEM CA of the service's certificate (set = TLS)")
    health.add_argument("--tls-cert-file", default="", help="PEM client certificate (mutual TLS)")
    health.add_argument("--tls-key-file", default="", help="PEM key of --tls-cert-file")
    return parser


def _hand_over(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def _health(args: argparse.Namespace) -> int:
    import asyncio

    from services.common.grpc_server import ChannelTls, wait_healthy

    address, tls = args.address, ChannelTls.from_settings(args)
    try:
        asyncio.run(wait_healthy(address, timeout_s=args.timeout, tls=tls))
    except TimeoutError as exc:
        print(f"sluice health: {exc}", file=sys.stderr)
        return 1
    print(f"{address} SERVING")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "up":
        return _hand_over("sluice.launcher", rest)
    if args.command == "serve":
        return _hand_over(SERVICES[args.name], rest)
    if args.command == "health":
        return _health(args)
    if args.command == "model":
        return _hand_over(MODELS[args.kind], rest)
    if args.command == "models":
        return _hand_over("services.engine.executor.families", rest)
    return _bench(args.name, rest)


def _bench(name: str, argv: list[str]) -> int:
    """`sluice bench NAME` runs sluice/bench/NAME.py; an older name runs its variant or preset, its usage
    line and recorded command keeping the older name."""
    if name not in BENCHMARK_ALIASES:
        return _hand_over(f"sluice.bench.{name}", argv)
    module = importlib.import_module(f"sluice.bench.{BENCHMARK_ALIASES[name]}")
    return int(module.main([name, *argv], prog=f"sluice bench {name}") or 0)


if __name__ == "__main__":
    raise SystemExit(main())
