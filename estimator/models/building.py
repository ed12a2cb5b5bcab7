"""What every builder shares: a name's close matches, probing a factory on meta, blaming a request's value
for a foreign exception (the seam for ``config`` and ``kwargs``), and the input limits.

>>> unknown_name("model.name", "resnet5O", ["resnet50", "resnet18"], "a torchvision model name").expected
'a torchvision model name (did you mean resnet50?)'

Torch is imported only where a model is built, not at import time (the source modules import this).
"""

from __future__ import annotations

import contextlib
import difflib
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from estimator.errors import BatchfitError, SpecError
from estimator.options import MAX_CHANNELS, MAX_SEQ_LEN, MAX_SIDE, MIN_SIDE


def unknown_name(field_name: str, name: str, known: list[str], what: str) -> SpecError:
    """A ``SpecError`` for a name not in ``known``, with close matches."""
    close = difflib.get_close_matches(name.lower(), [k.lower() for k in known], n=3, cutoff=0.6)
    by_lower = {k.lower(): k for k in known}
    hint = f" (did you mean {', '.join(by_lower[c] for c in close)}?)" if close else ""
    return SpecError(field_name, name, f"{what}{hint}")


def _value_errors() -> tuple[type[BaseException], ...]:
    """What constructors raise on a value they cannot use (huggingface_hub's strict configs have their own)."""
    from huggingface_hub.errors import StrictDataclassError

    return (ArithmeticError, AssertionError, AttributeError, LookupError, RuntimeError, TypeError, ValueError,
            StrictDataclassError)


def _culprit(exc: BaseException, given: Mapping[str, Any]) -> str | None:
    """The one key of ``given`` to blame: the only one given (the model builds without it), else the only
    one the message names. The message only narrows the field; the error is a ``SpecError`` either way."""
    keys = [k for k in given if k != "model_type"]
    if len(keys) == 1:
        return keys[0]
    text = f"{exc} {exc.__cause__ or ''}"
    named = [k for k in keys if re.search(rf"(?<!\w){re.escape(k)}(?!\w)", text)]
    return named[0] if len(named) == 1 else None


@contextlib.contextmanager
def given_values(field_name: str, given: Mapping[str, Any] | None, what: str) -> Iterator[None]:
    """The seam for building from a request's ``config`` or ``kwargs``: a foreign exception raised inside
    becomes a ``SpecError`` on the most specific field (``model.config.n_head``), its message in ``expected``.

    With nothing given the exception stays as it is: a shipped preset or a registry default that does not
    build is a defect of batchfit or of the library, not of the request.
    """
    try:
        yield
    except BatchfitError:
        raise
    except _value_errors() as exc:
        if not given:
            raise
        key = _culprit(exc, given)
        raise SpecError(f"{field_name}.{key}" if key else field_name, given[key] if key else dict(given),
                        f"{what} ({describe(exc)})") from exc


def describe(exc: BaseException, limit: int = 300) -> str:
    """A foreign exception as one line of at most ``limit`` characters, for a ``SpecError``'s ``expected``."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def probe(factory: Callable[[], Any], field_name: str, given: Mapping[str, Any] | None) -> Any:
    """Build once on meta so bad ``given`` kwargs or config values fail here, as a ``SpecError``."""
    import torch

    from estimator.models.meta import build_on_meta

    with given_values(field_name, given, "arguments the constructor accepts"):
        model = build_on_meta(factory)
    if not isinstance(model, torch.nn.Module):
        raise SpecError(field_name, given, "a factory returning a torch.nn.Module")
    return model


def check_image(c: int, h: int, w: int, channels_from: tuple[str, Any], side_from: tuple[str, Any]) -> None:
    """A resolved image input within the limits of an explicit ``input.image_size``; a bad value is blamed on
    the (field, value) that set it, so a model's own default cannot take the input past them."""
    if not 1 <= c <= MAX_CHANNELS:
        raise SpecError(*channels_from, f"an input of 1 to {MAX_CHANNELS} channels (the limit on input.image_size)")
    if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
        raise SpecError(*side_from, f"an input of {MIN_SIDE} to {MAX_SIDE} px a side "
                        "(the limit on input.image_size; input.image_size or the model's arguments set it)")


def check_seq_len(seq: int, seq_from: tuple[str, Any]) -> None:
    """A resolved sequence length within the limit of an explicit ``input.seq_len``."""
    if not 1 <= seq <= MAX_SEQ_LEN:
        raise SpecError(*seq_from, f"an input of 1 to {MAX_SEQ_LEN} tokens (the limit on input.seq_len; "
                        "give input.seq_len to train shorter sequences)")


def count_parameters(model: Any) -> int:
    """Unique parameters (tied weights once), as ``sum(p.numel())`` over ``model.parameters()``."""
    return sum(p.numel() for p in model.parameters())
