"""The drop-ins' answers, timed against the real steps and trial searches they replace, on this machine's CPU.

Prints, per framework: the wall time of the drop-in's whole answer on an A100-80GB (every simulation and
replay of the planner's search), the wall time of one real CPU training step of the same model at batch 32
(fp32; the median of three after a warm-up; for Lightning and the Trainer a ``fit``/``train`` of one step,
their set-up included), and their ratio; for Lightning also ``BatchSizeFinder``'s
trial search on the CPU Trainer (power mode from 2, capped at the dataset's 256 samples: it has no card to
find a limit on, and runs 3 real steps per trial), as a ratio to the drop-in.

    KERAS_BACKEND=torch python bench/dropins_speed.py
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
warnings.simplefilter("ignore")


def _median(fn, runs: int = 3) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed(fn) -> tuple[object, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def lightning() -> None:
    import lightning as L
    from lightning.pytorch.callbacks import BatchSizeFinder
    from test_integrations_lightning import Images, TwoHeads

    from estimator.integrations.lightning import estimate_lightning

    def trainer(callback, steps: int = 1):
        return L.Trainer(accelerator="cpu", max_steps=steps, callbacks=[callback] if callback else [], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)

    module, data = TwoHeads(), Images(batch_size=32, samples=256)
    data.setup()
    batch = next(iter(data.train_dataloader()))
    fit, answer = _timed(lambda: estimate_lightning(module, batch, batch_size=32, gpu="A100-80GB"))
    step = _median(lambda: trainer(None).fit(TwoHeads(), Images(batch_size=32, samples=32)))
    finder = BatchSizeFinder(mode="power", init_val=2, max_val=256)
    _, search = _timed(lambda: trainer(finder, steps=2).fit(TwoHeads(), Images(batch_size=2, samples=256)))
    print(f"lightning: BatchSizeEstimator {answer:.2f} s (recommended {fit.batch_size}, max "
          f"{fit.result.max_batch_size}); Trainer.fit of one CPU step at 32, set-up included, {step:.2f} s: "
          f"{answer / step:.2f} of it; BatchSizeFinder's trials up to 256 on the CPU {search:.2f} s: "
          f"{search / answer:.0f}x the estimate")


def transformers() -> None:
    from test_integrations_transformers import Tokens, _args, _model, _sample
    from transformers import Trainer

    from estimator.integrations.transformers import estimate_trainer

    with tempfile.TemporaryDirectory() as out:
        args = _args(Path(out), bf16=False, max_steps=1, per_device_train_batch_size=32)
        fit, answer = _timed(lambda: estimate_trainer(args, _model(), _sample(False), gpu="A100-80GB"))
        step = _median(lambda: Trainer(_model(), args, train_dataset=Tokens(32)).train())
    print(f"transformers: fit_training_args {answer:.2f} s (recommended {fit.batch_size}); Trainer.train of one "
          f"CPU step at 32, set-up included, {step:.2f} s: {answer / step:.2f} of it")


def keras() -> None:
    from test_integrations_keras import DATA, convolutional

    from estimator.integrations.keras import estimate_keras

    x, y = DATA[convolutional]
    fit, answer = _timed(lambda: estimate_keras(convolutional(), x, y, gpu="A100-80GB"))
    model = convolutional()
    step = _median(lambda: model.train_on_batch(x[:32], y[:32]))
    print(f"keras: estimate_keras {answer:.2f} s (recommended {fit.batch_size}); one train_on_batch at 32 "
          f"{step:.3f} s: {answer / step:.1f} steps")


if __name__ == "__main__":
    torch.manual_seed(0)
    for bench in (lightning, transformers, keras):
        bench()
