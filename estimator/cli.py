"""The ``batchfit`` command line."""

from __future__ import annotations

import argparse
import sys


def _gpus(args: argparse.Namespace) -> int:
    from estimator.gpus import CATALOG

    print(f"{'name':<24} {'memory (MiB)':>12} {'cc':>4} {'context (MiB)':>13}")
    for g in CATALOG.values():
        print(f"{g.name:<24} {g.memory_bytes // 2**20:>12} {g.compute_capability:>4} {g.context_bytes // 2**20:>13}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run("app.main:app", host=args.host, port=args.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchfit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("gpus", help="list the GPU catalog").set_defaults(func=_gpus)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
