"""Estimates for Kubernetes callers: one answer per (request, card), back within the caller's deadline or
computed in the background for its retry.

kube-scheduler waits ``httpTimeout`` for an extender (5 s by default) and the API server ``timeoutSeconds``
for a webhook; a first estimate takes longer. So an answer is looked up per card (in memory, then in the
service's cache); the cards without one are estimated together in one worker job, which the caller waits for
until its deadline. A job that is not done by then goes on in the background (``batchfit_k8s_late_total``),
and its answers are stored per card, so the scheduler's next attempt, or the next pod with the same spec,
finds them. Identical cards of concurrent callers share one job. The webhook starts a pod's jobs at its
CREATE (``start``, not waiting), so the scheduler's first call usually finds the answers.

Errors are answers too: a request the estimator refuses (an unknown model, a simulation that fails, a job past
the worker's time or memory limit) is remembered for ``FAILURE_TTL_S``, so the next call does not start the
same failing job again; a busy pool or a worker that died is not remembered (the next call tries again).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from app import logs
from app.cache import cache_key
from app.k8s.cards import Card
from app.k8s.cluster import ClusterCards
from app.k8s.holds import Holds
from app.k8s.pods import PROFILE, TrainingPod, mapping
from app.routes import Refused, run_in_pool
from app.worker import ProfileJob, ReplyKind
from estimator import EstimateRequest, ProfileEstimateRequest, parse_profile_request, parse_request
from estimator.errors import BatchfitError, LimitExceeded, NotStored, SpecError, StoreUnavailable
from estimator.gpus import shortfall
from estimator.options import DEFAULT_RESERVE_BYTES

MISSING_PROFILE = ("not changed: the service has no profile of the batchfit.io/profile annotation (never stored, "
                   "evicted, or the store down): push it with `batchfit profile push FILE --url URL`")
MEMORY_ENTRIES = 4096  # answers kept in this process besides the service's cache (which may be off)
FAILURE_TTL_S = 300.0


@dataclass(frozen=True)
class Answer:
    """A card's ``results[]`` entry (docs/API.md) and what the allocator may hold on it (``usable_bytes``:
    capacity - CUDA context - ``planner.reserve_bytes``, what ``memory.fits`` is judged against)."""

    card: Card
    result: dict[str, Any]
    usable_bytes: int

    @property
    def memory(self) -> dict[str, Any]:
        memory: dict[str, Any] = self.result["memory"]
        return memory

    @property
    def fits(self) -> bool:
        """The step fits at the request's batch (given), else at the smallest batch."""
        return bool(self.memory["fits"])

    @property
    def need_bytes(self) -> int:
        """The reserved peak at ``memory.batch_size`` (the step's need when it does not fit)."""
        return int(self.memory["reserved_peak_bytes"])

    def shortfall(self) -> str:
        """One line: ``needs 21.7 GiB at batch 64; Tesla-T4 has 14.5 GiB usable``."""
        note = f" ({self.card.note})" if self.card.note else ""
        return shortfall(self.need_bytes, self.usable_bytes, self.memory["batch_size"], self.card.label) + note


@dataclass(frozen=True)
class Failure:
    """Why a card has no answer: the estimator's message (``transient``: a busy or failed pool, not remembered)."""

    message: str
    transient: bool = False


Found = dict[str, Answer | Failure]  # by card key


@dataclass(frozen=True)
class Begun:
    """What a call finds: the answers known now (by card key), the jobs to wait for the others, each card's
    cache key (by card key), and the cards whose job it started."""

    found: Found
    waits: set[asyncio.Task[Found]]
    keys: dict[str, str]
    started: list[Card]


class Estimates:
    """The answers of one app (``app.state.k8s``): ``answers``, ``start`` and ``close``; the cluster's cards
    (``cluster``) and the pods held on them (``holds``)."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.cluster = ClusterCards()  # the cards the extender has seen, for the webhook's early start
        self.holds = Holds(app.state.metrics)
        self._memory: OrderedDict[str, tuple[float, dict[str, Any]]] = OrderedDict()
        self._pending: dict[str, asyncio.Task[Found]] = {}
        self._tasks: set[asyncio.Task[Found]] = set()

    async def answers(self, request: EstimateRequest | ProfileEstimateRequest, cards: Iterable[Card], deadline: float,
                      verb: str) -> tuple[Found, bool]:
        """Per ``Card.key``, the answer (or failure) of each card that has one by ``deadline`` (the event loop's
        clock); and whether some card had none by then (its job goes on in the background)."""
        begun = await self._begin(request, cards)
        found, waits = begun.found, begun.waits
        if not waits:
            return found, False
        loop = asyncio.get_running_loop()
        done, _ = await asyncio.wait(waits, timeout=max(deadline - loop.time(), 0.0))
        by_key = {key: name for name, key in begun.keys.items()}
        for task in done:
            if task.cancelled():  # the app is stopping
                continue
            for key, answer in task.result().items():
                if key in by_key:
                    found[by_key[key]] = answer
        late = len(done) < len(waits)
        if late:
            self.app.state.metrics.k8s_late.labels(verb).inc()
        return found, late

    async def start(self, request: EstimateRequest | ProfileEstimateRequest, cards: Iterable[Card]) -> list[Card]:
        """Start the estimate of the cards that have no answer and none running, without waiting for it
        (the webhook, for the scheduler's calls to come); the cards it started."""
        return (await self._begin(request, cards)).started

    async def _begin(self, request: EstimateRequest | ProfileEstimateRequest, cards: Iterable[Card]) -> Begun:
        """The answers known now, and a job started for the cards that have none and none running."""
        unique = {card.key: card for card in cards}
        keys = {name: card_key(request, card) for name, card in unique.items()}
        found: Found = {}
        missing: list[tuple[Card, str]] = []
        for name, card in unique.items():
            hit = await self._lookup(keys[name], card)
            if hit is not None:
                found[name] = hit
            else:
                missing.append((card, keys[name]))
        waits = {self._pending[key] for _, key in missing if key in self._pending}
        new = [(card, key) for card, key in missing if key not in self._pending]
        if new:
            waits.add(self._start(request, new))
        return Begun(found, waits, keys, [card for card, _ in new])

    async def close(self) -> None:
        """Cancel the background jobs (the app is stopping)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _start(self, request: EstimateRequest | ProfileEstimateRequest,
               cards: list[tuple[Card, str]]) -> asyncio.Task[Found]:
        task = asyncio.ensure_future(self._compute(request, cards))
        self.app.state.metrics.k8s_estimates.inc()
        self._tasks.add(task)
        for _, key in cards:
            self._pending[key] = task

        def done(finished: asyncio.Task[Found]) -> None:
            self._tasks.discard(finished)
            for _, key in cards:
                if self._pending.get(key) is finished:
                    del self._pending[key]

        task.add_done_callback(done)
        return task

    async def _compute(self, request: EstimateRequest | ProfileEstimateRequest, cards: list[tuple[Card, str]]) -> Found:
        """One worker job for ``cards``; every answer stored; never raises (a failure is an answer). A card the
        request refuses (a custom card out of range) fails alone, and the others are asked without it."""
        t0 = time.perf_counter()
        try:
            # by profile: only the fields the pod set (the profile's own planner fills in the rest)
            doc = request.model_dump(mode="json", by_alias=True,
                                     exclude_unset=isinstance(request, ProfileEstimateRequest))
            doc["gpus"] = [card.entry for card, _ in cards]
            job, reserve = await self._job(doc) if isinstance(request, ProfileEstimateRequest) else \
                _spec_job(doc)
        except (NotStored, StoreUnavailable) as exc:  # evicted since the call began, or the store is down
            return self._failed(cards, Failure(str(exc), transient=True))
        except SpecError as exc:
            bad = _card_index(exc.field, len(cards))
            if bad is None:
                return self._failed(cards, Failure(str(exc)))
            alone = self._failed([cards[bad]], Failure(str(exc)))
            rest = cards[:bad] + cards[bad + 1:]
            return {**alone, **(await self._compute(request, rest) if rest else {})}
        try:
            reply = await run_in_pool(self.app, job)
        except Refused as refused:  # a busy pool or a worker that died: the next call tries again
            transient = not isinstance(refused.error, LimitExceeded)  # past a limit: it would be again
            return self._failed(cards, Failure(str(refused.error), transient=transient))
        except BatchfitError as exc:
            return self._failed(cards, Failure(str(exc)))
        except Exception as exc:  # noqa: BLE001 - a defect: logged, and the caller passes every node
            logs.log("k8s-estimate-failed", error=repr(exc))
            return self._failed(cards, Failure(f"batchfit failed: {type(exc).__name__}: {exc}", transient=True))
        if reply.kind != ReplyKind.OK:  # the estimator's refusal, or its defect (INTERNAL): the same again
            message = str(reply.error()) if reply.kind == ReplyKind.ERROR else f"batchfit failed: {reply.payload}"
            return self._failed(cards, Failure(message))
        out: Found = {}
        for (card, key), result in zip(cards, reply.payload["results"], strict=True):
            value = {"result": result, "usable_bytes": card.gpu.usable_bytes(reserve)}
            await self._store(key, value)
            out[key] = _answer(card, value)
        logs.log("k8s-estimate", cards=[card.label for card, _ in cards], seconds=round(time.perf_counter() - t0, 3))
        return out

    async def _job(self, doc: dict[str, Any]) -> tuple[ProfileJob, int]:
        """The worker's job of a request by profile (the profile from the store) and its reserve: the request's
        planner's, else the profile's own."""
        request = parse_profile_request(doc)
        assert isinstance(request.profile, str)  # a pod names a profile by id
        profile = await self.app.state.profiles.get(request.profile, f"annotations[{PROFILE}]")
        options = request.options()
        reserve = options["planner"].get("reserve_bytes",
                                         mapping(mapping(profile.get("request")).get("planner")).get(
                                             "reserve_bytes", DEFAULT_RESERVE_BYTES))
        return ProfileJob(request.profile, profile, options), int(reserve)

    async def profile_known(self, training: TrainingPod, verb: str) -> bool:
        """False, with a logged warning and ``batchfit_k8s_profile_missing_total``, when the pod names a profile
        the service does not have (or cannot read now): the pod is then treated as not opted in."""
        request = training.request
        if not isinstance(request, ProfileEstimateRequest) or not isinstance(request.profile, str):
            return True
        try:
            await self.app.state.profiles.raw(request.profile, f"annotations[{PROFILE}]")
            return True
        except (NotStored, StoreUnavailable) as exc:
            logs.warn("k8s-profile-missing", verb=verb, pod=training.name, profile=request.profile,
                     error=str(exc))
            self.app.state.metrics.k8s_profile_missing.labels(verb).inc()
            self.app.state.metrics.k8s_calls.labels(verb, "not-opted-in").inc()
            return False

    def _failed(self, cards: list[tuple[Card, str]], failure: Failure) -> Found:
        logs.log("k8s-estimate-refused", cards=[card.label for card, _ in cards], error=failure.message)
        if not failure.transient:
            for _, key in cards:
                self._remember(key, {"failure": failure.message}, time.monotonic() + FAILURE_TTL_S)
        return {key: failure for _, key in cards}

    async def _lookup(self, key: str, card: Card) -> Answer | Failure | None:
        entry = self._memory.get(key)
        if entry is not None:
            expires, value = entry
            if expires < time.monotonic():
                del self._memory[key]
            else:
                self._memory.move_to_end(key)
                return _answer(card, value)
        cache = self.app.state.cache
        stored = await asyncio.to_thread(cache.get, key) if cache else None
        if stored is None or "result" not in stored:
            return None
        self._remember(key, stored)
        return _answer(card, stored)

    async def _store(self, key: str, value: dict[str, Any]) -> None:
        self._remember(key, value)
        if self.app.state.cache:
            await asyncio.to_thread(self.app.state.cache.set, key, value)

    def _remember(self, key: str, value: dict[str, Any], expires: float = float("inf")) -> None:
        self._memory[key] = (expires, value)
        self._memory.move_to_end(key)
        while len(self._memory) > MEMORY_ENTRIES:
            self._memory.popitem(last=False)


def _spec_job(doc: dict[str, Any]) -> tuple[EstimateRequest, int]:
    job = parse_request(doc, allow_local_code=False)
    return job, job.planner.reserve_bytes


def card_key(request: EstimateRequest | ProfileEstimateRequest, card: Card) -> str:
    """The cache key of ``request`` on ``card`` alone (not a POST /estimate key: its answer is one card's
    ``results[]`` entry of a job that may have held several)."""
    doc = request.model_dump(mode="json", by_alias=True)
    doc["gpus"] = [card.entry]
    return cache_key({"k8s-card": doc})


def _card_index(field: str, count: int) -> int | None:
    """``i`` when a request's error names ``gpus[i]`` (or a field inside it), else None."""
    match = re.match(r"gpus\[(\d+)\]", field)
    return int(match.group(1)) if match and int(match.group(1)) < count else None


def _answer(card: Card, value: dict[str, Any]) -> Answer | Failure:
    if "failure" in value:
        return Failure(str(value["failure"]))
    return Answer(card, value["result"], int(value["usable_bytes"]))
