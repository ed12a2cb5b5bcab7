"""The card names people type: catalog names, nvidia-smi's and GPU Feature Discovery's names, a family only
one whole card has; close matches and the custom-card form for the rest; one row per physical card."""

from __future__ import annotations

import pytest

from estimator.errors import UnknownGPUError
from estimator.gpus import CATALOG, find_gpu, get_gpu

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("typed", "card"), [
    ("T4", "T4-16GB"), ("L4", "L4-24GB"), ("A10G", "A10G-24GB"), ("H200", "H200-141GB"), ("L40S", "L40S-48GB"),
    ("rtx 4090", "RTX4090-24GB"),                                   # families, any case, spaced or not
    ("Tesla T4", "T4-16GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),  # nvidia-smi --query-gpu=name
    ("NVIDIA H100 80GB HBM3", "H100-80GB"), ("NVIDIA GeForce RTX 3090", "RTX3090-24GB"),
    ("Tesla-T4", "T4-16GB"), ("NVIDIA-L4", "L4-24GB"),               # GFD's nvidia.com/gpu.product
    ("H100-SXM-80GB", "H100-80GB"),                                 # the name of a row merged into another
])
def test_names_people_type_find_their_card(typed: str, card: str) -> None:
    assert get_gpu(typed).name == card


@pytest.mark.parametrize(("typed", "suggested"), [
    ("A100", ["A100-40GB", "A100-80GB"]), ("H100", ["H100-80GB", "H100-PCIe-80GB"]),
    ("V100", ["V100-16GB", "V100-32GB"]),                           # a family of several cards: all of them
    ("T5", ["T4-16GB"]),                                            # a short name gets a close match too
])
def test_a_name_that_is_not_one_card_suggests_the_cards_it_may_mean(typed: str, suggested: list[str]) -> None:
    with pytest.raises(UnknownGPUError) as exc:
        get_gpu(typed, field="gpus[0]")
    assert exc.value.field == "gpus[0]" and exc.value.suggestions[:len(suggested)] == suggested


def test_an_unknown_card_points_at_the_custom_card_form() -> None:
    with pytest.raises(UnknownGPUError) as exc:
        get_gpu("B200")
    assert '"memory_bytes"' in exc.value.expected and '"compute_capability"' in exc.value.expected


def test_one_row_per_physical_card() -> None:
    whole = [g for g in CATALOG.values() if g.mig_parent is None]
    specs = [(g.memory_bytes, g.capability, g.peak_tflops_bf16, g.peak_tflops_fp32) for g in whole]
    assert len(specs) == len(set(specs)), "two rows describe the same card"
    assert find_gpu("H100-SXM-80GB") is CATALOG["H100-80GB"]
