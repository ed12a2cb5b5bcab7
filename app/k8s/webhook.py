"""The mutating admission webhook: a pod that opted in gets its batch size from batchfit before it is
scheduled.

Wire format: ``AdmissionReview`` of ``admission.k8s.io/v1``. The answer echoes ``request.uid`` and is always
``allowed`` unless the pod cannot train even at batch 1 on the card it is pinned to and the service runs with
``BATCHFIT_WEBHOOK_DENY_UNFIT=1``. A pod is changed only when its card is known (pinned by the
``batchfit.io/gpu`` annotation, the ``nvidia.com/gpu.product`` node selector, or required node affinity on that
label; with several candidate cards, the answer is the one that fits them all) and batchfit answered in time.
The change is a JSONPatch (RFC 6902, base64 in ``patch``) that sets in the env of every container requesting
``nvidia.com/gpu`` or a MIG resource:

- ``BATCHFIT_BATCH_SIZE``: the pod's ``batchfit.io/batch-size``, else the accumulation plan's micro-batch
  (``planner.target_global_batch``), else the recommended batch;
- ``BATCHFIT_GRAD_ACCUM``: accumulation steps, only with ``planner.target_global_batch``;
- ``BATCHFIT_MAX_BATCH_SIZE``: the largest batch that fits;

and the annotation ``batchfit.io/estimate``, a one-line summary. Everything else (the card unknown, the
estimate late or failing, a bad annotation) allows the pod unchanged with a ``warnings`` entry, which kubectl
shows to whoever created the pod.

Every pod that opted in also has its estimate started, without waiting, on the cluster's cards
(``BATCHFIT_K8S_CARDS`` and those the extender has seen), so that the scheduler's filter finds the answers.
A ``resource.k8s.io`` ResourceClaim or ResourceClaimTemplate is answered by app/k8s/claims.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from app import logs
from app.k8s.answers import MISSING_PROFILE, Answer, Estimates
from app.k8s.cards import Card, named_card
from app.k8s.claims import CLAIM_GROUP, CLAIM_KINDS, size_claim
from app.k8s.pods import TrainingPod, listing, mapping, opted_in, pinned_products, training_pod
from app.k8s.review import answer_review, estimate_op, patched, review_request, unchanged
from estimator import __version__
from estimator.errors import SpecError
from estimator.gpus import MIG_RESOURCE_PREFIX, mig_cards, mig_gpu

ENV_BATCH, ENV_ACCUM, ENV_MAX = "BATCHFIT_BATCH_SIZE", "BATCHFIT_GRAD_ACCUM", "BATCHFIT_MAX_BATCH_SIZE"


async def mutate(review: dict[str, Any], estimates: Estimates, deadline: float, deny_unfit: bool) -> dict[str, Any]:
    """The ``AdmissionReview`` answering ``review`` (checked by ``review_request``): a Pod's, or a device
    claim's (``resource.k8s.io`` ResourceClaim or ResourceClaimTemplate: app/k8s/claims.py)."""
    request = review_request(review)
    kind = mapping(request.get("kind"))
    if kind.get("group") == CLAIM_GROUP and kind.get("kind") in CLAIM_KINDS and request.get("operation") == "CREATE":
        response = await size_claim(request, estimates, deadline)
    else:
        response = await _respond(request, estimates, deadline, deny_unfit)
    return answer_review(request["uid"], response)


async def _respond(request: dict[str, Any], estimates: Estimates, deadline: float,
                   deny_unfit: bool) -> dict[str, Any]:
    calls = estimates.app.state.metrics.k8s_calls
    pod = mapping(request.get("object"))
    kind = mapping(request.get("kind")).get("kind")
    if kind != "Pod" or request.get("operation") != "CREATE" or not opted_in(pod):
        calls.labels("mutate", "not-opted-in").inc()
        return {"allowed": True}
    try:
        training = training_pod(pod)
    except SpecError as exc:
        calls.labels("mutate", "error").inc()
        return unchanged(f"not changed: {exc}")
    if not await estimates.profile_known(training, "mutate"):
        return unchanged(MISSING_PROFILE)
    if not training.gpu_containers:
        calls.labels("mutate", "error").inc()
        return unchanged("not changed: no container requests nvidia.com/gpu or a MIG resource")
    cards, unknown = _pinned_cards(pod, training)
    await _start_early(estimates, training, [] if unknown else cards)
    if unknown or not cards:
        calls.labels("mutate", "error").inc()
        what = "; ".join(unknown) if unknown else (
            "the pod is not pinned to a GPU type (nodeSelector or required node affinity on "
            "nvidia.com/gpu.product, or the batchfit.io/gpu annotation)")
        return unchanged(f"not changed: {what}")
    found, late = await estimates.answers(training.request, cards, deadline, "mutate")
    answers = [dataclasses.replace(a, card=card) if isinstance(a, Answer) else a  # named as the pod names it
               for a, card in ((found.get(card.key), card) for card in cards)]
    if late and not all(isinstance(a, Answer) for a in answers):
        calls.labels("mutate", "late").inc()
        return unchanged("not changed: the estimate is still running; it is kept for the next pod with this spec")
    failures = [a for a in answers if not isinstance(a, Answer)]
    if failures:
        calls.labels("mutate", "error").inc()
        return unchanged(f"not changed: {failures[0].message if failures[0] is not None else 'no answer'}")
    calls.labels("mutate", "answered").inc()
    return _decide([a for a in answers if isinstance(a, Answer)], training, pod, deny_unfit)


async def _start_early(estimates: Estimates, training: TrainingPod, pinned: list[Card]) -> None:
    """Start the pod's estimate on every card of the cluster (``BATCHFIT_K8S_CARDS`` and the cards the
    extender has seen), not waiting for it, so the scheduler's filter finds the answers; the pinned cards'
    job first, as it is the one this call waits for."""
    if pinned:
        await estimates.start(training.request, pinned)
    configured = estimates.app.state.settings.card_names()
    started = await estimates.start(training.request, estimates.cluster.cards(configured, training.mig_profile))
    if started:
        logs.log("k8s-early-start", pod=training.name, cards=[card.label for card in started])


def _pinned_cards(pod: dict[str, Any], training: TrainingPod) -> tuple[list[Card], list[str]]:
    """The cards the pod may get (the slice it requests on each pinned card, under the mixed MIG strategy),
    and why the pinned names that batchfit cannot size are not cards."""
    names = pinned_products(pod)
    if not names and training.mig_profile is not None:  # a slice only one catalog card has pins itself
        names = [f"{MIG_RESOURCE_PREFIX}{training.mig_profile}"]
    cards, unknown = [], []
    for name in names:
        card = named_card(name)
        if card is None:
            rows = mig_cards(name[len(MIG_RESOURCE_PREFIX):]) if name.startswith(MIG_RESOURCE_PREFIX) else []
            unknown.append(f"{name} is on several cards ({', '.join(g.name for g in rows)}): pin the product"
                           if rows else f"{name} is not a card batchfit knows")
        elif training.mig_profile is not None and card.gpu.mig_profile is None:
            sliced = mig_gpu(card.gpu, training.mig_profile)
            if sliced is None:
                unknown.append(f"{name} has no MIG profile {training.mig_profile} in batchfit's catalog")
            else:
                cards.append(Card(f"{name}-MIG-{training.mig_profile}", sliced, sliced.name))
        else:
            cards.append(card)
    return cards, unknown


def _unfit_message(answer: Answer) -> str:
    smallest = answer.result["min_batch_size"]
    if answer.memory["batch_size"] == smallest:
        return f"batchfit: the job does not fit {answer.card.label} even at batch {smallest}: it {answer.shortfall()}"
    return (f"batchfit: the job does not fit {answer.card.label} even at batch {smallest} (at the pod's batch it "
            f"{answer.shortfall()})")


def _ranks(answer: Answer, training: TrainingPod) -> int:
    """The ranks a global batch is spread over: the accumulation plan's, else the world size, else
    ``planner.data_parallel_ranks`` (one GPU per rank)."""
    plan = mapping(answer.result.get("accumulation"))
    if plan.get("ranks"):
        return int(plan["ranks"])
    world = int(answer.result.get("world_size") or 1)
    return world if world > 1 else training.request.planner.data_parallel_ranks


def _decide(answers: list[Answer], training: TrainingPod, pod: dict[str, Any], deny_unfit: bool) -> dict[str, Any]:
    """The response for a pod whose every candidate card was answered: the batch for the cards the job fits
    (warning about the others); denied (with ``deny_unfit``) or left with the annotation only when it fits none."""
    warnings: list[str] = []
    unfit = [a for a in answers if a.result["max_batch_size"] is None]
    fitting = [a for a in answers if a.result["max_batch_size"] is not None]
    if not fitting:
        message = _unfit_message(unfit[0])
        if deny_unfit:
            return {"allowed": False, "status": {"code": 403, "reason": "Forbidden", "message": message}}
        return _patched(pod, [], f"{unfit[0].card.label}: does not fit ({unfit[0].shortfall()}); "
                                 f"batchfit {__version__}", [message])
    warnings += [_unfit_message(a) + "; the batch below is for the other cards" for a in unfit]
    answers = fitting
    limiting = min(answers, key=lambda a: int(a.result["max_batch_size"]))
    max_batch = int(limiting.result["max_batch_size"])
    target = training.request.planner.target_global_batch
    steps: int | None = None
    if training.batch is not None:
        batch = training.batch
        over = [a for a in answers if not a.fits]
        if over:
            warnings.append(f"batchfit: batch {batch} {over[0].shortfall()}; the largest batch that fits is "
                            f"{max_batch}")
    else:
        recommended = [a.result["recommended_batch_size"] for a in answers]
        if any(r is None for r in recommended):
            none = answers[recommended.index(None)]
            warnings.append(f"batchfit: {none.card.label}: no batch fits within the headroom; using the max")
            batch = max_batch
        else:
            batch = min(int(r) for r in recommended)
        plans = [mapping(a.result.get("accumulation")) for a in answers]
        if target is not None and all(plans):  # the plan with the smallest micro-batch fits every card
            plan = min(plans, key=lambda p: int(p["micro_batch"]))
            batch, steps = int(plan["micro_batch"]), int(plan["steps"])
    if target is not None and steps is None:  # a given batch, or a card without a plan: the steps for it
        steps = max(1, math.ceil(target / (batch * _ranks(limiting, training))))
    env = {ENV_BATCH: str(batch), ENV_MAX: str(max_batch)}
    if steps is not None:
        env[ENV_ACCUM] = str(steps)
    cards = " / ".join(a.card.label for a in answers)
    accum = f" x {steps} accumulation steps" if steps is not None else ""
    on = f" on {limiting.card.label}" if len(answers) > 1 else ""
    if training.batch is not None:
        at = max(answers, key=lambda a: a.need_bytes / max(a.usable_bytes, 1))
        detail = (f"{gib_bytes(at.need_bytes)} of {gib_usable(at)} usable"
                  f"{f' on {at.card.label}' if len(answers) > 1 else ''}; max {max_batch}{on}")
    else:
        lowest = min((int(a.result["recommended_batch_size"]) for a in answers
                      if a.result["recommended_batch_size"] is not None), default=None)
        detail = f"recommended {lowest if lowest is not None else 'none'}, max {max_batch}{on}"
    summary = f"{cards}: batch {batch}{accum} ({detail}); batchfit {__version__}"
    return _patched(pod, [(i, env) for i in training.gpu_containers], summary, warnings)


def gib_bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def gib_usable(answer: Answer) -> str:
    return gib_bytes(answer.usable_bytes)


def _patched(pod: dict[str, Any], envs: list[tuple[int, dict[str, str]]], summary: str,
             warnings: list[str]) -> dict[str, Any]:
    return patched(patch_ops(pod, envs, summary), warnings)


def patch_ops(pod: dict[str, Any], envs: list[tuple[int, dict[str, str]]], summary: str) -> list[dict[str, Any]]:
    """RFC 6902 operations: each variable set in its container's env (added, or an existing entry of the
    same name replaced), and the summary annotation."""
    ops: list[dict[str, Any]] = []
    containers = listing(mapping(pod.get("spec")).get("containers"))
    for i, env in envs:
        path = f"/spec/containers/{i}/env"
        current = listing(mapping(containers[i]).get("env"))
        if not current:
            ops.append({"op": "add", "path": path, "value": [{"name": k, "value": v} for k, v in env.items()]})
            continue
        index = {mapping(e).get("name"): j for j, e in enumerate(current)}
        for name, value in env.items():
            entry = {"name": name, "value": value}
            if name in index:
                ops.append({"op": "replace", "path": f"{path}/{index[name]}", "value": entry})
            else:
                ops.append({"op": "add", "path": f"{path}/-", "value": entry})
    ops.append(estimate_op(pod, summary))
    return ops
