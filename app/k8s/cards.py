"""Which card a node or a pod's pin names, from NVIDIA GPU Feature Discovery's labels.

GFD labels each GPU node with ``nvidia.com/gpu.product`` (the NVML name, spaces -> dashes; with the single
MIG strategy, ``-MIG-<profile>`` appended) and ``nvidia.com/gpu.memory`` (MiB). With the mixed MIG strategy the
product stays the parent card's and a pod asks for a slice by resource (``nvidia.com/mig-1g.10gb``), whose
memory GFD gives in ``nvidia.com/mig-1g.10gb.memory``.

>>> card = node_card({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"})
>>> card.gpu.name, card.label
('A100-80GB', 'NVIDIA-A100-SXM4-80GB')
>>> node_card({"nvidia.com/gpu.product": "NVIDIA-B300", "nvidia.com/gpu.memory": "275040"}).entry["memory_bytes"]
288400343040
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from estimator.gpus import (
    CUSTOM_NAME_PATTERN,
    DEFAULT_CONTEXT_BYTES,
    GPU,
    MIB,
    MIG_RESOURCE_PREFIX,
    custom_gpu,
    custom_name_problem,
    find_gpu,
    mig_gpu,
)

PRODUCT = "nvidia.com/gpu.product"
MEMORY = "nvidia.com/gpu.memory"
COMPUTE_MAJOR, COMPUTE_MINOR = "nvidia.com/gpu.compute.major", "nvidia.com/gpu.compute.minor"
GPU_RESOURCE = "nvidia.com/gpu"
DEFAULT_COMPUTE_CAPABILITY = "8.0"  # custom cards' default (docs/API.md, gpus[])
MIN_CUSTOM_BYTES, MAX_CUSTOM_BYTES = 2**20, 2**44  # a custom card's memory_bytes (estimator/request/spec.py)


@dataclass(frozen=True)
class Card:
    """A card as a cluster names it: ``label`` (its product label, or product + MIG profile), ``gpu`` (the
    catalog card, or a custom one built from GFD's memory label), ``entry`` (the request's ``gpus`` entry for
    it: a catalog name or a custom card's object) and ``assumption`` (how a custom card was made, else None)."""

    label: str
    gpu: GPU
    entry: str | dict[str, Any]
    assumption: str | None = None
    note: str | None = None  # the assumption in a few words, for one-line reasons

    @property
    def key(self) -> str:
        """One string per distinct card: nodes of the same card share one estimate."""
        return self.entry if isinstance(self.entry, str) else f"custom:{sorted(self.entry.items())}"


def is_gpu_node(labels: dict[str, str]) -> bool:
    """Whether GFD labelled the node as having an NVIDIA GPU (a node without these labels passes untouched)."""
    return PRODUCT in labels or MEMORY in labels


def mig_profile_of(resource: str) -> str | None:
    """``1g.10gb`` for ``nvidia.com/mig-1g.10gb``, None for any other resource."""
    if resource.startswith(MIG_RESOURCE_PREFIX) and len(resource) > len(MIG_RESOURCE_PREFIX):
        return resource[len(MIG_RESOURCE_PREFIX):]
    return None


def node_card(labels: dict[str, str], mig_profile: str | None = None) -> Card | None:
    """The card a pod would get on a node with these labels (``mig_profile``: the slice the pod requests under
    the mixed strategy); None when the labels do not say (no product the catalog knows, no memory label)."""
    product = labels.get(PRODUCT) or ""
    if mig_profile is not None:
        label = f"{product}-MIG-{mig_profile}" if product else f"MIG-{mig_profile}"
        parent = find_gpu(product) if product else None
        slice_ = mig_gpu(parent, mig_profile) if parent is not None and parent.mig_profile is None else None
        if slice_ is not None:
            return Card(label, slice_, slice_.name)
        return _custom(label, labels.get(f"{MIG_RESOURCE_PREFIX}{mig_profile}.memory"),
                       f"{MIG_RESOURCE_PREFIX}{mig_profile}.memory", labels)
    if product:
        known = find_gpu(product)
        if known is not None:
            return Card(product, known, known.name)
    return _custom(product or "unnamed GPU", labels.get(MEMORY), MEMORY, labels)


def named_card(name: str) -> Card | None:
    """A card a pod pins by name (the ``batchfit.io/gpu`` annotation or a node selector): any spelling the
    catalog takes (``find_gpu``); None when it does not know it."""
    gpu = find_gpu(name)
    return Card(name, gpu, gpu.name) if gpu is not None else None


def _custom(label: str, memory_mib: str | None, memory_label: str, labels: dict[str, str]) -> Card | None:
    """A card the catalog does not know, from a memory label in MiB; None without a usable one."""
    if memory_mib is None or not re.fullmatch(r"0*[1-9][0-9]{0,7}", memory_mib.strip()):
        return None  # 1 MiB .. 99,999,999 MiB (a custom card's memory_bytes is at most 2^44 B = 16,777,216 MiB)
    if not MIN_CUSTOM_BYTES <= int(memory_mib) * MIB <= MAX_CUSTOM_BYTES:
        return None
    name = label if re.fullmatch(CUSTOM_NAME_PATTERN, label) and custom_name_problem(label) is None \
        else f"GPU-{int(memory_mib.strip())}MiB"
    major, minor = labels.get(COMPUTE_MAJOR, ""), labels.get(COMPUTE_MINOR, "")
    given = bool(re.fullmatch(r"[0-9]{1,2}", major) and re.fullmatch(r"[0-9]", minor))
    capability = f"{int(major)}.{minor}" if given else DEFAULT_COMPUTE_CAPABILITY
    memory = int(memory_mib.strip()) * MIB
    gpu = custom_gpu(name, memory, capability, DEFAULT_CONTEXT_BYTES)
    where = f"{COMPUTE_MAJOR}/minor" if given else "not labelled: the default"
    assumption = (f"{label} is not in the catalog: a custom card of {int(memory_mib.strip())} MiB ({memory_label}), "
                  f"compute capability {capability} ({where}), CUDA context {DEFAULT_CONTEXT_BYTES // MIB} MiB "
                  "(the default for unknown cards)")
    entry = {"name": name, "memory_bytes": memory, "compute_capability": capability,
             "context_bytes": DEFAULT_CONTEXT_BYTES}
    mib = int(memory_mib.strip())
    note = (f"not in batchfit's catalog: {mib} MiB from {memory_label}, "
            f"a {DEFAULT_CONTEXT_BYTES // MIB} MiB CUDA context assumed")
    return Card(label, gpu, entry, assumption, note)
