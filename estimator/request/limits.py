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
# A base learning rate above 10 is no recipe's; the bound keeps the scaled LR (base_lr x global batch /
# base_batch, the ratio at most 2^36) finite, where base_lr 1e308 made it inf (answered as null).
MAX_BASE_LR = 10.0
MAX_JSON_DEPTH = 32  # nesting of a request's free-form JSON (model kwargs, an inline config)

__all__ = ["MAX_BASE_LR", "MAX_BATCH", "MAX_CARDS", "MAX_CHANNELS", "MAX_FRAMES", "MAX_JSON_DEPTH", "MAX_OBJECTS",
           "MAX_SEQ_LEN", "MAX_SIDE", "MIN_SIDE"]
