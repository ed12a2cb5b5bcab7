"""The ``batchfit`` command line.

    batchfit estimate --spec request.json --json     # the response of POST /estimate (docs/API.md)
    batchfit estimate --spec - < request.json        # a table
    batchfit estimate --spec req.json --model mypkg.nets:make   # a local nn.Module factory
    batchfit profile --spec req.json -o profile.json    # the affine trace, portable
    batchfit estimate --profile profile.json --gpus A100-80GB H100-80GB --plot step.png
    batchfit estimate --spec req.json --snapshot step.pickle    # the step for https://pytorch.org/memory_viz
    batchfit serve --host 0.0.0.0 --ssl-certfile tls.crt --ssl-keyfile tls.key   # HTTPS (an admission webhook)
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import ssl
import sys

from estimator.errors import BatchfitError, MissingExtraError, NoGPUError, SpecError

GIB = 2**30


def _read_spec(path: str, flag: str = "--spec") -> object:
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8") as f:
                text = f.read()
    except OSError as exc:
        raise SpecError(flag, path, f"a readable JSON file ({exc.strerror})") from exc
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecError(flag, path, f"a JSON object ({exc.msg} at line {exc.lineno} column {exc.colno})") from exc


def _progress(enabled: bool):
    if not enabled or not sys.stderr.isatty():
        return None
    return lambda n, note: print(f"\r  simulated {n:3d} steps ({note})\033[K", end="", file=sys.stderr, flush=True)


def _request_from_args(args: argparse.Namespace):
    data = _read_spec(args.spec)
    if args.model is not None:
        if not isinstance(data, dict):
            raise SpecError("(body)", data, "a JSON object")
        data = {**data, "model": {"source": "custom", "factory": args.model}}
    from transformers.utils import logging as hf_logging

    from estimator.request.parse import parse_request

    hf_logging.set_verbosity_error()  # its info lines would mix into our output
    return parse_request(data, allow_local_code=args.model is not None)


def _estimate(args: argparse.Namespace) -> int:
    from estimator.pipeline import estimate, estimate_from_profile

    if (args.spec is None) == (args.profile is None):
        raise SpecError("--spec/--profile", None, "exactly one of --spec FILE or --profile FILE")
    if args.by_module is not None and args.profile is not None:
        raise SpecError("--by-module", "--profile", "--spec FILE: a profile has no model to break down by module")
    if args.by_module is not None and args.by_module < 1:
        raise SpecError("--by-module", args.by_module, "a number of modules >= 1")
    progress = _progress(not args.json)
    request = profile = None
    if args.profile is not None:
        from estimator.portable.profile import PortableProfile

        profile = PortableProfile.from_json(_read_spec(args.profile, "--profile"))
        response = estimate_from_profile(profile, gpus=args.gpus, batch_size=args.batch_size)
    else:
        if args.gpus is not None or args.batch_size is not None:
            raise SpecError("--gpus/--batch-size", args.gpus or args.batch_size, "set in the spec with --spec")
        request = _request_from_args(args)
        response = estimate(request, progress=progress)
    if progress is not None:
        print(file=sys.stderr)
    view = None
    if args.plot is not None or args.snapshot is not None:
        view = _view(args, response, request, profile)
    by_module = _by_module(request, response) if request is not None and args.by_module is not None else None
    if args.json:
        from estimator.plan.results import to_json, to_json_text

        if by_module is None:
            print(to_json_text(response, indent=2))
        else:
            mb, report = by_module
            doc = {"batch_size": report.batch_size, "gpu": report.gpu, "peak_phase": report.peak_phase,
                   "peak_module": report.peak_module, **mb.as_json(args.by_module)}
            print(json.dumps({**to_json(response), "by_module": doc}, indent=2))
    else:
        _table(response)
        if by_module is not None:
            mb, report = by_module
            _module_table(mb, report, args.by_module)
    if view is not None:
        _write_views(args, view)
    return 0


def _by_module(request, response):
    """(per-module breakdown, report) of the first card's step at its memory batch, simulated again
    with the meta model at hand (estimator/replay/modules.py)."""
    from estimator.models import build
    from estimator.models.meta import build_on_meta
    from estimator.replay.modules import breakdown_by_module
    from estimator.replay.report import report_from_trace
    from estimator.request.adapt import job_of
    from estimator.simulate.record import record_built
    from estimator.simulate.step import cast_model

    job = job_of(request)
    card, recipe, built = job.cards[0], job.recipe, build(job.model, job.input)
    batch, reserve = response.results[0].memory.batch_size, request.planner.reserve_bytes
    trace = record_built(built, batch, recipe, card)
    report = report_from_trace(trace, batch, card, reserve_bytes=reserve)
    model = cast_model(build_on_meta(built.factory), recipe)  # as record_training builds it
    return breakdown_by_module(trace, card, model, reserve_bytes=reserve), report


def _module_table(mb, report, top: int) -> None:
    """The top modules by activation and parameter bytes at the peak, in fvcore's table style."""
    from estimator.replay.modules import format_table, not_in_columns

    where = f"{report.peak_phase}, module {report.peak_module}" if report.peak_module else report.peak_phase
    print(f"\nby module at the peak (batch {report.batch_size} on {report.gpu}, {where}): the {top} modules "
          "holding the most activation and the most parameter bytes, and the modules they are in")
    print(format_table(mb, top))
    print("a row counts its submodules; the model row is every byte live at the peak (what runs outside any "
          "module, as the loss and the optimizer step, counts there only); bytes are allocator blocks")
    rest = not_in_columns(mb)
    if rest:
        print(f"not by module: {rest}")


def _profile(args: argparse.Namespace) -> int:
    from estimator.pipeline import make_profile

    progress = _progress(True)
    profile = make_profile(_request_from_args(args), progress=progress)
    if progress is not None:
        print(file=sys.stderr)
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f)
    print(f"wrote {args.output}: {profile.model}, attention backends {', '.join(profile.steps) or 'none'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from estimator.measure.cuda import as_json, validate

    request = _request_from_args(args)
    response, v = validate(request, batch_size=args.batch_size)
    if args.json:
        from estimator.plan.results import to_json

        print(json.dumps({**to_json(response), "validation": as_json(v)}, indent=2))
        return 0 if not v.measured.oom and v.measured.error is None else 5
    m = v.measured
    print(f"{m.gpu} (driver {m.driver}, torch {m.torch}, CUDA {m.cuda}), batch {m.batch_size}, "
          f"measured context {m.context_bytes / 2**20:.0f} MiB")
    for name, predicted in v.predicted.items():
        err = v.errors.get(name)
        real = {"allocated_peak_bytes": m.allocated_peak_bytes, "reserved_peak_bytes": m.reserved_peak_bytes,
                "device_peak_bytes": m.device_used_bytes + m.context_bytes}[name]
        print(f"  {name:<22} predicted {predicted / GIB:8.2f} GiB  measured {real / GIB:8.2f} GiB  "
              f"error {'n/a' if err is None else f'{err:+.1%}'}")
    if m.oom or m.error:
        print(f"error: {m.error}", file=sys.stderr)
        return 5
    return 0


def _view(args: argparse.Namespace, response, request, profile):
    """The first card's step for --plot and --snapshot: at batch_size, else its recommended batch, else its max,
    else its smallest; simulated again (or synthesized from the profile)."""
    from estimator.pipeline import profile_view, step_view

    if profile is not None:
        return profile_view(profile, args.gpus, args.batch_size, response=response)
    assert request is not None  # --spec: parsed once, by _estimate (stdin is read once)
    return step_view(request, response=response)


def _write_views(args: argparse.Namespace, view) -> None:
    """--plot FILE.png and --snapshot FILE.pickle; each says what it wrote (on stderr beside --json's output)."""
    out = sys.stderr if args.json else sys.stdout
    if args.plot is not None:
        from estimator.cli.plot import draw_timeline
        from estimator.replay.timeline import timeline_of

        try:
            draw_timeline(timeline_of(view), args.plot)
        except OSError as exc:
            raise SpecError("--plot", args.plot, f"a file that can be written ({exc.strerror})") from exc
        print(f"wrote {args.plot}", file=out)
    if args.snapshot is not None:
        from estimator.replay.snapshot import snapshot_of

        snapshot = snapshot_of(view)
        try:
            with open(args.snapshot, "wb") as f:
                pickle.dump(snapshot, f)
        except OSError as exc:
            raise SpecError("--snapshot", args.snapshot, f"a file that can be written ({exc.strerror})") from exc
        print(f"wrote {args.snapshot} (open it at https://pytorch.org/memory_viz)", file=out)


def _gib(m) -> str:
    return "-" if m is None else f"{m.device_peak_bytes / GIB:.2f}"


def _table(r) -> None:
    """One row per card: both batches and their device peaks; time, accumulation and LR when asked for."""
    rows = r.results
    timed = any(g.step_seconds is not None for g in rows)
    epochs = any(g.epoch_seconds is not None for g in rows)
    accumulated = any(g.accumulation is not None for g in rows)
    advised = any(g.learning_rate is not None for g in rows)
    ranked = any(g.world_size > 1 or g.min_world_size is not None for g in rows)
    head = (f"{'gpu':<24} {'memory GiB':>10} {'max batch':>10} {'recommended':>12} {'at batch':>9} "
            f"{'device peak GiB':>16} {'at max':>7} {'at rec':>7}")
    head += f" {'ranks':>6} {'global batch':>13}" if ranked else ""
    head += f" {'step s':>8}" if timed else ""
    head += f" {'epoch s':>9}" if epochs else ""
    head += f" {'micro x steps x ranks':>22}" if accumulated else ""
    head += f" {'lr':>10}" if advised else ""
    print(head + f" {'fits':>5}")
    for g in rows:
        m = g.memory
        line = (f"{g.gpu:<24} {g.capacity_bytes / GIB:>10.1f} {str(g.max_batch_size):>10} "
                f"{str(g.recommended_batch_size):>12} {m.batch_size:>9} {m.device_peak_bytes / GIB:>16.2f} "
                f"{_gib(g.max_memory):>7} {_gib(g.recommended_memory):>7}")
        if ranked:
            line += f" {g.world_size:>6} {str(g.global_batch_size or '-'):>13}"
        if timed:
            line += f" {'-' if g.step_seconds is None else f'{g.step_seconds:.3f}':>8}"
        if epochs:
            line += f" {'-' if g.epoch_seconds is None else f'{g.epoch_seconds:.0f}':>9}"
        if accumulated:
            a = g.accumulation
            plan = "-" if a is None else f"{a.micro_batch} x {a.steps} x {a.ranks} = {a.global_batch}"
            line += f" {plan:>22}"
        if advised:
            line += f" {'-' if g.learning_rate is None else f'{g.learning_rate.lr:.3g}':>10}"
        print(line + f" {'yes' if m.fits else 'NO':>5}")
    if ranked:
        print("batch sizes are per rank (micro-batches); global batch = recommended x ranks x accumulation steps")
    for g in rows:
        for s in g.suggestions:
            print(f"{g.gpu}: fits with {s.description}: {json.dumps(s.change)}")
    lr = next((g.learning_rate for g in rows if g.learning_rate is not None), None)
    if lr is not None:
        print(f"\nlearning rate: {lr.rule} scaling; {lr.why}; warm-up: {lr.warmup}")
    b = r.breakdown
    print(f"\nat the peak (batch {b.batch_size}, first card), GiB: parameters {b.parameters / GIB:.2f}, "
          f"gradients {b.gradients / GIB:.2f}, optimizer state {b.optimizer_state / GIB:.2f}, "
          f"activations {b.activations / GIB:.2f}, temporaries {b.temporaries / GIB:.2f}, inputs {b.inputs / GIB:.2f}, "
          f"workspace {b.workspace / GIB:.2f}")
    print(f"per sample {r.per_sample_bytes / 2**20:.1f} MiB, fixed {r.fixed_bytes / GIB:.2f} GiB, "
          f"{r.parameter_count:,} parameters, {r.provenance.simulations} simulations in {r.provenance.seconds:.1f} s")
    for line in r.assumptions:
        print(f"  assumed: {line}")
    for line in r.warnings:
        print(f"  warning: {line.message}")


def _gpus(args: argparse.Namespace) -> int:
    from estimator.gpus import CATALOG

    print(f"{'name':<24} {'memory (MiB)':>12} {'cc':>4} {'context (MiB)':>13}  also (GFD product labels, MIG resource)")
    for g in CATALOG.values():
        also = ", ".join([*g.aliases, *([g.mig_resource] if g.mig_resource else [])])
        print(f"{g.name:<24} {g.memory_bytes // 2**20:>12} {g.compute_capability:>4} {g.context_bytes // 2**20:>13}  "
              f"{also}")
    return 0


def _tls_files(certfile: str | None, keyfile: str | None) -> None:
    """Refuse a TLS setup uvicorn would fail on, as one ``error:`` line rather than its traceback.

    Both files or neither; each readable; and the pair must load as a server's certificate chain and
    private key, checked with the ssl module as uvicorn will load them. An encrypted key is refused: no
    password is taken, and OpenSSL would otherwise prompt for one on the terminal.
    """
    if certfile is None and keyfile is None:
        return
    if certfile is None or keyfile is None:
        given, other = ("--ssl-certfile", "--ssl-keyfile") if keyfile is None else ("--ssl-keyfile", "--ssl-certfile")
        raise SpecError(given, certfile or keyfile, f"{other} FILE with it: HTTPS needs both --ssl-certfile and "
                                                    "--ssl-keyfile")
    for flag, path in (("--ssl-certfile", certfile), ("--ssl-keyfile", keyfile)):
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as exc:
            raise SpecError(flag, path, f"a readable PEM file ({exc.strerror})") from exc

    def no_password() -> str:
        raise SpecError("--ssl-keyfile", keyfile, "an unencrypted private key (this one is encrypted; batchfit "
                                                  "serve takes no password)")

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=no_password)
    except ssl.SSLError as exc:
        reason = re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))  # OpenSSL's source line says nothing to a user
        if "PEM lib" in reason:  # which names neither file: the certificate file holds a certificate, or not
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(cafile=certfile)
                reason += "; --ssl-keyfile holds no PEM private key"
            except ssl.SSLError:
                reason += "; --ssl-certfile holds no PEM certificate"
        raise SpecError("--ssl-certfile/--ssl-keyfile", (certfile, keyfile),
                        f"a PEM certificate chain and the private key that matches it (ssl: {reason})") from exc


def _serve(args: argparse.Namespace) -> int:
    _tls_files(args.ssl_certfile, args.ssl_keyfile)  # before the imports: a bad flag fails fast
    # what the service imports that the core does not install: the service extra
    service_modules = {"uvicorn", "fastapi", "starlette", "pydantic_settings", "prometheus_client", "httpx", "redis"}
    try:
        import uvicorn

        import app.main  # noqa: F401  the service's imports, checked here rather than inside uvicorn
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in service_modules:
            raise  # a defect, not a missing extra
        raise MissingExtraError("service", "batchfit serve", str(exc)) from exc
    uvicorn.run("app.main:create_app", factory=True, host=args.host, port=args.port,
                ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="batchfit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("gpus", help="list the GPU catalog").set_defaults(func=_gpus)
    est = sub.add_parser("estimate", help="max batch and memory per GPU for a request (docs/API.md)")
    est.add_argument("--spec", help="request JSON file, or - for stdin")
    est.add_argument("--profile", help="a profile from `batchfit profile` (answers without the model's code)")
    est.add_argument("--gpus", nargs="+", help="with --profile: catalog names (default: the whole catalog)")
    est.add_argument("--batch-size", type=int, help="with --profile: also report memory at this batch")
    est.add_argument("--json", action="store_true", help="print the response as JSON (docs/API.md)")
    est.add_argument("--plot", metavar="FILE.png",
                     help="draw the first card's step (at batch_size, else its recommended batch, else its max, "
                          "else its smallest), stacked by category, with the card's usable memory and the peak")
    est.add_argument("--snapshot", metavar="FILE.pickle",
                     help="write that step as a CUDA memory snapshot (torch.cuda.memory._snapshot()'s pickle), "
                          "to open at https://pytorch.org/memory_viz")
    est.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                     help="a local nn.Module factory (imported here; replaces the spec's model)")
    est.add_argument("--by-module", nargs="?", type=int, const=5, metavar="N",
                     help="with --spec: the first card's step at its memory batch again, and a table of the N "
                          "modules (default 5) holding the most activation and parameter bytes at the peak; "
                          "with --json, a top-level \"by_module\" key beside the response's (not part of "
                          "docs/API.md's response)")
    est.set_defaults(func=_estimate)
    val = sub.add_parser("validate", help="estimate, then run one real CUDA step and compare (needs a GPU)")
    val.add_argument("--spec", required=True, help="request JSON file, or - for stdin")
    val.add_argument("--batch-size", type=int, help="the batch to run (default: the first card's max)")
    val.add_argument("--json", action="store_true")
    val.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY", help="a local nn.Module factory")
    val.set_defaults(func=_validate)
    prof = sub.add_parser("profile", help="write the portable profile (affine trace) of a request's model")
    prof.add_argument("--spec", required=True, help="request JSON file, or - for stdin")
    prof.add_argument("-o", "--output", required=True, help="where to write the profile JSON")
    prof.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY", help="a local nn.Module factory")
    prof.set_defaults(func=_profile)
    serve = sub.add_parser("serve", help="run the HTTP service (HTTPS with --ssl-certfile and --ssl-keyfile)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--ssl-certfile", metavar="FILE",
                       help="serve HTTPS: the server's PEM certificate (its chain after it), with --ssl-keyfile")
    serve.add_argument("--ssl-keyfile", metavar="FILE", help="the PEM private key of --ssl-certfile (unencrypted)")
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except NoGPUError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 4
    except BatchfitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
