"""The cards a cluster has: ``BATCHFIT_K8S_CARDS`` and the GPU nodes the extender has seen.

The webhook starts a new pod's estimate on all of them at CREATE, before kube-scheduler asks: by the time the
filter runs, the answers are usually there. Nodes are remembered by their GFD labels only (one entry per
distinct card, not per node), so a pod's card on each is worked out as the filter would (with the MIG slice
it requests).

>>> seen = ClusterCards()
>>> seen.saw({"nvidia.com/gpu.product": "Tesla-T4", "kubernetes.io/hostname": "gpu-t4-1"})
>>> [card.label for card in seen.cards(["NVIDIA-A100-SXM4-80GB"], None)]
['NVIDIA-A100-SXM4-80GB', 'Tesla-T4']
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from app.k8s.cards import PRODUCT, Card, is_gpu_node, node_card
from estimator.gpus import MIG_RESOURCE_PREFIX

MAX_SEEN = 256  # distinct GPU label sets (a cluster has a handful of card types)
GFD_PREFIXES = ("nvidia.com/gpu.", f"{MIG_RESOURCE_PREFIX}")  # the labels node_card reads


class ClusterCards:
    """The GFD labels of the GPU nodes seen, newest last."""

    def __init__(self) -> None:
        self._seen: OrderedDict[frozenset[tuple[str, str]], None] = OrderedDict()

    def saw(self, labels: dict[str, str]) -> None:
        """Remember a node's card (its GFD labels; a node without them is no GPU node)."""
        if not is_gpu_node(labels):
            return
        key = frozenset((k, v) for k, v in labels.items() if k.startswith(GFD_PREFIXES))
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > MAX_SEEN:
            self._seen.popitem(last=False)

    def cards(self, configured: Iterable[str], mig_profile: str | None) -> list[Card]:
        """The cards a pod may get here: each configured name (a catalog name or a GFD product label), then
        each seen node's, as the filter reads them (the slice ``mig_profile`` of each, under the mixed MIG
        strategy); one per distinct card, those nobody can size left out."""
        found: dict[str, Card] = {}
        label_sets = [{PRODUCT: name} for name in configured] + [dict(key) for key in reversed(self._seen)]
        for labels in label_sets:
            card = node_card(labels, mig_profile)
            if card is not None and card.key not in found:
                found[card.key] = card
        return list(found.values())
