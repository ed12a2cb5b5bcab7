"""The request's ``input`` section and what every source's ``model`` section shares (the sections themselves
live with their sources, ``estimator/models/sources/``). Torch-free: the service's API process reads them.

>>> InputSpec(seq_len=512).seq_len
512
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from estimator.options import MAX_CHANNELS, MAX_FRAMES, MAX_OBJECTS, MAX_SEQ_LEN, MAX_SIDE, MIN_SIDE

# NaN and infinities are refused in every typed field (a finite number is expected everywhere)
STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# JSON-only kwargs: no callables, no objects, so nothing in a request is code.
JSONValue = None | bool | int | float | str | list[Any] | dict[str, Any]


class InputSpec(BaseModel):
    model_config = STRICT
    image_size: list[int] | None = Field(None, description="[C, H, W] for vision models", examples=[[3, 224, 224]])
    num_frames: int | None = Field(None, ge=1, le=MAX_FRAMES, description="frames per clip for video models")
    seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN, description="tokens per sample for text models")
    target_seq_len: int | None = Field(None, ge=1, le=MAX_SEQ_LEN, description="decoder tokens for seq2seq")
    num_objects: int | None = Field(None, ge=1, le=MAX_OBJECTS, description="annotated objects per image for detection")

    @field_validator("image_size")
    @classmethod
    def _sane_image(cls, v: list[int] | None) -> list[int] | None:
        if v is None:
            return v
        if len(v) != 3:
            raise ValueError("a list of 3 integers [C, H, W]")
        c, h, w = v
        if not 1 <= c <= MAX_CHANNELS:
            raise ValueError(f"[C, H, W] with 1 <= C <= {MAX_CHANNELS}")
        if not (MIN_SIDE <= h <= MAX_SIDE and MIN_SIDE <= w <= MAX_SIDE):
            raise ValueError(f"[C, H, W] with H and W from {MIN_SIDE} to {MAX_SIDE}")
        return v
