"""Structured JSON logs, one line per event, with the request id."""

from __future__ import annotations

import json
import logging
import time

logger = logging.getLogger("batchfit")


class JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {"ts": round(time.time(), 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        doc.update(getattr(record, "fields", {}))
        return json.dumps(doc)


def setup() -> None:
    if any(isinstance(h.formatter, JSONFormatter) for h in logger.handlers):
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def log(msg: str, **fields) -> None:
    logger.info(msg, extra={"fields": fields})


def warn(msg: str, **fields) -> None:
    """An event someone should look at (the service went on without what it was asked for)."""
    logger.warning(msg, extra={"fields": fields})
