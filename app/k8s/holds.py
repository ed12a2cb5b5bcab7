"""Pods held by the filter: a GPU node whose card has no answer by the deadline fails as pending
(``BATCHFIT_K8S_WHEN_LATE=hold``), and the pod waits for kube-scheduler's retry. This ledger says how many
pods wait on each card now and, when the filter answers a held pod for that card, how long it waited.

>>> from app.metrics import Metrics
>>> holds = Holds(Metrics())
>>> holds.hold("ml/train-0", ["Tesla-T4"], now=10.0)
>>> holds.answered("ml/train-0", ["Tesla-T4"], now=52.5)
[42.5]

A pod that never comes back (deleted, or placed on another card's node) is forgotten after ``HOLD_TTL_S``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from app.k8s.pods import mapping, pod_name

HOLD_TTL_S = 3600.0  # kube-scheduler retries an unschedulable pod at least every 5 minutes
MAX_HOLDS = 10_000  # (pod, card) pairs remembered


def pod_key(pod: dict[str, Any]) -> str:
    """The pod's uid, else namespace/name (the scheduler's Pod always has a uid; a hand-made one may not)."""
    uid = mapping(pod.get("metadata")).get("uid")
    return uid if isinstance(uid, str) and uid else pod_name(pod)


class Holds:
    """(pod, card) -> when the pod was first held on that card; the metrics ``batchfit_k8s_holds_total``,
    ``batchfit_k8s_held_pods`` and ``batchfit_k8s_hold_wait_seconds`` (all by card)."""

    def __init__(self, metrics: Any) -> None:
        self._metrics = metrics
        self._since: OrderedDict[tuple[str, str], float] = OrderedDict()

    def hold(self, pod: str, cards: Iterable[str], now: float | None = None) -> None:
        """The filter failed ``pod`` on nodes of ``cards`` as pending (each hold counted; the first one timed)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        for card in set(cards):
            self._metrics.k8s_holds.labels(card).inc()
            if (pod, card) not in self._since:
                self._since[(pod, card)] = now
                self._metrics.k8s_held.labels(card).inc()
        while len(self._since) > MAX_HOLDS:
            (_, card), _ = self._since.popitem(last=False)
            self._metrics.k8s_held.labels(card).dec()

    def answered(self, pod: str, cards: Iterable[str], now: float | None = None) -> list[float]:
        """The filter judged ``pod`` on ``cards``: each card it was held on is released, its wait observed
        (the waits returned, in seconds)."""
        now = time.monotonic() if now is None else now
        waits = []
        for card in set(cards):
            since = self._since.pop((pod, card), None)
            if since is not None:
                self._metrics.k8s_held.labels(card).dec()
                self._metrics.k8s_hold_wait.labels(card).observe(now - since)
                waits.append(now - since)
        return waits

    def _expire(self, now: float) -> None:
        while self._since:
            (pod, card), since = next(iter(self._since.items()))
            if now - since < HOLD_TTL_S:
                break
            del self._since[(pod, card)]
            self._metrics.k8s_held.labels(card).dec()
