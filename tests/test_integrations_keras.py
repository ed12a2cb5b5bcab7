"""Keras 3 on the torch backend: a compiled model's train_step simulated as the torch ops Keras runs, on a card
and against Keras's own ``train_on_batch`` on the CPU (torch.profiler)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # before keras is imported, as the integration requires

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

keras = pytest.importorskip("keras")

from estimator.errors import SpecError  # noqa: E402
from estimator.integrations.keras import estimate_keras  # noqa: E402
from estimator.measure.cpu import cpu_peak_of  # noqa: E402
from estimator.trace import Category  # noqa: E402

pytestmark = pytest.mark.sim
REPO = Path(__file__).resolve().parents[1]
BATCH = 8


def convolutional() -> keras.Model:
    """Two convolutions with batch norm, pooling and dropout, a 10-way head: Adam, accuracy as a metric."""
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.BatchNormalization()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dropout(0.2)(x)
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def encoder(seq: int = 64, vocab: int = 1000, dim: int = 64, heads: int = 4) -> keras.Model:
    """One Transformer encoder block (multi-head self-attention, layer norms, a GELU feed-forward): AdamW."""
    inputs = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, dim)(inputs)
    x = keras.layers.LayerNormalization()(x + keras.layers.MultiHeadAttention(heads, dim // heads)(x, x))
    f = keras.layers.Dense(dim)(keras.layers.Dense(4 * dim, activation="gelu")(x))
    x = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization()(x + f))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer=keras.optimizers.AdamW(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


_rng = np.random.default_rng(0)
DATA = {convolutional: (_rng.random((64, 32, 32, 3), dtype=np.float32), _rng.integers(0, 10, 64)),
        encoder: (_rng.integers(0, 1000, (64, 64)).astype(np.int32), _rng.integers(0, 2, 64))}
MODELS = [pytest.param(convolutional, id="convolutional"), pytest.param(encoder, id="encoder")]


@pytest.mark.parametrize("make", MODELS)
def test_the_model_simulates_on_a_t4(make) -> None:
    model = make()
    kernel = model.trainable_weights[0].value.detach().clone()
    x, y = DATA[make]
    fit = estimate_keras(model, x, y, gpu="T4-16GB")
    result = fit.result
    assert result.gpu == "T4-16GB" and result.max_batch_size >= result.recommended_batch_size == fit.batch_size > 1
    assert result.max_memory.fits and fit.report.device_peak_bytes <= result.capacity_bytes
    assert any("Keras's train_step on the torch backend" in line for line in fit.response.assumptions)
    # the caller's model untouched: its weights, their device, its optimizer (never built)
    assert torch.equal(model.trainable_weights[0].value.detach(), kernel)
    assert model.trainable_weights[0].value.device.type == "cpu" and not model.optimizer.built


@pytest.mark.parametrize("make", MODELS)
def test_the_cpu_prediction_matches_kerass_own_step(make) -> None:
    """The CPU target at batch 8 against ``train_on_batch`` twice on a fresh model (its variables and the
    batch made inside the measured region, as the simulation makes them), measured by torch.profiler."""
    x, y = DATA[make]
    predicted = estimate_keras(make(), x, y, batch_size=BATCH).report.allocated_peak_bytes

    def train() -> None:
        model = make()
        xb, yb = torch.as_tensor(x[:BATCH]).clone(), torch.as_tensor(y[:BATCH]).clone()
        model.train_on_batch(xb, yb)
        model.train_on_batch(xb, yb)

    measured = cpu_peak_of(train)
    assert measured > 0
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def test_kerass_optimizer_state_is_simulated() -> None:
    model = convolutional()
    x, y = DATA[convolutional]
    report = estimate_keras(model, x, y, batch_size=BATCH).report
    trainable = sum(int(np.prod(v.shape)) for v in model.trainable_weights)
    states = sum(a.nbytes for a in report.trace.allocations if a.category == Category.OPTIMIZER_STATE)
    # Adam's momentum and velocity, fp32, per trainable value (and its scalar counters besides)
    assert 2 * 4 * trainable <= states <= 2 * 4 * trainable + 1024


def test_a_model_that_cannot_be_simulated_is_refused() -> None:
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(SpecError) as info:
        estimate_keras(plain, np.zeros((4, 4), np.float32), np.zeros(4), gpu="T4-16GB")
    assert info.value.field == "model"
    plain.compile(optimizer="adam", loss="mse", jit_compile=True)
    with pytest.raises(SpecError) as info:
        estimate_keras(plain, np.zeros((4, 4), np.float32), np.zeros((4, 2)), gpu="T4-16GB")
    assert info.value.field == "jit_compile"


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_another_backend_is_refused_by_name(backend: str) -> None:
    code = ("import estimator.errors as e\ntry:\n    import estimator.integrations.keras\n"
            "except e.SpecError as exc:\n    print(exc.field, exc.value)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env={**os.environ, "KERAS_BACKEND": backend})
    assert out.stdout.split() == ["KERAS_BACKEND", backend], out.stderr[-2000:]
