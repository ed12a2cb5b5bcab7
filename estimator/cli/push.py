"""``batchfit profile push FILE --url URL [--api-key KEY]``: store a profile in a batchfit service, print its id.

    batchfit profile push p.json --url https://batchfit.example:8000 --api-key "$KEY"
    sha256:3f1c...

The service checks the profile before it stores it (``POST /profiles``); its refusal is printed as it says it
(the field, the value, what was expected). The id answers ``POST /estimate {"profile": id, "gpus": [...]}`` and
names the profile in a pod's ``batchfit.io/profile`` annotation. Standard library only (urllib).
"""

from __future__ import annotations

import argparse
import json
import urllib.error
import urllib.request
from typing import Any

from estimator.cli.spec import read_json
from estimator.errors import BatchfitError, SpecError

TIMEOUT_S = 60.0


def push_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchfit profile push", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", metavar="FILE", help="a profile from `batchfit profile` (or a drop-in's)")
    parser.add_argument("--url", required=True, help="the service's base URL, e.g. http://localhost:8000")
    parser.add_argument("--api-key", help="one of the service's BATCHFIT_API_KEYS (sent as a Bearer token)")
    return parser


def push(args: argparse.Namespace) -> int:
    """POST the file to ``URL/profiles`` and print the id it answers."""
    doc = read_json(args.file, "FILE")
    if not args.url.startswith(("http://", "https://")):
        raise SpecError("--url", args.url, "an http:// or https:// URL of a batchfit service")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    request = urllib.request.Request(args.url.rstrip("/") + "/profiles", data=json.dumps(doc).encode(),
                                     headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 - http(s) checked above
            answer: Any = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        raise _refusal(exc) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise SpecError("--url", args.url, f"a batchfit service that answers ({reason})") from None
    print(answer["id"])
    return 0


def _refusal(exc: urllib.error.HTTPError) -> BatchfitError:
    """The service's problem+json as the error it names: a refused field as a ``SpecError``."""
    try:
        problem = json.loads(exc.read())
    except (ValueError, OSError):
        problem = {}
    if isinstance(problem, dict) and problem.get("field") is not None and exc.code == 422:
        return SpecError(str(problem["field"]), problem.get("value"), str(problem.get("expected")))
    detail = problem.get("detail") if isinstance(problem, dict) else None
    return BatchfitError(f"the service answered {exc.code}: {detail or exc.reason}")
