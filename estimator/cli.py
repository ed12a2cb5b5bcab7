"""The ``batchfit`` command line.

    batchfit estimate --spec request.json --json     # the API.md response
    batchfit estimate --spec - < request.json        # a table
    batchfit estimate --spec req.json --model mypkg.nets:make   # a local nn.Module factory
"""

from __future__ import annotations

import argparse
import json
import sys

from estimator.errors import BatchfitError, SpecError

GIB = 2**30


def _read_spec(path: str) -> object:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise SpecError("--spec", path, f"a readable JSON file ({exc.strerror})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError("--spec", path, f"a JSON object ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc


def _estimate(args: argparse.Namespace) -> int:
    data = _read_spec(args.spec)
    if args.model is not None:
        if not isinstance(data, dict):
            raise SpecError("(body)", data, "a JSON object")
        data = {**data, "model": {"source": "custom", "factory": args.model}}
    from transformers.utils import logging as hf_logging

    from estimator.estimate import estimate
    from estimator.spec import parse_request

    hf_logging.set_verbosity_error()  # its info lines would mix into our output
    request = parse_request(data, allow_local_code=args.model is not None)
    progress = None
    if not args.json and sys.stderr.isatty():
        progress = lambda n, note: print(f"\r  simulated {n:3d} steps ({note})", end="", file=sys.stderr, flush=True)  # noqa: E731
    response = estimate(request, progress=progress)
    if progress is not None:
        print(file=sys.stderr)
    if args.json:
        print(response.model_dump_json(indent=2))
        return 0
    _table(response)
    return 0


def _table(r) -> None:
    print(f"{'gpu':<24} {'memory GiB':>10} {'max batch':>10} {'recommended':>12} {'at batch':>9} "
          f"{'device peak GiB':>16} {'fits':>5}")
    for g in r.results:
        m = g.memory
        print(f"{g.gpu:<24} {g.capacity_bytes / GIB:>10.1f} {str(g.max_batch_size):>10} "
              f"{str(g.recommended_batch_size):>12} {m.batch_size:>9} {m.device_peak_bytes / GIB:>16.2f} "
              f"{'yes' if m.fits else 'NO':>5}")
    b = r.breakdown
    print(f"\nat the peak (batch {b.batch_size}, first card), GiB: parameters {b.parameters / GIB:.2f}, "
          f"gradients {b.gradients / GIB:.2f}, optimizer state {b.optimizer_state / GIB:.2f}, "
          f"activations {b.activations / GIB:.2f}, temporaries {b.temporaries / GIB:.2f}, inputs {b.inputs / GIB:.2f}")
    print(f"per sample {r.per_sample_bytes / 2**20:.1f} MiB, fixed {r.fixed_bytes / GIB:.2f} GiB, "
          f"{r.parameter_count:,} parameters, {r.provenance.simulations} simulations in {r.provenance.seconds:.1f} s")
    for line in r.assumptions:
        print(f"  assumed: {line}")
    for line in r.warnings:
        print(f"  warning: {line}")


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
    est = sub.add_parser("estimate", help="max batch and memory per GPU for a request (API.md)")
    est.add_argument("--spec", required=True, help="request JSON file, or - for stdin")
    est.add_argument("--json", action="store_true", help="print the API.md response as JSON")
    est.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                     help="a local nn.Module factory (imported here; replaces the spec's model)")
    est.set_defaults(func=_estimate)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BatchfitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
