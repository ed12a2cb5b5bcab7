"""kube-scheduler's extender verbs: ``filter`` drops the nodes whose GPU cannot hold the pod's step,
``prioritize`` ranks the rest by headroom.

Wire format: ``k8s.io/kube-scheduler/extender/v1`` (types.go). Its structs have no json tags, so the keys are
the Go field names (``Pod``, ``Nodes``, ``NodeNames``; ``FailedNodes``, ``FailedAndUnresolvableNodes``,
``Error``; ``Host``, ``Score``), while the embedded Pod and NodeList are ordinary camelCase Kubernetes
objects. The extender is configured with ``nodeCacheCapable: false``: every call carries the node objects,
and a filter answer returns the passing ones in ``Nodes`` (kube-scheduler reads ``Nodes.items`` then).

A node that cannot hold the step goes to ``FailedAndUnresolvableNodes``: preempting other pods does not add
GPU memory, so the scheduler's preemption need not try that node. A GPU node whose card's estimate is still
running at the deadline goes to ``FailedNodes`` (``BATCHFIT_K8S_WHEN_LATE=hold``, the default): resolvable,
so kube-scheduler keeps the pod and retries it, and the retry finds the answer; with ``pass`` it passes as if
it fit. Everything else passes: a pod that did not opt in, a node without GPU labels or with a card nobody can
size, and any error (scheduling is never blocked by a batchfit defect).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from app import logs
from app.k8s.answers import Answer, Estimates
from app.k8s.cards import Card, is_gpu_node, node_card
from app.k8s.holds import pod_key
from app.k8s.pods import TrainingPod, listing, mapping, opted_in, pod_name, training_pod
from estimator.errors import SpecError

MAX_SCORE = 10  # extender/v1 MaxExtenderPriority


@dataclass(frozen=True)
class Judgement:
    """A pod's nodes: the answer of each node that has one in time (by node name), the nodes whose card's
    estimate was still running at the deadline (their card, by node name), the labels of the cards that are
    settled (answered, or failed: those nodes pass), and whether the pod gave its batch. Nothing in any for a
    pod that is not judged (it did not opt in, its annotations are wrong, or the nodes came as names only)."""

    answers: dict[str, Answer] = field(default_factory=dict)
    pending: dict[str, Card] = field(default_factory=dict)
    settled: set[str] = field(default_factory=set)
    batch_given: bool = False


def pending_reason(card: Card) -> str:
    """The reason of a held node: ``batchfit: estimate pending for Tesla-T4; retry``."""
    return f"batchfit: estimate pending for {card.label}; retry"


def node_name(node: dict[str, Any]) -> str:
    return str(mapping(node.get("metadata")).get("name") or "")


def node_labels(node: dict[str, Any]) -> dict[str, str]:
    return {k: v for k, v in mapping(mapping(node.get("metadata")).get("labels")).items() if isinstance(v, str)}


def node_items(args: dict[str, Any]) -> list[dict[str, Any]]:
    """The node objects of ``ExtenderArgs`` (``Nodes.items``; [] when only names came)."""
    return [mapping(n) for n in listing(mapping(args.get("Nodes")).get("items"))]


def hosts_of(args: dict[str, Any], items: list[dict[str, Any]]) -> list[str]:
    """The candidates' names: the node objects', else ``NodeNames``."""
    return [node_name(n) for n in items] or [n for n in listing(args.get("NodeNames")) if isinstance(n, str)]


async def filter_nodes(args: dict[str, Any], estimates: Estimates, deadline: float) -> dict[str, Any]:
    """An ``ExtenderFilterResult`` for ``ExtenderArgs``."""
    items = node_items(args)
    judged = await _judge(args, items, estimates, deadline, "filter")
    failed = {name: answer.shortfall() for name, answer in judged.answers.items() if not answer.fits}
    held: dict[str, str] = {}
    pod = pod_key(mapping(args.get("Pod")))
    if judged.pending and estimates.app.state.settings.k8s_when_late == "hold":
        held = {name: pending_reason(card) for name, card in judged.pending.items()}
        estimates.holds.hold(pod, (card.label for card in judged.pending.values()))
    estimates.holds.answered(pod, judged.settled)
    return _filter_result(args, items, failed, held)


async def prioritize_nodes(args: dict[str, Any], estimates: Estimates, deadline: float) -> list[dict[str, Any]]:
    """A ``HostPriorityList`` for ``ExtenderArgs``: 0-10 per node, proportional to its headroom at the pod's
    batch (usable - reserved peak), or to its max batch when the pod gives none, the best node 10 and every
    node that fits at least 1; 0 for a node that does not fit or has no answer."""
    items = node_items(args)
    judged = await _judge(args, items, estimates, deadline, "prioritize")
    answers = judged.answers  # a pending node has none: 0, never ranked as if it fit
    values = {host: _merit(answers[host], judged.batch_given) if host in answers else 0
              for host in hosts_of(args, items)}
    best = max(values.values(), default=0)
    return [{"Host": host, "Score": max(1, math.floor(MAX_SCORE * value / best + 0.5)) if value > 0 else 0}
            for host, value in values.items()]


def passing_all(args: dict[str, Any]) -> dict[str, Any]:
    """The filter answer that passes every node (a defect's fallback: scheduling is never blocked)."""
    return _filter_result(args, node_items(args), {}, {})


def scoring_none(args: dict[str, Any]) -> list[dict[str, Any]]:
    """Score 0 for every node (a defect's fallback)."""
    return [{"Host": host, "Score": 0} for host in hosts_of(args, node_items(args))]


def _filter_result(args: dict[str, Any], items: list[dict[str, Any]], failed: dict[str, str],
                   held: dict[str, str]) -> dict[str, Any]:
    """The nodes neither ``failed`` (unresolvable) nor ``held`` (resolvable) pass: their objects unchanged in
    ``Nodes.items`` (what kube-scheduler reads with ``nodeCacheCapable: false``) and their names in
    ``NodeNames``."""
    nodes = args.get("Nodes")
    passing = [n for n in items if node_name(n) not in failed and node_name(n) not in held]
    return {"Nodes": None if nodes is None else {**mapping(nodes), "items": passing},
            "NodeNames": [node_name(n) for n in passing] if items else hosts_of(args, []), "FailedNodes": held,
            "FailedAndUnresolvableNodes": failed, "Error": ""}


def _merit(answer: Answer, batch_given: bool) -> int:
    if not answer.fits:
        return 0
    return answer.usable_bytes - answer.need_bytes if batch_given else int(answer.result["max_batch_size"] or 0)


async def _judge(args: dict[str, Any], items: list[dict[str, Any]], estimates: Estimates, deadline: float,
                 verb: str) -> Judgement:
    """The pod's nodes as far as batchfit can tell by ``deadline``."""
    metrics = estimates.app.state.metrics
    pod = mapping(args.get("Pod"))
    if not opted_in(pod):
        metrics.k8s_calls.labels(verb, "not-opted-in").inc()
        return Judgement()
    if not items:
        logs.log("k8s-no-node-objects", verb=verb, pod=pod_name(pod),
                 why="the extender must be configured with nodeCacheCapable: false")
        metrics.k8s_calls.labels(verb, "error").inc()
        return Judgement()
    try:
        training: TrainingPod = training_pod(pod)
    except SpecError as exc:
        logs.log("k8s-bad-pod", verb=verb, pod=pod_name(pod), error=str(exc))
        metrics.k8s_calls.labels(verb, "error").inc()
        return Judgement()
    if not await estimates.profile_known(training, verb):
        return Judgement()
    cards: dict[str, Card] = {}
    for node in items:
        labels = node_labels(node)
        if not is_gpu_node(labels):
            continue
        estimates.cluster.saw(labels)
        card = node_card(labels, training.mig_profile)
        if card is not None:
            cards[node_name(node)] = card
            if card.assumption is not None:
                logs.log("k8s-custom-card", verb=verb, pod=training.name, node=node_name(node),
                         assumption=card.assumption)
    found, late = await estimates.answers(training.request, cards.values(), deadline, verb)
    judged: dict[str, Answer] = {}
    pending: dict[str, Card] = {}
    for name, card in cards.items():
        answer = found.get(card.key)
        if isinstance(answer, Answer):
            judged[name] = dataclasses.replace(answer, card=card)  # named as this node's labels name it
        elif answer is not None:
            logs.log("k8s-no-answer", verb=verb, pod=training.name, node=name, error=answer.message)
        else:  # its job is still running
            pending[name] = card
    outcome = "late" if late else "answered" if len(judged) == len(cards) else "error"
    metrics.k8s_calls.labels(verb, outcome).inc()
    settled = {card.label for name, card in cards.items() if name not in pending}
    return Judgement(judged, pending, settled, training.batch is not None)
