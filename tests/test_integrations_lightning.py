"""Lightning's drop-in: ``BatchSizeEstimator`` where ``BatchSizeFinder`` stands, on a module with its own
``training_step`` (two losses) and a datamodule with ``batch_size``; the Trainer's strategies read per rank."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

L = pytest.importorskip("lightning")
from lightning.pytorch.plugins.precision import FSDPPrecision  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from estimator.errors import SpecError  # noqa: E402
from estimator.integrations.fit import batch_like  # noqa: E402
from estimator.integrations.lightning import (  # noqa: E402
    BatchSizeEstimator,
    TrainingStep,
    configured_optimizer,
    distributed_of,
    estimate_lightning,
    recipe_of,
    training_loss,
)
from estimator.measure.cpu import real_cpu_peak  # noqa: E402
from estimator.pipeline import estimate_from_profile, estimate_memory  # noqa: E402
from estimator.portable.profile import PortableProfile  # noqa: E402
from estimator.simulate.recipe import Distributed, Recipe  # noqa: E402
from estimator.trace import Category, Phase  # noqa: E402

pytestmark = pytest.mark.sim
MIB = 2**20


class TwoHeads(L.LightningModule):
    """An encoder with a classifier head and a reconstruction head: the loss is the sum of two."""

    def __init__(self, width: int = 192) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(),
                                     nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU())
        self.classify = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, 10))
        self.reconstruct = nn.ConvTranspose2d(width, 3, 4, stride=2, padding=1)
        self.steps_run = 0  # real steps: the simulation runs training_step on copies of the module

    def training_step(self, batch, batch_idx):
        self.steps_run += 1
        x, y = batch
        z = self.encoder(x)  # (B, width, 32, 32)
        loss = F.cross_entropy(self.classify(z), y) + F.mse_loss(self.reconstruct(z), x)
        self.log("loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


class Blocks(L.LightningModule):
    """Four Linear(1024, 1024) blocks over 512 tokens a sample: 4 x (1024*1024 + 1024) fp32 parameters,
    16.02 MiB a block."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        for block in self.blocks:
            x = torch.relu(block(x))  # (B, 512, 1024)
        return F.cross_entropy(x.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Images(L.LightningDataModule):
    """48 images 3x64x64 and their labels; ``batch_size`` is what the callback sets."""

    def __init__(self, batch_size: int = 4, samples: int = 48) -> None:
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def setup(self, stage=None):
        g = torch.Generator().manual_seed(0)
        self.data = TensorDataset(torch.rand(self.samples, 3, 64, 64, generator=g),
                                  torch.randint(0, 10, (self.samples,), generator=g))

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=self.batch_size)


def _trainer(callback, **kw):
    return L.Trainer(accelerator="cpu", max_steps=2, callbacks=[callback], logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, **kw)


def _images(b: int, device: torch.device):
    return torch.rand(b, 3, 64, 64, device=device), torch.zeros(b, dtype=torch.long, device=device)


# Lightning's automatic optimization: configure_optimizers' Adam(lr=1e-3), zero_grad after the training step
LIGHTNING = Recipe(optimizer="adam", optimizer_kwargs={"lr": 1e-3}, zero_grad_at="after-forward")


# estimate_memory calls training_step outside a Trainer, where self.log() warns and logs nothing
@pytest.mark.filterwarnings("ignore:You are trying to `self.log\\(\\)`:UserWarning")
def test_the_callback_sets_the_recommended_batch_before_training() -> None:
    module, data = TwoHeads(), Images()
    weight = module.encoder[0].weight.detach().clone()
    callback = BatchSizeEstimator(gpu="A100-80GB")
    trainer = _trainer(callback)
    trainer.fit(module, data)
    rec = callback.result.recommended_batch_size
    assert rec is not None and 1 < rec <= 8192 and callback.batch_size == rec
    assert data.batch_size == rec and trainer.train_dataloader.batch_size == rec  # set before the loader was made
    # every step trained for real: 2 of them (the dataset, 48 images, is smaller than the batch: each step is
    # all of it), and none for the search (the simulation runs training_step on copies with fake parameters)
    assert module.steps_run == 2
    assert callback.result.world_size == 1 and callback.accumulation == 1
    assert callback.fit.recipe.zero_grad_at == "after-forward"
    # the module's own optimizer was simulated, as configure_optimizers builds it
    assert any("the model's own, Adam" in line for line in callback.fit.response.assumptions)
    # the figure is estimate_memory's of the same module and step at that batch
    report = estimate_memory(module, _images, batch_size=rec, recipe=LIGHTNING, gpu="A100-80GB",
                             step_fn=lambda m, b: m.training_step(b, 0)["loss"])
    for name in ("allocated_peak_bytes", "reserved_peak_bytes"):
        ours, plain = getattr(callback.report, name), getattr(report, name)
        assert abs(ours - plain) <= 0.01 * plain, (name, ours, plain)
    assert not torch.equal(module.encoder[0].weight.detach(), weight)  # trained for real
    assert module.encoder[0].weight.device.type == "cpu"


class OwnData(TwoHeads):
    """A module that makes its dataset in its own ``setup`` (which Lightning calls after the callbacks') and has
    the ``batch_size`` itself."""

    def __init__(self) -> None:
        super().__init__(width=32)
        self.batch_size = 4

    def setup(self, stage: str) -> None:
        self.data = Images(samples=16)
        self.data.setup()

    def train_dataloader(self):
        return DataLoader(self.data.data, batch_size=self.batch_size)


def test_a_module_with_its_own_data_gets_the_batch() -> None:
    module = OwnData()
    callback = BatchSizeEstimator(gpu="T4-16GB", max_val=100_000)
    _trainer(callback).fit(module)
    assert module.batch_size == callback.result.recommended_batch_size > 4 and module.steps_run == 2


def test_the_callback_refuses_a_module_without_the_batch_field() -> None:
    trainer = _trainer(BatchSizeEstimator(gpu="A100-80GB", batch_arg_name="micro_batch"))
    with pytest.raises(SpecError) as info:
        trainer.fit(TwoHeads(), Images())
    assert info.value.field == "batch_arg_name" and info.value.value == "micro_batch"


def test_the_cpu_target_matches_the_profiler() -> None:
    """``gpu=None`` on a CPU Trainer: the step at the datamodule's batch, predicted on the CPU target, against the
    same step run for real under torch.profiler (estimator/measure/cpu.py)."""
    module, data = TwoHeads(width=32), Images(batch_size=4)
    callback = BatchSizeEstimator()
    _trainer(callback).fit(module, data)
    assert callback.fit.card is None and callback.result is None and data.batch_size == 4  # nothing set
    predicted = callback.report.allocated_peak_bytes

    def real_copy():
        step = TrainingStep(copy.deepcopy(TwoHeads(width=32)))
        step.module.log = lambda *a, **k: None  # as in the simulation: logging is not modelled
        return step

    example = next(iter(data.train_dataloader()))  # the batch the callback shaped its batches like
    measured = real_cpu_peak("lightning", callback.fit.recipe, 4, (real_copy, batch_like(example, 4), None),
                             step_fn=training_loss, optimizer_fn=configured_optimizer)
    assert measured > 0
    assert abs(predicted - measured) <= 0.02 * measured, (predicted, measured)


def test_the_ddp_and_fsdp_strategies_answer_per_rank() -> None:
    """Strategies read without a launch: DDPStrategy from a CPU Trainer(devices=2, strategy="ddp"), FSDPStrategy
    constructed with 4 CUDA devices (Lightning refuses FSDP on a CPU Trainer); each rank's step is simulated."""
    module = Blocks()
    batch = (torch.rand(8, 512, 1024), torch.zeros(8, 512, dtype=torch.long))
    ddp_trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert isinstance(ddp_trainer.strategy, DDPStrategy)
    fsdp = FSDPStrategy(parallel_devices=[torch.device("cuda", i) for i in range(4)],
                        precision_plugin=FSDPPrecision("32-true"))
    single = estimate_lightning(module, batch, gpu="A100-80GB", batch_size=8)
    ddp = estimate_lightning(module, batch, trainer=ddp_trainer, gpu="A100-80GB", batch_size=8)
    sharded = estimate_lightning(module, batch, strategy=fsdp, precision="32-true", gpu="A100-80GB", batch_size=8)
    assert ddp.recipe.distributed == Distributed("ddp", 2)
    assert sharded.recipe.distributed == Distributed("fsdp", 4)
    assert (single.result.world_size, ddp.result.world_size, sharded.result.world_size) == (1, 2, 4)
    assert ddp.result.global_batch_size == 2 * ddp.result.recommended_batch_size
    step = TrainingStep(module)

    def plain(fit, batch_size):  # the same step through estimate_memory, with the recipe the strategy gave
        recipe = dataclasses.replace(fit.recipe, optimizer="adamw", optimizer_kwargs={"lr": 1e-3})
        return estimate_memory(step, batch_like(batch, 8), batch_size=batch_size, step_fn=training_loss,
                               gpu="A100-80GB", recipe=recipe)

    for fit in (single, ddp, sharded):  # the callback's figure at its batch is that step's
        assert plain(fit, fit.batch_size).allocated_peak_bytes == fit.report.allocated_peak_bytes
    params = 4 * (1024 * 1024 + 1024) * 4  # fp32 bytes

    def made(trace, category):  # bytes of ``category`` allocated in the set-up and the first iteration
        return sum(a.nbytes for a in trace.allocations if a.category == category and a.iteration == 0
                   and a.phase in (Phase.SETUP, Phase.OPTIMIZER))

    one, two, four = (plain(fit, 8).trace for fit in (single, ddp, sharded))
    assert made(one, Category.PARAMETER) == made(two, Category.PARAMETER) == params  # DDP: the whole model
    assert made(four, Category.PARAMETER) == params // 4  # FSDP: 1024 rows split 4 ways, no padding
    assert made(one, Category.OPTIMIZER_STATE) >= 2 * params  # AdamW's two moments (and its step counters)
    assert 2 * params // 4 <= made(four, Category.OPTIMIZER_STATE) < made(one, Category.OPTIMIZER_STATE) / 3
    # DDP's buckets, a second copy of the gradients (gradient_as_bucket_view off): 4 fp32 bytes a parameter
    assert sum(a.nbytes for a in two.allocations if a.category == Category.COMMUNICATION
               and a.phase == Phase.SETUP) == params


@pytest.mark.parametrize(("strategy", "expected"), [
    (lambda: FSDPStrategy(parallel_devices=[torch.device("cuda", i) for i in range(8)],
                          precision_plugin=FSDPPrecision("bf16-mixed"), sharding_strategy="SHARD_GRAD_OP"),
     Distributed("fsdp", 8, reshard_after_forward=False, param_dtype="bf16", reduce_dtype="bf16")),
    (lambda: DDPStrategy(parallel_devices=[torch.device("cpu")] * 2, bucket_cap_mb=50,
                         gradient_as_bucket_view=True),
     Distributed("ddp", 2, bucket_cap_mb=50, gradient_as_bucket_view=True)),
])
def test_strategy_settings_become_the_recipe(strategy, expected) -> None:
    d, checkpointing = distributed_of(strategy())
    assert d == expected and checkpointing is False


def test_precisions_map_to_the_recipe() -> None:
    fsdp = FSDPStrategy(parallel_devices=[torch.device("cuda", 0)] * 2, precision_plugin=FSDPPrecision("bf16-mixed"))
    # FSDP casts to bf16 for compute: batchfit's fsdp.param_dtype, without autocast
    assert recipe_of(fsdp, "bf16-mixed").precision == "fp32"
    assert recipe_of(DDPStrategy(parallel_devices=[torch.device("cpu")]), "16-mixed").precision == "amp-fp16"
    with pytest.raises(SpecError) as info:
        recipe_of(DDPStrategy(parallel_devices=[torch.device("cpu")]), "64-true")
    assert info.value.field == "precision"


def test_the_profile_answers_without_the_code(tmp_path: Path) -> None:
    module, data = TwoHeads(width=32), Images()
    path = tmp_path / "step.profile.json"
    callback = BatchSizeEstimator(gpu="A100-80GB", max_val=100_000, profile_path=path)
    _trainer(callback).fit(module, data)
    profile = PortableProfile.from_json(json.loads(path.read_text()))
    assert profile.request["model"] == {"source": "custom", "factory": f"{__name__}:TwoHeads", "kwargs": {}}
    again = estimate_from_profile(profile, gpus=["A100-80GB"])
    assert again.results[0].max_batch_size == callback.result.max_batch_size


def test_target_global_batch_sets_accumulation() -> None:
    module, data = TwoHeads(width=32), Images()
    callback = BatchSizeEstimator(gpu="T4-16GB", target_global_batch=4096, max_val=1000)
    trainer = _trainer(callback)
    trainer.fit(module, data)
    # the micro-batch at most max_val: ceil(4096 / 1000) = 5 steps of 820 (global 4100 >= 4096)
    assert data.batch_size == callback.batch_size <= 1000
    assert trainer.accumulate_grad_batches == callback.accumulation
    assert callback.batch_size * callback.accumulation >= 4096


class Recorded(TwoHeads):
    """Writes what each rank trains with to ``out/rank<N>.json`` when training starts."""

    def __init__(self, out: str) -> None:
        super().__init__(width=32)
        self.out = out

    def on_train_start(self) -> None:
        callback = next(c for c in self.trainer.callbacks if isinstance(c, BatchSizeEstimator))
        (Path(self.out) / f"rank{self.global_rank}.json").write_text(json.dumps({
            "batch": self.trainer.datamodule.batch_size, "world": callback.result.world_size,
            "recommended": callback.result.recommended_batch_size}))


LAUNCH = """
import sys
from test_integrations_lightning import BatchSizeEstimator, Images, Recorded, _trainer
trainer = _trainer(BatchSizeEstimator(gpu="A100-80GB", max_val=100_000), devices=2, strategy="ddp_fork")
trainer.fit(Recorded(sys.argv[1]), Images())
"""


def test_a_launched_ddp_job_gets_one_answer_on_every_rank(tmp_path: Path) -> None:
    """A real 2-process DDP launch on the CPU (``ddp_fork``, gloo; in a fresh interpreter, since this one has run
    autograd's threads, which fork refuses): rank 0 simulates with the job's process group set aside, both
    ranks train at its batch, and the job's group still works after (the training's all-reduces)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {"PYTHONPATH": f"{repo}:{repo / 'tests'}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", LAUNCH, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=repo)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["world"] == 2 and ranks[0]["batch"] == ranks[0]["recommended"]
