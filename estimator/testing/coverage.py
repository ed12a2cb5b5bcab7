"""The coverage sweep: does every model type a user may bring simulate a training step?

Types come from the installed transformers (every model type its auto mappings send to causal-LM, masked-LM,
seq2seq-LM and image-classification) and from a fixed, seeded sample of ``timm.list_models()``. Each is
estimated through the request path a user takes (``parse_request`` -> ``job_of`` -> ``build`` ->
``record_built``): one simulated step at batch 2, amp-bf16, AdamW, on an A100-80GB.

A transformers config is derived from its config class's defaults, made small in depth only (hidden sizes stay
the class's defaults, so the layers simulated are the real ones):

- every integer attribute naming a layer count (``num_hidden_layers``, ``n_layer``, ``encoder_layers``, ...) is
  cut to at most 2, in the config and in every sub-config (``text_config``, ``encoder``, ...); a hybrid whose
  per-layer list needs more leading entries to hold one layer of every kind (qwen3_next's three linear-attention
  layers before its first full one) keeps that many, a whole period where the list repeats one (dory's
  (attention, mlp) pairs in groups of four: 8 entries), up to ``MAX_LAYERS``;
- counts that split another into sections (dory: input + recurrent + output layers = num_hidden_layers) keep
  their sum: each section gets its share of the new total, at least one layer;
- a per-layer list whose length was one of those counts (``layer_types``, ``block_types``, ...) keeps its first
  entries, as many as the new count;
- a seq2seq config without ``decoder_start_token_id`` (labels are shifted right from it) gets its pad id, or 0;
- a list of layer indices (``attn_layer_indices``, ``mlp_only_layers``, ...) keeps the indices below the new
  count, or, where it named layers that are all cut (bamba's attention at 9, 18, 27), the last kept layer, so that
  the kind it names is still simulated; a dict keyed by layer index (``per_layer_config``) keeps the indices
  below the new count; a count of shared layers
  (``num_kv_shared_layers``, the last layers) becomes half the new count, the new count doubled first where the
  pattern needs more than 2, so that both the layers making the cache and those sharing it hold every kind;
- coverage_overrides.json (each entry with its reason), where a class needs it: its keys are given to the
  config class before the defaults are read, and merged over the derived config last; an entry keyed
  "task:type" holds for that task only, and its ``input`` replaces request input fields where a model trains
  only at another sequence length (reformer's axial positions).

Outcomes: ``simulates``; ``422`` (a batchfit ``SpecError`` with its stated reason); ``fails`` (any other
exception: its type and first line).
"""

from __future__ import annotations

import copy
import json
import random
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from types import FrameType
from typing import Any

from estimator.errors import SpecError

TASK_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
NEW_LAYERS = 2
MAX_LAYERS = 8  # a hybrid keeps up to this many layers so that every kind of layer in its pattern is simulated
TIMM_SEED = 16
TIMM_SAMPLE = 100
SEQ_LEN = 64
BATCH = 2
GPU = "A100-80GB"
TRAINING = {"precision": "amp-bf16", "optimizer": {"name": "adamw"}}

# An attribute holding a layer count: n_layer(s), num_layers, num_hidden_layers, encoder_layers,
# num_decoder_layers, decoder_num_layers, text_num_hidden_layers, ... (not *_layer_indices, not lists).
_LAYER_COUNT = re.compile(r"^(n_layers?|(\w+_)?layers|num_(\w+_)?layers|(\w+_)?num_(\w+_)?layers|(\w+_)?n_layers?)$")
# A list of layer indices, kept below the new count.
_INDEX_LIST = re.compile(r"(layer_(indices|ids|idx)|_layers|layers_to_\w+|_layer_ids|_layer_idx)$")


def _json(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(resources.files("estimator.testing").joinpath(name).read_text())
    return {k: v for k, v in data.items() if not k.startswith("_")}


def overrides() -> dict[str, dict[str, Any]]:
    """model type (or "task:type") -> {"reason": why, "config": keys merged over the derived config, "input":
    the request's input fields, where given}."""
    return _json("coverage_overrides.json")


def override(model_type: str, task: str) -> dict[str, Any]:
    """The override for ``model_type`` in ``task``: a "task:type" entry before the type's own."""
    table = overrides()
    return table.get(f"{task}:{model_type}", table.get(model_type, {}))


def exclusions() -> dict[str, str]:
    """"task:type" (or "timm:name") -> why it does not simulate; the list may only shrink."""
    return _json("coverage_exclusions.json")


def transformers_types() -> dict[str, list[str]]:
    """task -> the model types the installed transformers maps to it (sorted)."""
    from transformers.models.auto import modeling_auto

    return {task: sorted(getattr(modeling_auto, name)) for task, name in TASK_MAPPINGS.items()}


def timm_names() -> list[str]:
    """The fixed random sample of timm model names (seeded: the same names on every run of one timm)."""
    import timm

    names = sorted(timm.list_models())
    return random.Random(TIMM_SEED).sample(names, min(TIMM_SAMPLE, len(names)))


def _kinds(entries: list[Any]) -> set[str]:
    return {json.dumps(v, sort_keys=True) for v in entries}


def _pattern_length(entries: list[Any]) -> int | None:
    """How many leading entries of a per-layer list keep one layer of every kind it names: its whole period where
    the list repeats one (dory's (attention, mlp) pairs: cutting inside a pair or a group of four breaks it),
    else its shortest prefix holding every kind (zamba's two leading Mamba layers, then its pattern)."""
    try:
        kinds = _kinds(entries)
    except TypeError:
        return None
    n = len(entries)
    period = next(p for p in range(1, n + 1) if all(entries[i] == entries[i % p] for i in range(n)))
    if period <= MAX_LAYERS and period < n:
        return period
    return next(k for k in range(1, n + 1) if _kinds(entries[:k]) == kinds)


def _shares(total: int, parts: dict[str, int], new: int) -> dict[str, int]:
    """``parts`` (counts summing to ``total``) scaled to sum to ``new``, each at least 1 (largest remainders)."""
    exact = {key: value * new / total for key, value in parts.items()}
    out = {key: max(1, int(x)) for key, x in exact.items()}
    for key in sorted(exact, key=lambda k: exact[k] - int(exact[k]), reverse=True):
        if sum(out.values()) >= new:
            break
        out[key] += 1
    return out


def _cut(d: dict[str, Any]) -> dict[str, Any]:
    """The changed keys of one config dict (see the module docstring); recurses into sub-config dicts."""
    changes: dict[str, Any] = {}
    counts = {key: value for key, value in d.items()
              if isinstance(value, int) and not isinstance(value, bool) and _LAYER_COUNT.match(key)}
    old_counts = {v for v in counts.values() if v > NEW_LAYERS}
    per_layer = {key: value for key, value in d.items() if isinstance(value, list) and len(value) in old_counts}
    new = NEW_LAYERS
    for entries in per_layer.values():  # keep one layer of every kind a per-layer list names (a hybrid's pattern)
        length = _pattern_length(entries)
        if length is not None and length <= MAX_LAYERS:
            new = max(new, length)
    main = max(counts.values(), default=0)
    shared = [key for key, value in counts.items() if "shared" in key and 0 < value < main]
    if shared and new > NEW_LAYERS:  # the layers that produce a cache hold every kind too, and so do those sharing it
        new *= 2
    # Counts that split another into sections (dory: input + recurrent + output layers = num_hidden_layers) keep
    # their sum: each section its share of the new total, at least one layer.
    parts: dict[str, int] = {}
    total_key = next((key for key, value in counts.items() if value > new
                      and sum(v for k, v in counts.items() if k != key and 0 < v < value) == value), None)
    if total_key is not None:
        parts = {k: v for k, v in counts.items() if k != total_key and 0 < v < counts[total_key]}
        new = max(new, len(parts))
        changes.update(_shares(counts[total_key], parts, new))
    for key, value in counts.items():
        if key in parts:
            continue
        if key in shared:  # a share of the layers (gemma3n's kv-shared ones): half of them, or 1 of 2
            changes[key] = new // 2
        elif value > new:
            changes[key] = new
    if old_counts:
        for key, value in d.items():
            if not isinstance(value, list) or key in changes:
                continue
            if key in per_layer:  # one entry per layer
                changes[key] = value[:new]
            elif _INDEX_LIST.search(key) and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
                # the layers of one kind (bamba's attention at 9, 18, 27): those kept, or the last layer kept
                kept = [i for i in value if i < new] or ([new - 1] if value else [])
                if kept != value:
                    changes[key] = kept
        for key, value in d.items():  # per-layer settings keyed by layer index (gemma4's per_layer_config)
            if "layer" in key and isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
                kept_keys = {k: v for k, v in value.items() if int(k) < new}
                if len(kept_keys) != len(value):
                    changes[key] = kept_keys
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:
            sub = _cut(value)
            if sub:
                changes[key] = {**value, **sub}
    return changes


def _merge(into: dict[str, Any], extra: dict[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def derive_config(model_type: str, task: str = "causal-lm") -> dict[str, Any]:
    """The small inline config for ``model_type``: the class's defaults with layer counts cut, plus overrides."""
    from transformers import AutoConfig

    extra = override(model_type, task).get("config", {})
    base = AutoConfig.for_model(model_type, **copy.deepcopy(extra))
    defaults = base.to_dict()
    config = _cut(defaults)
    if task == "seq2seq-lm" and getattr(base, "decoder_start_token_id", None) is None:
        # Labels are shifted right from this token; checkpoints set it (0 or the pad id), some classes' defaults not.
        pad = getattr(base, "pad_token_id", None)
        config["decoder_start_token_id"] = pad if isinstance(pad, int) else 0
    _merge(config, copy.deepcopy(extra))
    config["model_type"] = model_type
    return config


def transformers_request(task: str, model_type: str) -> dict[str, Any]:
    req: dict[str, Any] = {
        "model": {"source": "transformers", "config": derive_config(model_type, task), "task": task},
        "training": TRAINING, "gpus": [GPU], "batch_size": BATCH,
        "planner": {"curve_points": 0, "confirm": "none", "suggestions": False},
    }
    if task != "image-classification":
        req["input"] = {"seq_len": SEQ_LEN, **override(model_type, task).get("input", {})}
    return req


def timm_request(name: str) -> dict[str, Any]:
    import timm

    cfg = timm.get_pretrained_cfg(name)
    size = list(cfg.input_size) if cfg is not None else [3, 224, 224]
    return {"model": {"source": "timm", "name": name}, "input": {"image_size": size}, "training": TRAINING,
            "gpus": [GPU], "batch_size": BATCH}


@dataclass
class Outcome:
    key: str  # "task:type" or "timm:name"
    status: str  # simulates | 422 | fails
    reason: str  # "" when it simulates
    seconds: float


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: FrameType | None) -> None:
    raise _Timeout


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


def simulate(request: dict[str, Any], timeout_s: int = 0) -> tuple[str, str]:
    """(status, reason) of one request's simulated step at its batch size on its card."""
    from estimator.gpus import get_gpu
    from estimator.models import build
    from estimator.request.adapt import job_of
    from estimator.request.parse import parse_request
    from estimator.simulate.record import record_built

    old = signal.signal(signal.SIGALRM, _alarm) if timeout_s else None
    if timeout_s:
        signal.alarm(timeout_s)
    try:
        parsed = parse_request(request)
        job = job_of(parsed)
        record_built(build(job.model, job.input), parsed.batch_size or BATCH, job.recipe, get_gpu(GPU))
        return "simulates", ""
    except SpecError as exc:
        return "422", f"{exc.field}: expected {exc.expected}"[:300]
    except _Timeout:
        return "fails", f"timeout after {timeout_s} s"
    except Exception as exc:  # noqa: BLE001 - the sweep classifies every failure
        return "fails", _first_line(exc)
    finally:
        if timeout_s:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)


def run_one(key: str, timeout_s: int = 0) -> Outcome:
    """The outcome for "task:type" (transformers) or "timm:name"."""
    source, name = key.split(":", 1)
    start = time.monotonic()
    try:
        request = timm_request(name) if source == "timm" else transformers_request(source, name)
    except Exception as exc:  # noqa: BLE001 - deriving the config is part of what is swept
        return Outcome(key, "fails", "deriving the config: " + _first_line(exc), time.monotonic() - start)
    status, reason = simulate(request, timeout_s)
    return Outcome(key, status, reason, time.monotonic() - start)


def all_keys() -> list[str]:
    keys = [f"{task}:{t}" for task, types in transformers_types().items() for t in types]
    return keys + [f"timm:{n}" for n in timm_names()]


def sweep(keys: list[str], timeout_s: int = 0) -> Iterator[Outcome]:
    for key in keys:
        yield run_one(key, timeout_s)
