"""The ``batchfit`` command line.

  batchfit estimate --preset gpt2-large --seq-len 1024 --precision amp-bf16 --gpus A100-80GB L4
  batchfit estimate --timm convnext_base --image-size 224 --gpus T4 --batch-size 64
  batchfit estimate --spec request.json --json          # the response of POST /estimate (docs/API.md)
  batchfit estimate --spec request.json --gpus H100     # the spec's request on other cards
  batchfit estimate --spec req.json --model mypkg.nets:make   # a local nn.Module factory
  batchfit estimate --spec req.json --plot step.png --snapshot step.pickle   # the step, drawn; for memory_viz
  batchfit profile --spec req.json -o profile.json       # the affine trace, portable
  batchfit profile push profile.json --url http://batchfit:8000   # stored in the service: prints its id
  batchfit estimate --profile profile.json --gpus A100-80GB H100-80GB
  batchfit serve --host 0.0.0.0 --ssl-certfile tls.crt --ssl-keyfile tls.key   # HTTPS (an admission webhook)

Each simulation is one line on stderr (--quiet: none). Arguments and the request are checked before the
simulator's libraries load, so a bad one fails at once.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time
import warnings
from typing import Any

from estimator.cli.spec import add_request_flags, parse_args_request, read_json
from estimator.errors import BatchfitError, NoGPUError, SpecError


def _progress(quiet: bool) -> Any:
    """One stderr line per full simulation: ``simulation 3: batch 2 on A100-80GB (4.1 s)``."""
    if quiet:
        return None
    count = [0]

    def tell(done: int, note: str) -> None:
        count[0] += 1
        print(f"simulation {count[0]}: {note}", file=sys.stderr, flush=True)
    return tell


def _quiet_libraries() -> None:
    """The model libraries' deprecation notices and info lines say nothing about the answer."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"transformers(\.|$)")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch(\.|$)")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _estimate(args: argparse.Namespace) -> int:
    if args.by_module is not None and args.profile is not None:
        raise SpecError("--by-module", "--profile", "--spec FILE: a profile has no model to break down by module")
    if args.by_module is not None and args.by_module < 1:
        raise SpecError("--by-module", args.by_module, "a number of modules >= 1")
    for flag, path in (("--plot", args.plot), ("--snapshot", args.snapshot)):
        _writable(flag, path)
    request = profile = None
    if args.profile is not None:
        if args.spec is not None:
            raise SpecError("--spec/--profile", None, "exactly one of --spec FILE or --profile FILE")
        from estimator.portable.profile import PortableProfile

        profile = PortableProfile.from_json(read_json(args.profile, "--profile"))
    else:
        request = parse_args_request(args)  # torch-free: a bad request fails before the simulator loads
    started = time.perf_counter()
    _quiet_libraries()
    from estimator.pipeline import estimate, estimate_from_profile

    if profile is not None:
        response = estimate_from_profile(profile, gpus=args.gpus, batch_size=args.batch_size)
    else:
        assert request is not None
        response = estimate(request, progress=_progress(args.quiet))
        if not args.quiet:
            print(f"{response.provenance.simulations} simulations in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
    view = _view(args, response, request, profile) if args.plot or args.snapshot else None
    by_module = _by_module(request, response) if request is not None and args.by_module is not None else None
    if args.json:
        from estimator.plan.results import to_json

        doc = to_json(response)
        if by_module is not None:
            mb, report = by_module
            doc["by_module"] = {"batch_size": report.batch_size, "gpu": report.gpu, "peak_phase": report.peak_phase,
                                "peak_module": report.peak_module, **mb.as_json(args.by_module)}
        print(json.dumps(doc, indent=2))
    else:
        from estimator.cli.tables import print_answer, print_modules

        print_answer(response, request.batch_size if request is not None else args.batch_size)
        if by_module is not None:
            mb, report = by_module
            print_modules(mb, report, args.by_module)
    if view is not None:
        _write_views(args, view)
    return 0


def _writable(flag: str, path: str | None) -> None:
    """A file ``path`` can be written to (checked before the simulations, which take a while)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise SpecError(flag, path, f"a file that can be written (its folder {folder} "
                        f"{'is not writable' if os.path.isdir(folder) else 'does not exist'})")


def _by_module(request: Any, response: Any) -> Any:
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


def _profile(args: argparse.Namespace) -> int:
    request = parse_args_request(args)
    _quiet_libraries()
    from estimator.pipeline import make_profile

    profile = make_profile(request, progress=_progress(args.quiet))
    with open(args.output, "w", encoding="utf-8") as f:
        json.dump(profile.to_json(), f)
    print(f"wrote {args.output}: {profile.model}, attention backends {', '.join(profile.steps) or 'none'}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    request = parse_args_request(args)
    _quiet_libraries()
    from estimator.measure.cuda import as_json, validate

    response, v = validate(request, batch_size=args.run_batch)
    if args.json:
        from estimator.plan.results import to_json

        print(json.dumps({**to_json(response), "validation": as_json(v)}, indent=2))
        return 0 if not v.measured.oom and v.measured.error is None else 5
    from estimator.cli.tables import print_validation

    print_validation(v)
    if v.measured.oom or v.measured.error:
        print(f"error: {v.measured.error}", file=sys.stderr)
        return 5
    return 0


def _view(args: argparse.Namespace, response: Any, request: Any, profile: Any) -> Any:
    """The first card's step for --plot and --snapshot: at batch_size, else its recommended batch, else its max,
    else its smallest; simulated again (or synthesized from the profile)."""
    from estimator.pipeline import profile_view, step_view

    if profile is not None:
        return profile_view(profile, args.gpus, args.batch_size, response=response)
    return step_view(request, response=response)


def _write_views(args: argparse.Namespace, view: Any) -> None:
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


def _gpus(args: argparse.Namespace) -> int:
    from estimator.cli.tables import print_catalog

    print_catalog()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from estimator.cli.serve import serve

    return serve(args.host, args.port, args.ssl_certfile, args.ssl_keyfile)


def _parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="batchfit", description=__doc__, formatter_class=raw)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("gpus", help="list the GPU catalog").set_defaults(func=_gpus)
    est = sub.add_parser("estimate", help="max batch and memory per GPU for a request (docs/API.md)",
                         description=__doc__, formatter_class=raw)
    add_request_flags(est)
    est.add_argument("--profile", help="a profile from `batchfit profile` (answers without the model's code)")
    est.add_argument("--json", action="store_true", help="print the response as JSON (docs/API.md)")
    est.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    est.add_argument("--plot", metavar="FILE.png",
                     help="draw the first card's step (at batch_size, else its recommended batch, else its max, "
                          "else its smallest), stacked by category, with the card's usable memory and the peak")
    est.add_argument("--snapshot", metavar="FILE.pickle",
                     help="write that step as a CUDA memory snapshot (torch.cuda.memory._snapshot()'s pickle), "
                          "to open at https://pytorch.org/memory_viz")
    est.add_argument("--by-module", nargs="?", type=int, const=5, metavar="N",
                     help="with --spec: the first card's step at its memory batch again, and a table of the N "
                          "modules (default 5) holding the most activation and parameter bytes at the peak; "
                          "with --json, a top-level \"by_module\" key beside the response's (not part of "
                          "docs/API.md's response)")
    est.set_defaults(func=_estimate)
    val = sub.add_parser("validate", help="estimate, then run one real CUDA step and compare (needs a GPU)")
    add_request_flags(val, overrides=False)
    val.add_argument("--gpus", nargs="+", metavar="GPU", help="the cards to predict for (default: this one)")
    val.add_argument("--batch-size", dest="run_batch", type=int, help="the batch to run (default: the first "
                     "card's max)")
    val.add_argument("--json", action="store_true")
    val.set_defaults(func=_validate, batch_size=None)
    prof = sub.add_parser("profile", help="write the portable profile (affine trace) of a request's model; "
                          "`batchfit profile push FILE --url URL` stores one in a service")
    add_request_flags(prof, overrides=False)
    prof.add_argument("--gpus", nargs="+", metavar="GPU", help="the cards whose attention backends it covers "
                      "besides the catalog's")
    prof.add_argument("-o", "--output", required=True, help="where to write the profile JSON")
    prof.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    prof.set_defaults(func=_profile, batch_size=None)
    serve = sub.add_parser("serve", help="run the HTTP service (HTTPS with --ssl-certfile and --ssl-keyfile)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--ssl-certfile", metavar="FILE",
                       help="serve HTTPS: the server's PEM certificate (its chain after it), with --ssl-keyfile")
    serve.add_argument("--ssl-keyfile", metavar="FILE", help="the PEM private key of --ssl-certfile (unencrypted)")
    serve.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["profile", "push"]:  # a verb of its own: `batchfit profile` itself takes a request's flags
        from estimator.cli.push import push, push_parser

        args = push_parser().parse_args(argv[2:])
        args.func = push
    else:
        args = _parser().parse_args(argv)
    try:
        return int(args.func(args))
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
