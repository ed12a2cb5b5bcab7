"""Bytes at the peak per module (estimator/replay/modules.py) and ``batchfit estimate --by-module``."""

from __future__ import annotations

import json

import pytest
import torch
import torchvision
from support import A100_80 as A100

from estimator.cli.main import main
from estimator.models.building import count_parameters
from estimator.models.meta import build_on_meta
from estimator.replay.allocator import round_size
from estimator.replay.modules import (
    breakdown_by_module,
    format_bytes,
    format_table,
    module_bytes,
    parameter_counts,
    parameter_owners,
    peak_blocks,
    table_rows,
)
from estimator.replay.report import Breakdown, report_from_trace
from estimator.simulate.recipe import Recipe
from estimator.simulate.record import record_training
from estimator.testing.zoo import ZOO
from estimator.trace import Category

pytestmark = pytest.mark.sim


PARAM, ACT = Category.PARAMETER, Category.ACTIVATION


def _run(factory, batches, loss, batch):
    trace = record_training(factory, batches, loss, batch, Recipe(), A100)
    report = report_from_trace(trace, batch, A100)
    return trace, report, breakdown_by_module(trace, A100, build_on_meta(factory))


@pytest.fixture(scope="module")
def mlp():
    return _run(*ZOO["mlp"], 8)


@pytest.fixture(scope="module")
def resnet18():
    # torchvision resnet18, 10 classes, 64x64 images; at batch 64 the peak is in the backward of
    # layer2.1.conv2 (torch.cuda.max_memory_allocated's moment): layer1's saved activations are all live
    trace, report, mb = _run(*ZOO["resnet18"], 64)
    assert report.peak_phase == "backward" and report.peak_module == "layer2.1.conv2"
    return trace, report, mb


def test_parameter_bytes_per_module_by_hand(mlp) -> None:
    trace, report, mb = mlp
    tree = mb.tree()
    # Linear(256, 512): weight 512*256*4 = 524,288 (1,024 blocks of 512 B), bias 512*4 = 2,048
    assert mb.own["net.0"][PARAM] == 524_288 + 2_048
    # Linear(512, 10): weight 10*512*4 = 20,480 (40 blocks of 512 B), bias 10*4 = 40 -> one 512-B block
    assert mb.own["net.2"][PARAM] == 20_480 + 512
    assert PARAM not in mb.own.get("net.1", {})  # ReLU
    # the container counts its children, the model row all of it: 526,336 + 20,992 = 547,328
    assert tree["net"][PARAM] == tree[""][PARAM] == 547_328 == report.breakdown.parameters
    # in requested bytes (no replay), the bias is its 40 bytes
    requested = module_bytes(trace, mb.peak_event, names=parameter_owners(trace, build_on_meta(ZOO["mlp"][0])))
    assert requested.own["net.2"][PARAM] == 20_480 + 40
    # fvcore's counts: 256*512 + 512 = 131,584 and 512*10 + 10 = 5,130
    assert mb.counts == {"": 136_714, "net": 136_714, "net.0": 131_584, "net.2": 5_130}


def test_rows_sum_to_the_report_breakdown(mlp, resnet18) -> None:
    for _, report, mb in (mlp, resnet18):
        assert Breakdown.from_categories(mb.total, report.batch_size) == report.breakdown
        assert sum(sum(c.values()) for c in mb.own.values()) == report.breakdown.total()
        # every parameter is some module's: the model's root holds none itself in these two
        assert sum(c.get(PARAM, 0) for p, c in mb.own.items() if p) == report.breakdown.parameters
        assert mb.unattributed_parameters == 0


def test_parameter_blocks_not_requests() -> None:
    # torchvision resnet18 with its 1000 classes: fc.weight is 1000*512*4 = 2,048,000 B (a multiple of
    # 512), served from a cached 2 MiB large-pool block whose 49,152 B remainder is too small to split
    # off (the large pool splits only remainders over 1 MiB): its block is 2,097,152 B
    def batches(b, device):
        return torch.empty(b, 3, 64, 64, device=device), torch.zeros(b, dtype=torch.long, device=device)

    _, report, mb = _run(torchvision.models.resnet18, batches, torch.nn.functional.cross_entropy, 2)
    assert mb.own["fc"][PARAM] == 2_097_152 + round_size(1000 * 4)  # the bias: 4,000 -> 4,096
    assert sum(c.get(PARAM, 0) for p, c in mb.own.items() if p) == report.breakdown.parameters == 46_810_112
    requested = sum(round_size(p.numel() * 4) for p in build_on_meta(torchvision.models.resnet18).parameters())
    assert report.breakdown.parameters - requested == 49_152


class FourWeights(torch.nn.Module):
    """Materialized in the order a, b, c, d (Module._apply: children first, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(1536, 1536, bias=False)  # 1536*1536*4 = 9,437,184 B = 9 MiB
        self.b = torch.nn.Linear(1536, 1536, bias=False)
        self.c = torch.nn.Linear(512, 1000, bias=False)  # 1000*512*4 = 2,048,000 B
        self.d = torch.nn.Linear(1000, 512, bias=False)  # 512*1000*4 = 2,048,000 B

    def forward(self, x):
        return self.d(self.c(self.b(self.a(x))[:, :512]))


def test_equal_sizes_keep_their_own_blocks() -> None:
    # a: 9 MiB -> a fresh 20 MiB segment (1-10 MiB requests), 11 MiB left; b: that 11 MiB block, 2 MiB left
    # (split off: more than 1 MiB); c: the 2 MiB block, whose 49,152 B rest stays with it; d: a fresh segment
    def batches(b, device):
        return torch.empty(b, 1536, device=device), torch.zeros(b, dtype=torch.long, device=device)

    _, report, mb = _run(FourWeights, batches, torch.nn.functional.cross_entropy, 4)
    assert [mb.own[m][PARAM] for m in "abcd"] == [9_437_184, 9_437_184, 2_097_152, 2_048_000]
    assert report.breakdown.parameters == 2 * 9_437_184 + 2_097_152 + 2_048_000


def test_tied_weights_once_under_their_first_name() -> None:
    _, report, mb = _run(*ZOO["tied"], 4)
    # emb.weight (500*64*4 = 128,000 B = 250 blocks) is out.weight too: counted once, as emb's
    assert mb.own["emb"][PARAM] == 128_000
    assert PARAM not in mb.own.get("out", {})
    # mid: 64*64*4 + 64*4 = 16,384 + 256 -> 512
    assert mb.own["mid"][PARAM] == 16_384 + 512
    assert report.breakdown.parameters == 128_000 + 16_896
    assert mb.counts[""] == 500 * 64 + 64 * 64 + 64 and "out" not in mb.counts


def test_activations_aggregate_up_the_tree(resnet18) -> None:
    _, report, mb = resnet18
    tree = mb.tree()
    # conv1 (7x7, stride 2): 64 x 64 x 32 x 32 fp32 = 16,777,216 B, saved by bn1
    assert mb.own["conv1"][ACT] == 64 * 64 * 32 * 32 * 4 == 16_777_216
    # bn1: its output (ReLU runs in place on it) and save_mean, save_invstd (64*4 = 256 B -> 512 each)
    assert mb.own["bn1"][ACT] == 16_777_216 + 2 * 512
    # after the max pool, 16 x 16: each conv of layer1 saves 64*64*16*16*4 = 4,194,304, each bn that + 1,024
    conv, bn = 4_194_304, 4_194_304 + 1_024
    assert [mb.own[f"layer1.0.{m}"][ACT] for m in ("conv1", "bn1", "conv2", "bn2")] == [conv, bn, conv, bn]
    assert ACT not in mb.own.get("layer1.0", {})  # the block's add and ReLU run in place on bn2's output
    assert tree["layer1.0"][ACT] == tree["layer1.1"][ACT] == 2 * conv + 2 * bn == 16_779_264
    assert tree["layer1"][ACT] == 2 * 16_779_264
    assert tree[""][ACT] == report.breakdown.activations
    # every row: its own bytes and its direct children's rows
    for path, row in tree.items():
        if not path:
            continue
        children = [p for p in tree if p.startswith(path + ".") and p.count(".") == path.count(".") + 1]
        for cat, n in row.items():
            assert n == mb.own.get(path, {}).get(cat, 0) + sum(tree[c].get(cat, 0) for c in children), (path, cat)


def test_top_modules_and_the_table(resnet18) -> None:
    _, _, mb = resnet18
    assert mb.top(ACT, 2) == [("bn1", 16_778_240), ("conv1", 16_777_216)]
    # layer4's 3x3 512->512 convs: 512*512*9*4 = 9,437,184 B each; the tie goes in the model's order
    assert mb.top(PARAM, 1) == [("layer4.0.conv2", 9_437_184)]
    assert table_rows(mb, 1) == ["", "bn1", "layer4", "layer4.0", "layer4.0.conv2"]
    lines = format_table(mb, 1).splitlines()
    assert [c.strip() for c in lines[0].strip("|").split("|")] == [
        "module", "#parameters", "parameters", "gradients", "activations", "temporaries"]
    cells = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
             for line in lines[2:]}
    assert list(cells) == ["model", "bn1", "layer4", "layer4.0", "layer4.0.conv2"]
    # fvcore's sizes for counts: 512*512*9 = 2,359,296 -> '2.359M'; bytes in binary units
    assert cells["layer4.0.conv2"][:2] == ["2.359M", "9 MiB"]
    assert cells["bn1"][3] == format_bytes(16_778_240) == "16 MiB"


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 512, 2_048, 46_810_112, 3 * 2**29)] == [
        "0 B", "512 B", "2 KiB", "44.64 MiB", "1.5 GiB"]


def test_peak_blocks_for_the_cpu(mlp) -> None:
    trace, _, _ = mlp
    peak, sizes = peak_blocks(trace, None)
    assert (sum(sizes.values()), peak) == trace.live_peak()


@pytest.mark.parametrize("name", ["mlp", "tied", "resnet18", "gpt2", "bert"])
def test_fvcore_parameter_count_is_count_parameters(name) -> None:
    # why count_parameters stays a sum: fvcore.nn.parameter_count walks the same named_parameters()
    # (tied weights once), so on meta it gives the same total; the column it fills is per module
    model = build_on_meta(ZOO[name][0])
    assert parameter_counts(model)[""] == count_parameters(model)


CONVNET_SPEC = {"input": {"image_size": [3, 16, 16]}, "gpus": ["A100-80GB"], "batch_size": 64,
                "planner": {"confirm": "none"}}


def test_cli_by_module_table(tmp_path, capsys) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(CONVNET_SPEC))
    assert main(["estimate", "--spec", str(spec), "--model", "estimator.testing.zoo:ConvNet", "--by-module"]) == 0
    out = capsys.readouterr().out
    head, _, rest = out.partition("\nby module at the peak (batch 64 on A100-80GB, ")
    assert head.splitlines()[0].split()[:3] == ["gpu", "memory", "GiB"]  # the normal table first
    table = [line for line in rest.splitlines() if line.startswith("|")]
    assert table[0].split("|")[1].strip() == "module"
    model = [c.strip() for c in table[2].strip("|").split("|")]
    # Conv2d(3, 8, 3): 8*3*3*3 + 8 = 224; Linear(2048, 10): 20,480 + 10 = 20,490; 20,714 in all.
    # Blocks: 864 B -> 1,024 and 32 B -> 512; 81,920 B and 40 B -> 512: 83,968 B = 82 KiB
    assert model[:3] == ["model", "20.714K", "82 KiB"]
    assert "not by module: optimizer state" in rest


def test_cli_by_module_json(tmp_path, capsys) -> None:
    spec = tmp_path / "job.json"
    spec.write_text(json.dumps(CONVNET_SPEC))
    args = ["estimate", "--spec", str(spec), "--model", "estimator.testing.zoo:ConvNet", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(args + ["--by-module", "3"]) == 0
    body = json.loads(capsys.readouterr().out)
    by_module = body.pop("by_module")
    assert set(body) == set(plain)  # the response itself gains nothing
    assert by_module["batch_size"] == 64 and by_module["gpu"] == "A100-80GB"
    model = by_module["modules"][""]
    assert Breakdown.from_categories(model, 64) == Breakdown(**body["breakdown"])
    assert by_module["modules"]["fc"]["parameter"] == 81_920 + 512
    assert by_module["parameter_count"] == {"": 20_714, "conv": 224, "fc": 20_490}


def test_cli_by_module_needs_a_spec(tmp_path, capsys) -> None:
    assert main(["estimate", "--profile", str(tmp_path / "p.json"), "--by-module"]) == 2
    assert capsys.readouterr().err == ("error: --by-module: got '--profile'; expected --spec FILE: a profile has "
                                       "no model to break down by module\n")
