"""The request a command line describes: a spec file, quick flags for the common case, or both (the flags win).

>>> parse_args(["--preset", "gpt2", "--seq-len", "1024", "--gpus", "T4", "L4"])   # doctest: +SKIP
{'model': {'source': 'transformers', 'preset': 'gpt2'}, 'input': {'seq_len': 1024}, 'gpus': ['T4', 'L4']}

Torch-free: a bad flag or spec fails before the simulator's libraries load.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from estimator.errors import SpecError

MODEL_FLAGS = ("preset", "timm", "torchvision", "model")


def add_request_flags(parser: argparse.ArgumentParser, *, overrides: bool = True) -> None:
    """The flags that describe a request: ``--spec``, a model, its input, the recipe, the cards."""
    group = parser.add_argument_group("the request (a spec file, these flags, or both: the flags win)")
    group.add_argument("--spec", help="request JSON file (docs/API.md), or - for stdin")
    group.add_argument("--preset", metavar="NAME", help="a transformers preset (batchfit's configs: GET /models)")
    group.add_argument("--timm", metavar="NAME", help="a timm model name")
    group.add_argument("--torchvision", metavar="NAME", help="a torchvision model name")
    group.add_argument("--model", metavar="PACKAGE.MODULE:FACTORY",
                       help="a local nn.Module factory (imported here, from the current directory too)")
    group.add_argument("--task", help="transformers: the head to train (causal-lm, masked-lm, ...)")
    group.add_argument("--seq-len", type=int, metavar="N", help="tokens per sample")
    group.add_argument("--image-size", metavar="[C,]H[,W]", help="an image input: 224, or 3,224,224")
    group.add_argument("--precision", help="fp32, amp-fp16, amp-bf16 or bf16")
    group.add_argument("--optimizer", help="sgd, adam, adamw, adagrad, rmsprop, adafactor, ...")
    group.add_argument("--checkpointing", nargs="?", const="true", metavar="MODE",
                       help="gradient checkpointing (true, reentrant, non-reentrant, selective)")
    if overrides:
        group.add_argument("--gpus", nargs="+", metavar="GPU", help="the cards (names as `batchfit gpus` lists "
                           "them, nvidia-smi's, or families: T4, L4, A10G, H200)")
        group.add_argument("--batch-size", type=int, metavar="N", help="also report memory at this batch")


def read_json(path: str, flag: str) -> Any:
    """A JSON file (``-``: stdin), or a ``SpecError`` naming the flag and the path."""
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


def request_doc(args: argparse.Namespace) -> dict[str, Any]:
    """The request's JSON from ``--spec`` and the flags given (``SpecError`` naming the flag when they say
    nothing a request needs, or say it twice)."""
    data: Any = read_json(args.spec, "--spec") if args.spec is not None else {}
    if not isinstance(data, dict):
        raise SpecError("--spec", args.spec, "a JSON object (docs/API.md's request)")
    models = [flag for flag in MODEL_FLAGS if getattr(args, flag, None) is not None]
    if len(models) > 1:
        raise SpecError(f"--{models[1]}", getattr(args, models[1]), f"no second model beside --{models[0]}")
    if models:
        name = getattr(args, models[0])
        source = {"preset": "transformers", "model": "custom"}.get(models[0], models[0])
        key = {"transformers": "preset", "custom": "factory"}.get(source, "name")
        data["model"] = {"source": source, key: name}
    elif "model" not in data:
        raise SpecError("--spec", args.spec, "a model: --spec FILE naming one, or --preset, --timm, --torchvision "
                        "or --model")
    if args.task is not None:
        data["model"] = {**data["model"], "task": args.task}
    inp = dict(data.get("input") or {})
    if args.seq_len is not None:
        inp["seq_len"] = args.seq_len
    if args.image_size is not None:
        inp["image_size"] = _image_size(args.image_size)
    if inp:
        data["input"] = inp
    training = dict(data.get("training") or {})
    if args.precision is not None:
        training["precision"] = args.precision
    if args.optimizer is not None:
        training["optimizer"] = {**(training.get("optimizer") or {}), "name": args.optimizer}
    if args.checkpointing is not None:
        training["gradient_checkpointing"] = {"true": True, "false": False}.get(args.checkpointing.lower(),
                                                                              args.checkpointing)
    if training:
        data["training"] = training
    if getattr(args, "gpus", None) is not None:
        data["gpus"] = args.gpus
    if getattr(args, "batch_size", None) is not None:
        data["batch_size"] = args.batch_size
    return data


def parse_args_request(args: argparse.Namespace) -> Any:
    """The checked request (``estimator.request.parse``, torch-free; its cards too); a local factory (``--model``)
    is imported from the current directory too, as ``python -m`` would."""
    from estimator.request.adapt import job_of
    from estimator.request.parse import parse_request

    data = request_doc(args)
    local = data["model"].get("source") == "custom" if isinstance(data.get("model"), dict) else False
    if local and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    request = parse_request(data, allow_local_code=local)
    job_of(request)  # a card name that is no card fails here, before any build
    return request


def _image_size(text: str) -> list[int]:
    try:
        parts = [int(p) for p in text.replace("x", ",").split(",")]
    except ValueError:
        raise SpecError("--image-size", text, "224 (3 x 224 x 224), or C,H,W such as 3,224,224") from None
    if len(parts) == 1:
        return [3, parts[0], parts[0]]
    if len(parts) == 2:
        return [3, *parts]
    if len(parts) == 3:
        return parts
    raise SpecError("--image-size", text, "224 (3 x 224 x 224), or C,H,W such as 3,224,224")
