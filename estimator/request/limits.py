"""What a request may ask for: the bounds the schema enforces, each defined once."""

from __future__ import annotations

from estimator.plan.search import MAX_BATCH

MAX_SEQ_LEN = 2**20
# Sane inputs: up to 64 channels and 8192 px a side (whole-slide tiles, 8K
# frames); a 16x16 px minimum lets every torchvision/timm stem run.
MAX_CHANNELS = 64
MIN_SIDE, MAX_SIDE = 16, 8192
MAX_FRAMES = 512
MAX_OBJECTS = 1024  # annotated objects per image (detection)
MAX_CARDS = 64  # cards in one request
MAX_JSON_DEPTH = 32  # nesting of a request's free-form JSON (model kwargs, an inline config)

__all__ = ["MAX_BATCH", "MAX_CARDS", "MAX_CHANNELS", "MAX_FRAMES", "MAX_JSON_DEPTH", "MAX_OBJECTS", "MAX_SEQ_LEN",
           "MAX_SIDE", "MIN_SIDE"]
