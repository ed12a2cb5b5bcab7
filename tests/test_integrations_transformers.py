"""The Hugging Face Trainer's drop-in: ``fit_training_args`` for a small causal LM built from a config, against
``POST /estimate`` for the equivalent request and against a real Trainer on the CPU."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("accelerate")
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments  # noqa: E402

from estimator.errors import SpecError  # noqa: E402
from estimator.integrations.fit import fit_batch  # noqa: E402
from estimator.integrations.transformers import (  # noqa: E402
    PeakMemoryCallback,
    distributed_of,
    estimate_trainer,
    fit_training_args,
    recipe_of,
    trainer_step,
)
from estimator.measure.cpu import cpu_peak_of, real_cpu_peak  # noqa: E402
from estimator.simulate.recipe import Distributed  # noqa: E402

pytestmark = pytest.mark.sim
CONFIG = {"vocab_size": 1024, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 128}
SEQ = 128


def _model(attention: str = "sdpa") -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), attn_implementation=attention)


def _eager() -> torch.nn.Module:
    return _model("eager")


def _args(tmp_path, **kw) -> TrainingArguments:
    base = {"bf16": True, "activation_checkpointing": True, "optim": "adamw_torch", "use_cpu": True,
            "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True}
    return TrainingArguments(output_dir=str(tmp_path), **{**base, **kw})


def _sample(shared_labels: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 1024, (1, SEQ))
    return {"input_ids": ids, "attention_mask": torch.ones(1, SEQ, dtype=torch.long),
            "labels": ids if shared_labels else ids.clone()}


class Tokens(torch.utils.data.Dataset):
    """``n`` token sequences (8: fewer than the fitted batch, so each CPU step trains on all of them)."""

    def __init__(self, n: int = 8) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 1024, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long),
                "labels": self.ids[i]}


def test_the_fitted_arguments_train_two_steps_on_the_cpu(tmp_path) -> None:
    args = _args(tmp_path, max_steps=2)
    model = _model()
    fitted = fit_training_args(args, model, _sample(shared_labels=False), gpu="A100-80GB", target_global_batch=None)
    assert fitted is not args and args.per_device_train_batch_size == 8  # the caller's arguments untouched
    fit = estimate_trainer(args, model, _sample(shared_labels=False), gpu="A100-80GB")
    assert fitted.per_device_train_batch_size == fit.result.recommended_batch_size > 8
    assert fitted.gradient_accumulation_steps == 1
    assert fit.recipe.precision == "amp-bf16" and fit.recipe.gradient_checkpointing is True
    # the Trainer's own optimizer: AdamW over its weight-decay and no-decay groups
    assert any("the model's own, AdamW (2 parameter groups" in line for line in fit.response.assumptions)
    trainer = Trainer(model, fitted, train_dataset=Tokens())
    state = trainer.train()
    assert trainer.state.global_step == 2 and state.training_loss > 0
    assert trainer.state.train_batch_size == fitted.per_device_train_batch_size  # what the Trainer trained at


@pytest.mark.parametrize("bf16", [False, True])
def test_the_simulated_step_is_the_trainers(tmp_path, bf16: bool) -> None:
    """On the CPU, under torch.profiler: a real ``Trainer.train()`` of 2 steps at batch 4 allocates what the loop
    batchfit simulates (estimator/simulate/step.py, with the Trainer's optimizer and loss) allocates, run for
    real; the simulation on the CPU target predicts that peak. Eager attention: the CPU target's SDPA is not
    the CPU's own kernel (its prediction is 3.5% high for this model), which is the simulator's, not the
    Trainer's."""
    args = _args(tmp_path, bf16=bf16, max_steps=2, per_device_train_batch_size=4, activation_checkpointing=False)
    built, recipe = trainer_step(args, _eager(), _sample(shared_labels=False))
    trainer_peak = cpu_peak_of(lambda: Trainer(_eager(), args, train_dataset=Tokens(4)).train())
    loop_peak = real_cpu_peak("trainer", recipe, 4, (_eager, built.batch_factory, None), step_fn=built.step_fn,
                              optimizer_fn=built.optimizer_fn)
    assert abs(trainer_peak - loop_peak) <= 0.001 * trainer_peak, (trainer_peak, loop_peak)
    predicted = fit_batch(built, recipe, None, batch_size=4).report.allocated_peak_bytes
    assert abs(predicted - trainer_peak) <= 0.01 * trainer_peak, (predicted, trainer_peak)


def test_target_global_batch_sets_accumulation(tmp_path) -> None:
    fitted = fit_training_args(_args(tmp_path), _model(), _sample(shared_labels=False), gpu="T4-16GB",
                               target_global_batch=100_000)
    # the micro-batch at most the recommended one; micro x steps >= the target, the fewest steps that give it
    fit = estimate_trainer(_args(tmp_path), _model(), _sample(shared_labels=False), gpu="T4-16GB",
                           target_global_batch=100_000)
    plan = fit.result.accumulation
    assert (fitted.per_device_train_batch_size, fitted.gradient_accumulation_steps) == (plan.micro_batch, plan.steps)
    assert plan.micro_batch <= fit.result.recommended_batch_size and plan.micro_batch * plan.steps >= 100_000


@pytest.mark.service
def test_the_batch_is_post_estimates_for_the_equivalent_request(tmp_path) -> None:
    """The request's causal-LM batch has ``labels`` that are the ``input_ids`` tensor itself; a sample made so is
    the equivalent one, and the answers agree. (A collator that clones the ids into the labels makes one more
    tensor per batch, which the simulation keeps: its answer is its own.)"""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    fit = estimate_trainer(_args(tmp_path), _model(), _sample(shared_labels=True), gpu="A100-80GB")
    request = {"model": {"source": "transformers", "config": {"model_type": "llama", **CONFIG}, "task": "causal-lm"},
               "input": {"seq_len": SEQ}, "gpus": ["A100-80GB"],
               "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw"}, "gradient_checkpointing": True}}
    app = create_app(Settings(workers=1, queue_size=0, cache_path=str(tmp_path / "cache.sqlite"),
                              request_timeout_s=300))
    with TestClient(app) as client:
        answer = client.post("/estimate", json=request)
    assert answer.status_code == 200, answer.text
    served = answer.json()["results"][0]
    assert (fit.result.max_batch_size, fit.result.recommended_batch_size) == (
        served["max_batch_size"], served["recommended_batch_size"])


def test_the_launch_environment_gives_the_world(tmp_path) -> None:
    plain = SimpleNamespace(world_size=4, deepspeed=None, fsdp=None, ddp_bucket_cap_mb=50)
    assert distributed_of(plain) == (Distributed("ddp", 4, bucket_cap_mb=50), False)
    fsdp = SimpleNamespace(world_size=8, deepspeed=None, fsdp=True,
                           fsdp_config={"reshard_after_forward": False, "activation_checkpointing": True})
    assert distributed_of(fsdp) == (Distributed("fsdp", 8, reshard_after_forward=False), True)
    for stage, strategy in ((1, "zero1"), (3, "fsdp")):
        zero = SimpleNamespace(world_size=2, deepspeed={"zero_optimization": {"stage": stage}}, fsdp=None)
        assert distributed_of(zero)[0] == Distributed(strategy, 2)
    with pytest.raises(SpecError) as info:
        distributed_of(SimpleNamespace(world_size=2, deepspeed={"zero_optimization": {"stage": 2}}, fsdp=None))
    assert info.value.field == "deepspeed.zero_optimization.stage" and info.value.value == 2
    # TrainingArguments' own FSDP settings (transformers 5: FSDP2 unless fsdp_config says version 1)
    args = _args(tmp_path, fsdp="full_shard")
    d, _ = distributed_of(args, world_size=4)
    assert d == Distributed("fsdp", 4)
    # bf16 under FSDP: accelerate's MixedPrecisionPolicy in bf16 (batchfit's fsdp.param_dtype, no autocast)
    recipe = recipe_of(args, _model())
    assert recipe.precision == "fp32"
    assert recipe.distributed == Distributed("fsdp", 1, param_dtype="bf16", reduce_dtype="bf16")


def test_the_cpu_target_is_refused_and_samples_are_checked(tmp_path) -> None:
    if not torch.cuda.is_available():  # gpu=None is the card this machine has: none here
        with pytest.raises(SpecError) as info:
            estimate_trainer(_args(tmp_path), _model(), _sample(shared_labels=False))
        assert info.value.field == "gpu" and info.value.value is None
    with pytest.raises(SpecError) as info:
        estimate_trainer(_args(tmp_path), _model(), torch.zeros(1, SEQ), gpu="A100-80GB")  # type: ignore[arg-type]
    assert info.value.field == "sample"


def test_the_callback_measures_only_on_a_gpu(caplog) -> None:
    callback = PeakMemoryCallback(predicted_reserved_bytes=10 * 2**30, after_steps=2)
    state, control = SimpleNamespace(global_step=2), object()
    with caplog.at_level(logging.INFO, logger="estimator.integrations.transformers"):
        assert callback.on_step_end(None, state, control) is control
    if torch.cuda.is_available():
        assert callback.measured is not None and "predicted 10.00 GiB reserved" in caplog.text
    else:
        assert callback.measured is None and caplog.text == ""


@pytest.mark.gpu
def test_the_callback_logs_the_measured_peak_beside_the_prediction(tmp_path, caplog) -> None:
    """On a CUDA GPU: a Trainer at the fitted batch, its reserved peak after 2 steps within the headroom."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    args = _args(tmp_path, use_cpu=False, max_steps=2)
    model = _model()
    fit = estimate_trainer(args, model, _sample(shared_labels=False))  # the card this machine has
    fitted = fit_training_args(args, model, _sample(shared_labels=False))
    callback = PeakMemoryCallback.of(fit)
    with caplog.at_level(logging.INFO, logger="estimator.integrations.transformers"):
        Trainer(model, fitted, train_dataset=Tokens(2 * fitted.per_device_train_batch_size),
                callbacks=[callback]).train()
    assert callback.measured is not None and "measured" in caplog.text
    assert abs(callback.measured - callback.predicted) <= 0.11 * callback.measured
