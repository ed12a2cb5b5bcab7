"""The GPU catalog.

``memory_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` reports
(MiB x 1,048,576), not the marketing GiB. ``context_bytes`` is the CUDA
context plus the kernel images torch loads (what nvidia-smi shows for a
process right after ``torch.cuda.init()`` and the first kernel launch), from
published measurements; it depends on the driver and CUDA version, so it is
a default, overridable per request. ``cublas_workspace_bytes`` is torch's
default cuBLAS workspace (aten/src/ATen/cuda/CublasHandlePool.cpp,
``parseChosenWorkspaceSize``: ``4096*8*1024`` on sm90+, else
``4096*1024*2 + 16*1024*8``); cuBLASLt shares it (``TORCH_CUBLASLT_UNIFIED_WORKSPACE``
defaults on). It is allocated through the caching allocator, once per
(handle, stream): the forward thread and the autograd device thread each hold one.
``peak_tflops`` is dense (no sparsity) bf16/fp16 tensor-core throughput and
fp32 (non-TF32) throughput from the vendor's datasheet.

Clusters name cards differently. ``aliases`` are the values NVIDIA's GPU
Feature Discovery puts in the node label ``nvidia.com/gpu.product``: the NVML
name with spaces turned into dashes (``NVIDIA-A100-SXM4-80GB``, ``Tesla-T4``;
drivers before R470 wrote A100s without the ``NVIDIA-`` prefix), and for a
MIG row, with the single MIG strategy, the parent's product with
``-MIG-<profile>`` appended (``NVIDIA-A100-SXM4-40GB-MIG-1g.5gb``). A MIG row's
``mig_resource`` is the extended resource a pod requests for that slice under
the mixed strategy (``nvidia.com/mig-1g.5gb``). ``find_gpu`` takes any of these.

>>> find_gpu("NVIDIA-A100-SXM4-80GB").name, find_gpu("nvidia.com/mig-1g.5gb").name
('A100-80GB', 'A100-40GB-MIG-1g.5gb')
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, replace

from estimator.errors import SpecError, UnknownGPUError

MIB = 1024 * 1024
WORKSPACE_SM90 = 4096 * 8 * 1024  # CublasHandlePool.cpp, sm90+: 32 MiB
WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8  # CublasHandlePool.cpp, older: 8 MiB + 128 KiB


@dataclass(frozen=True)
class GPU:
    """One card: ``GPU("A100-80GB", 81920 * MIB, (8, 0), ...)``."""

    name: str
    memory_bytes: int
    capability: tuple[int, int]
    context_bytes: int
    peak_tflops_bf16: float
    peak_tflops_fp32: float
    description: str = ""
    aliases: tuple[str, ...] = ()  # GFD product labels (module docstring)
    # what the caching allocator may hold when a run holds it below the card's usable memory (a recommendation's
    # headroom, as torch.cuda.set_per_process_memory_fraction does): the card itself answers torch.cuda as before
    allocator_bytes: int | None = None

    @property
    def cublas_workspace_bytes(self) -> int:
        return WORKSPACE_SM90 if self.capability >= (9, 0) else WORKSPACE_DEFAULT

    def usable_bytes(self, reserve_bytes: int = 0) -> int:
        """What the caching allocator may hold: memory less the CUDA context and ``reserve_bytes`` (at most
        ``allocator_bytes``)."""
        usable = self.memory_bytes - self.context_bytes - reserve_bytes
        return max(usable if self.allocator_bytes is None else min(usable, self.allocator_bytes), 0)

    @property
    def compute_capability(self) -> str:
        return f"{self.capability[0]}.{self.capability[1]}"

    @property
    def mig_profile(self) -> str | None:
        """``1g.5gb`` for a MIG row (``A100-40GB-MIG-1g.5gb``), None for a whole card."""
        _, sep, profile = self.name.partition("-MIG-")
        return profile if sep else None

    @property
    def mig_parent(self) -> str | None:
        """The catalog name of the card a MIG row slices (``A100-40GB``), None for a whole card."""
        parent, sep, _ = self.name.partition("-MIG-")
        return parent if sep else None

    @property
    def mig_resource(self) -> str | None:
        """The extended resource of a MIG row under the mixed strategy (``nvidia.com/mig-1g.5gb``)."""
        profile = self.mig_profile
        return f"{MIG_RESOURCE_PREFIX}{profile}" if profile else None


# Context sizes: measured with torch 2.x / CUDA 12: about 300-500 MiB, larger
# on Hopper (more kernel images and a larger context; PyTorch forum and
# pytorch/pytorch#12873-style reports: ~ 480-530 MiB on H100, ~ 420 MiB on A100,
# ~ 300-330 MiB on V100/T4). Lazy module loading (CUDA_MODULE_LOADING=LAZY,
# default since CUDA 11.7) keeps them at these levels.
_CATALOG: tuple[GPU, ...] = (
    # V100: nvidia-smi 16160 MiB / 32510 MiB (SXM2); 125 TFLOPS fp16 tensor, 15.7 fp32 (V100 datasheet)
    GPU("V100-16GB", 16160 * MIB, (7, 0), 310 * MIB, 125.0, 15.7, "Tesla V100-SXM2-16GB"),
    GPU("V100-32GB", 32510 * MIB, (7, 0), 310 * MIB, 125.0, 15.7, "Tesla V100-SXM2-32GB"),
    # T4: 15360 MiB; 65 TFLOPS fp16, 8.1 fp32 (T4 datasheet)
    GPU("T4-16GB", 15360 * MIB, (7, 5), 300 * MIB, 65.0, 8.1, "Tesla T4"),
    # A10G: 23028 MiB (AWS g5); 70 TFLOPS bf16 dense (A10G spec: 140 with sparsity), 31.2 fp32
    GPU("A10G-24GB", 23028 * MIB, (8, 6), 400 * MIB, 70.0, 31.2, "NVIDIA A10G"),
    # L4: 23034 MiB; 121 TFLOPS bf16 dense (242 sparse), 30.3 fp32 (L4 datasheet)
    GPU("L4-24GB", 23034 * MIB, (8, 9), 400 * MIB, 121.0, 30.3, "NVIDIA L4"),
    # RTX 3090: 24576 MiB; 71 TFLOPS fp16 tensor (dense, fp32 accumulate), 35.6 fp32 (GA102 whitepaper)
    GPU("RTX3090-24GB", 24576 * MIB, (8, 6), 400 * MIB, 71.0, 35.6, "NVIDIA GeForce RTX 3090"),
    # RTX 4090: 24564 MiB; 165 TFLOPS fp16 tensor dense (fp32 accumulate), 82.6 fp32 (Ada whitepaper)
    GPU("RTX4090-24GB", 24564 * MIB, (8, 9), 420 * MIB, 165.0, 82.6, "NVIDIA GeForce RTX 4090"),
    # A100: 40960 MiB (SXM4-40GB), 81920 MiB (SXM4-80GB); 312 TFLOPS bf16 dense, 19.5 fp32 (A100 datasheet)
    GPU("A100-40GB", 40960 * MIB, (8, 0), 420 * MIB, 312.0, 19.5, "NVIDIA A100-SXM4-40GB"),
    GPU("A100-80GB", 81920 * MIB, (8, 0), 420 * MIB, 312.0, 19.5, "NVIDIA A100-SXM4-80GB"),
    # H100 SXM: 81559 MiB; 989 TFLOPS bf16 dense, 67 fp32. PCIe: 81559 MiB; 756 bf16, 51 fp32 (H100 datasheet)
    GPU("H100-80GB", 81559 * MIB, (9, 0), 520 * MIB, 989.0, 67.0, "NVIDIA H100 80GB HBM3"),
    GPU("H100-PCIe-80GB", 81559 * MIB, (9, 0), 520 * MIB, 756.0, 51.0, "NVIDIA H100 PCIe"),
    # H200: 143771 MiB; 989 TFLOPS bf16 dense, 67 fp32 (H200 datasheet)
    GPU("H200-141GB", 143771 * MIB, (9, 0), 520 * MIB, 989.0, 67.0, "NVIDIA H200"),
    # L40S: 46068 MiB; 362 TFLOPS bf16 dense (733 sparse), 91.6 fp32 (L40S datasheet)
    GPU("L40S-48GB", 46068 * MIB, (8, 9), 430 * MIB, 362.0, 91.6, "NVIDIA L40S"),
    # MIG profiles: memory as nvidia-smi reports the GPU instance (MIG user guide,
    # "Supported profiles"); compute scales with the slice count (1/7 .. 7/7).
    GPU("A100-40GB-MIG-1g.5gb", 4864 * MIB, (8, 0), 350 * MIB, 312.0 / 7, 19.5 / 7, "A100 40GB MIG 1g.5gb"),
    GPU("A100-40GB-MIG-2g.10gb", 9856 * MIB, (8, 0), 350 * MIB, 312.0 * 2 / 7, 19.5 * 2 / 7, "A100 40GB MIG 2g.10gb"),
    GPU("A100-40GB-MIG-3g.20gb", 19968 * MIB, (8, 0), 380 * MIB, 312.0 * 3 / 7, 19.5 * 3 / 7, "A100 40GB MIG 3g.20gb"),
    GPU("A100-80GB-MIG-1g.10gb", 9728 * MIB, (8, 0), 350 * MIB, 312.0 / 7, 19.5 / 7, "A100 80GB MIG 1g.10gb"),
    GPU("A100-80GB-MIG-2g.20gb", 19968 * MIB, (8, 0), 380 * MIB, 312.0 * 2 / 7, 19.5 * 2 / 7, "A100 80GB MIG 2g.20gb"),
    GPU("A100-80GB-MIG-3g.40gb", 40192 * MIB, (8, 0), 400 * MIB, 312.0 * 3 / 7, 19.5 * 3 / 7, "A100 80GB MIG 3g.40gb"),
    GPU("H100-80GB-MIG-1g.10gb", 9984 * MIB, (9, 0), 450 * MIB, 989.0 / 7, 67.0 / 7, "H100 80GB MIG 1g.10gb"),
    GPU("H100-80GB-MIG-2g.20gb", 20096 * MIB, (9, 0), 470 * MIB, 989.0 * 2 / 7, 67.0 * 2 / 7, "H100 80GB MIG 2g.20gb"),
    GPU("H100-80GB-MIG-3g.40gb", 40448 * MIB, (9, 0), 500 * MIB, 989.0 * 3 / 7, 67.0 * 3 / 7, "H100 80GB MIG 3g.40gb"),
)

MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

# GFD's ``nvidia.com/gpu.product`` values of each whole card (NVML names, spaces -> dashes). Form factors with
# the same memory and compute share a row (an A100 PCIe 80GB reports 81920 MiB as the SXM4 one does).
_PRODUCTS: dict[str, tuple[str, ...]] = {
    "V100-16GB": ("Tesla-V100-SXM2-16GB", "Tesla-V100-PCIE-16GB"),
    "V100-32GB": ("Tesla-V100-SXM2-32GB", "Tesla-V100-PCIE-32GB", "Tesla-V100S-PCIE-32GB"),
    "T4-16GB": ("Tesla-T4",),
    "A10G-24GB": ("NVIDIA-A10G",),
    "L4-24GB": ("NVIDIA-L4",),
    "RTX3090-24GB": ("NVIDIA-GeForce-RTX-3090",),
    "RTX4090-24GB": ("NVIDIA-GeForce-RTX-4090",),
    "A100-40GB": ("NVIDIA-A100-SXM4-40GB", "A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB", "A100-PCIE-40GB"),
    "A100-80GB": ("NVIDIA-A100-SXM4-80GB", "A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe", "A100-80GB-PCIe"),
    "H100-80GB": ("NVIDIA-H100-80GB-HBM3", "H100-SXM-80GB"),  # the SXM card (H100-SXM-80GB: its row until 0.6)
    "H100-PCIe-80GB": ("NVIDIA-H100-PCIe",),
    "H200-141GB": ("NVIDIA-H200",),
    "L40S-48GB": ("NVIDIA-L40S",),
}


def _with_aliases(gpu: GPU) -> GPU:
    parent, profile = gpu.mig_parent, gpu.mig_profile
    if parent is not None:
        return replace(gpu, aliases=tuple(f"{p}-MIG-{profile}" for p in _PRODUCTS[parent]))
    return replace(gpu, aliases=_PRODUCTS.get(gpu.name, ()))


CATALOG: dict[str, GPU] = {g.name: _with_aliases(g) for g in _CATALOG}
CATALOG_VERSION = "2026-12-03"

def _key(spelling: str) -> str:
    """A spelling as the catalog looks it up: lower case, spaces as dashes (NVML's names, as GFD labels them)."""
    return "-".join(spelling.lower().split())


# every spelling a card answers to, lower-cased, spaces as dashes (names, aliases, nvidia-smi's names are unique
# across the catalog): nvidia-smi's "Tesla T4" and GFD's "Tesla-T4" are one spelling
_SPELLINGS: dict[str, GPU] = {}
for _gpu in CATALOG.values():
    for _spelling in dict.fromkeys(_key(s) for s in (_gpu.name, *_gpu.aliases, _gpu.description)):
        assert _SPELLINGS.get(_spelling, _gpu) is _gpu, _spelling
        _SPELLINGS[_spelling] = _gpu
# a card's family (the name before its first dash: "T4", "A10G", "H200"), for the whole cards only
_FAMILIES: dict[str, list[GPU]] = {}
for _gpu in CATALOG.values():
    if _gpu.mig_parent is None:
        _FAMILIES.setdefault(_key(_gpu.name.split("-")[0]), []).append(_gpu)


def mig_cards(profile: str) -> list[GPU]:
    """The catalog's MIG rows of ``profile`` (``1g.10gb``; any case), on every card that has it."""
    return [g for g in CATALOG.values() if (g.mig_profile or "").lower() == profile.lower()]


def mig_gpu(parent: GPU, profile: str) -> GPU | None:
    """The MIG row of ``profile`` on ``parent`` (``A100-80GB``, ``1g.10gb`` -> ``A100-80GB-MIG-1g.10gb``)."""
    return next((g for g in mig_cards(profile) if g.mig_parent == parent.name), None)


def find_gpu(name: str) -> GPU | None:
    """The card ``name`` spells, case-insensitive: a catalog name, a GFD product label (``aliases``), nvidia-smi's
    name (``Tesla T4``, ``NVIDIA A100-SXM4-80GB``), a family only one whole card has (``T4``, ``L4``, ``A10G``,
    ``H200``), or a MIG resource (``nvidia.com/mig-1g.5gb``) that only one card has; None otherwise
    (``get_gpu`` says why)."""
    gpu = _SPELLINGS.get(_key(name))
    family = _FAMILIES.get(_key(name).replace("-", ""), []) or _FAMILIES.get(_key(name), [])
    if gpu is None and len(family) == 1:
        gpu = family[0]
    if gpu is None and name.lower().startswith(MIG_RESOURCE_PREFIX):
        cards = mig_cards(name[len(MIG_RESOURCE_PREFIX):])
        gpu = cards[0] if len(cards) == 1 else None
    return gpu


def get_gpu(name: str, field: str = "gpus") -> GPU:
    """A card by any spelling ``find_gpu`` takes; ``UnknownGPUError`` with suggestions otherwise (for a MIG
    resource on several cards, the catalog names of its rows)."""
    if not isinstance(name, str):
        raise UnknownGPUError(field, name, [])
    gpu = find_gpu(name)
    if gpu is not None:
        return gpu
    if name.lower().startswith(MIG_RESOURCE_PREFIX):
        rows = mig_cards(name[len(MIG_RESOURCE_PREFIX):])
        if rows:  # more than one card has it: which one is the caller's to say
            raise UnknownGPUError(field, name, [g.name for g in rows])
    family = _FAMILIES.get(_key(name).replace("-", ""), []) or _FAMILIES.get(_key(name), [])
    if family:  # several cards of that family (A100: 40 and 80 GB): which one is the caller's to say
        raise UnknownGPUError(field, name, [g.name for g in family])
    spellings = {s: g.name for s, g in _SPELLINGS.items()}
    close = difflib.get_close_matches(_key(name), list(spellings), n=3, cutoff=0.5)
    # a short name is far from the long spellings: also match it against the families
    close += difflib.get_close_matches(_key(name), list(_FAMILIES), n=3, cutoff=0.5)
    names = [spellings[c] if c in spellings else _FAMILIES[c][0].name for c in close]
    raise UnknownGPUError(field, name, list(dict.fromkeys(names))[:3])


def shortfall(need_bytes: int, usable_bytes: int, batch: int, card: str) -> str:
    """What a step needs against what a card has, in GiB, as the scheduler's filter says it.

    >>> shortfall(166_939_754_496, 85_174_435_840, 1, "A100-80GB")
    'needs 155.5 GiB at batch 1; A100-80GB has 79.3 GiB usable'
    """
    need, usable = f"{need_bytes / 2**30:.1f}", f"{usable_bytes / 2**30:.1f}"
    if need == usable:  # rounded alike: show the difference
        need, usable = f"{need_bytes / 2**30:.3f}", f"{usable_bytes / 2**30:.3f}"
    return f"needs {need} GiB at batch {batch}; {card} has {usable} GiB usable"


# The CUDA context of a card the catalog does not know: what most catalog rows have.
DEFAULT_CONTEXT_BYTES = 450 * MIB


# A custom card's name: plain text that reads the same in JSON, logs, the CLI's table and HTML.
CUSTOM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9 ._()+-]{0,63}$"


def custom_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a custom card (None: it can): off the pattern, or a catalog card's name or
    description in any case, which would read as that card with other numbers."""
    if not re.fullmatch(CUSTOM_NAME_PATTERN, name):
        return "1 to 64 letters, digits, spaces or ._()+-, starting with a letter or digit"
    for gpu in CATALOG.values():
        if name.lower() in (gpu.name.lower(), gpu.description.lower(), *(a.lower() for a in gpu.aliases)):
            return (f"a name no catalog card has: {name!r} is the catalog's {gpu.name} (name that card as a "
                    "string, or give a custom card another name)")
    return None


def custom_gpu(name: str, memory_bytes: int, compute_capability: str = "8.0",
               context_bytes: int = DEFAULT_CONTEXT_BYTES) -> GPU:
    """A card that is not in the catalog, described by the caller."""
    problem = custom_name_problem(name)
    if problem:
        raise SpecError("gpus[].name", name, problem)
    try:
        major, minor = (int(x) for x in compute_capability.split("."))
    except ValueError as exc:
        raise SpecError("gpus[].compute_capability", compute_capability, "'MAJOR.MINOR', e.g. '8.0'") from exc
    return GPU(name, int(memory_bytes), (major, minor), int(context_bytes), 0.0, 0.0, "custom")


def catalog() -> dict[str, object]:
    """The catalog as JSON data: its version and every card (``GET /gpus``)."""
    return {"catalog": CATALOG_VERSION, "gpus": [
        {"name": g.name, "memory_bytes": g.memory_bytes, "compute_capability": g.compute_capability,
         "context_bytes": g.context_bytes, "peak_tflops_bf16": g.peak_tflops_bf16,
         "peak_tflops_fp32": g.peak_tflops_fp32, "description": g.description, "aliases": list(g.aliases),
         "mig_resource": g.mig_resource} for g in CATALOG.values()]}
