"""The `sluice` command: one entry point for every process and tool.

    sluice up [--model DIR] [--port 8000] [--grpc-base-port 50050]   the whole pipeline on this host
    sluice serve tokenizer|engine|detokenizer|gateway [FLAGS]       one service (FLAGS: --help)
    sluice model tiny DIR [--preset test|chat]                      write the embedded model (or a preset)
    sluice bench engine|tokenizer|detokenizer [FLAGS]               benchmarks of one component
    sluice bench serve --api openai|ws|grpc --url URL [FLAGS]       load a running server: throughput, latency
    sluice bench sweep compare|pipeline|routing|peers [FLAGS]        serve over systems and rates, by preset
    sluice bench compare [--no-peer] [--json FILE] [--plot FILE]    policies and a peer against request rate
    sluice bench pipeline [--json FILE] [--plot FILE]               four services against the engine alone
    sluice bench routing [--engines 2] [--json FILE]                engine routing policies across replicas
    sluice bench latency [--variants off,ngram,int8] [--json FILE]  speculation and quantized weights
    sluice up --engines N --tokenizers N --detokenizers N            replicas of the stages on one host
    sluice health HOST:PORT [--tls-ca-file F ...]                   exit 0 if the service is SERVING
    sluice models [--markdown]                                      model families served, and refused (why)

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
BENCHMARKS = (
    "engine",
    "tokenizer",
    "detokenizer",
    "serve",
    "sweep",
    "pipeline",
    "compare",
    "routing",
    "latency",
)


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
    bench.add_argument("name", choices=sorted(BENCHMARKS))
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
    return _hand_over(f"sluice.bench.{args.name}", rest)  # `sluice bench NAME` runs sluice/bench/NAME.py


if __name__ == "__main__":
    raise SystemExit(main())
