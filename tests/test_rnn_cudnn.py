"""cuDNN RNNs on the GPU target (estimator/simulate/virtual_gpu/cudnn_rnn.py, docs/DESIGN.md fact 20)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from estimator.pipeline import estimate_memory
from estimator.simulate.recipe import Recipe
from estimator.simulate.virtual_gpu.cudnn_rnn import (
    DROPOUT_STATE_BYTES,
    GRU,
    LSTM,
    Geometry,
    reserve_bytes,
    workspace_bytes,
)
from estimator.testing.zoo import ZOO

pytestmark = pytest.mark.sim

T, B, IN, H, L = 16, 8, 32, 64, 2  # the hand-derived LSTM: seq 16, batch 8, input 32, hidden 64, 2 layers, fp32
F32 = 4

# Weight buffer (cuDNN's weight space, RNN.cpp get_num_weights; both bias vectors per layer):
#   layer 0: w_ih 4H x IN + w_hh 4H x H + b_ih 4H + b_hh 4H = 8,192 + 16,384 + 512 = 25,088
#   layer 1: w_ih 4H x H + w_hh 4H x H + 2 x 4H             = 16,384 + 16,384 + 512 = 33,280
WEIGHT_BUF = (25_088 + 33_280) * F32  # = 233,472 B
OUTPUT = T * B * H * F32  # _output_size: (T, B, D x H) = 32,768 B
HY = CY = L * B * H * F32  # _hidden_size / _cell_size: (L x D, B, H) = 4,096 B
# reserve (policy): per token (T x B = 128) each layer keeps LSTM's 4 gates + the cell (5 x H), and layer 0 its
# output for layer 1 (H): 128 x (2 x 5 x 64 + 64) x 4 B
RESERVE = T * B * (L * 5 * H + (L - 1) * H) * F32  # = 360,448 B
# workspace (policy): one layer's gate pre-activations over the sequence: 128 tokens x 4H x 4 B
WORKSPACE = T * B * 4 * H * F32  # = 131,072 B
DX = T * B * IN * F32  # _cudnn_rnn_backward_input: empty_like(input) = 16,384 B
X_COPY = DX  # batch_first: input.transpose(0, 1).contiguous()


class HandLSTM(nn.Module):
    def __init__(self, batch_first: bool = False, **kwargs) -> None:
        super().__init__()
        self.rnn = nn.LSTM(IN, H, num_layers=L, batch_first=batch_first, **kwargs)

    def forward(self, x):
        return self.rnn(x)[0]


def _hand(batch_first: bool = False, recipe: Recipe | None = None, **kwargs):
    def batch(b, device):
        shape = (b, T, IN) if batch_first else (T, b, IN)
        return torch.empty(*shape, device=device), torch.zeros(1, device=device)

    return estimate_memory(lambda: HandLSTM(batch_first, **kwargs), batch, lambda out, t: out.square().mean(), B,
                           recipe=recipe or Recipe(), gpu="A100-80GB")


def _by_op(report, phase: str, iteration: int = 1, needle: str = "rnn") -> list[tuple[str, str, int]]:
    return [(a.op, a.category, a.nbytes) for a in report.trace.allocations
            if a.phase == phase and a.iteration == iteration and needle in a.op]


def test_hand_derived_lstm_bytes() -> None:
    assert (WEIGHT_BUF, OUTPUT, HY, RESERVE, WORKSPACE, DX) == (233_472, 32_768, 4_096, 360_448, 131_072, 16_384)
    report = _hand()
    allocs = report.trace.allocations
    # flatten_parameters at materialize: one zeroed buffer of the weight space holds every weight
    assert [(a.op, a.nbytes) for a in allocs if a.category == "parameter"] == [("zeros", WEIGHT_BUF)]
    assert sum(1 for a in allocs if a.phase == "setup" and a.op == "empty_strided") == 8  # the old storages
    assert _by_op(report, "forward") == [
        ("_cudnn_rnn", "activation", OUTPUT),
        ("_cudnn_rnn", "temporary", HY),
        ("_cudnn_rnn", "temporary", CY),
        ("_cudnn_rnn", "activation", RESERVE),  # kept for the backward
        ("cudnn_rnn_workspace[_cudnn_rnn]", "temporary", WORKSPACE),
    ]
    assert _by_op(report, "backward") == [
        ("_cudnn_rnn_backward", "temporary", DX),  # computed even though x needs no grad
        ("_cudnn_rnn_backward", "temporary", HY),  # dhx
        ("_cudnn_rnn_backward", "temporary", CY),  # dcx
        ("_cudnn_rnn_backward", "gradient", WEIGHT_BUF),  # dw: every weight's grad is a view of it
        ("zeros_grad_hy[_cudnn_rnn_backward]", "temporary", HY),  # hy and cy are unused: zeros_like
        ("zeros_grad_cy[_cudnn_rnn_backward]", "temporary", CY),
        ("cudnn_rnn_workspace[_cudnn_rnn_backward]", "temporary", WORKSPACE),  # backward data
        ("cudnn_rnn_workspace[_cudnn_rnn_backward]", "temporary", WORKSPACE),  # backward weights
    ]
    assert [a.nbytes for a in allocs if a.category == "gradient" and a.iteration == 1] == [WEIGHT_BUF]
    assert any(line.startswith("cuDNN RNNs:") for line in report.assumptions)
    # the workspace is transient: nothing is allocated before its free (a burst of frees is kept in
    # allocation order, so other frees may come first)
    events = report.trace.events
    for i, (alloc, k) in enumerate(events):
        if alloc and allocs[k].op.startswith("cudnn_rnn_workspace"):
            j = events.index((False, k), i)
            assert not any(a for a, _ in events[i + 1:j])


def test_batch_first_copies_the_input_and_the_output_grad() -> None:
    ops = _by_op(_hand(batch_first=True), "forward")
    assert ops[-2:] == [("x_contiguous[_cudnn_rnn]", "temporary", X_COPY),
                        ("cudnn_rnn_workspace[_cudnn_rnn]", "temporary", WORKSPACE)]
    inside = [(op, n) for op, _, n in _by_op(_hand(batch_first=True), "backward") if "[" in op]
    assert inside == [
        ("zeros_grad_hy[_cudnn_rnn_backward]", HY), ("zeros_grad_cy[_cudnn_rnn_backward]", CY),
        ("x_contiguous[_cudnn_rnn_backward]", X_COPY), ("dy_contiguous[_cudnn_rnn_backward]", OUTPUT),
        ("cudnn_rnn_workspace[_cudnn_rnn_backward]", WORKSPACE),
        ("x_contiguous[_cudnn_rnn_backward]", X_COPY), ("cudnn_rnn_workspace[_cudnn_rnn_backward]", WORKSPACE),
    ]


def test_dropout_state_once_and_masks_in_the_reserve() -> None:
    report = _hand(dropout=0.5)
    states = [a for a in report.trace.allocations if a.op == "_cudnn_init_dropout_state"]
    assert [(a.iteration, a.category, a.nbytes) for a in states] == [(0, "buffer", DROPOUT_STATE_BYTES)]
    # one byte per element of the mask between the two layers: 128 tokens x 64
    assert ("_cudnn_rnn", "activation", RESERVE + T * B * H) in _by_op(report, "forward")


def test_autocast_copies_the_weights_into_an_fp16_buffer_every_call() -> None:
    report = _hand(recipe=Recipe(precision="amp-bf16"))
    forward = _by_op(report, "forward", needle="")
    # AutocastRNN.cpp: a new fp16 flat buffer of the weight space (fp16 even under bf16 autocast)
    assert ("zeros", "activation", WEIGHT_BUF // 2) in forward
    rnn = [n for op, _, n in forward if op == "_cudnn_rnn"]
    assert rnn == [OUTPUT // 2, HY // 2, CY // 2, RESERVE]  # fp16 outputs; the reserve in the fp32 math type


def test_cudnn_disabled_runs_the_native_path() -> None:
    with torch.backends.cudnn.flags(enabled=False):
        report = _hand()
    ops = {a.op for a in report.trace.allocations}
    assert "_thnn_fused_lstm_cell" in ops and not any("cudnn" in op for op in ops)
    assert not any(line.startswith("cuDNN RNNs:") for line in report.assumptions)
    assert all(a.nbytes != WEIGHT_BUF for a in report.trace.allocations if a.category == "parameter")


def _rnn_model(cls, **kwargs):
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = cls(16, 32, batch_first=True, **kwargs)
            self.head = nn.Linear(32 * (2 if kwargs.get("bidirectional") else 1), 5)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])

    def batch(b, device):
        return torch.empty(b, 10, 16, device=device), torch.zeros(b, dtype=torch.long, device=device)

    return Model, batch, F.cross_entropy


CASES = {
    "zoo lstm": ZOO["lstm"],
    "gru": _rnn_model(nn.GRU, num_layers=2),
    "rnn tanh": _rnn_model(nn.RNN),
    "rnn relu bidirectional": _rnn_model(nn.RNN, nonlinearity="relu", bidirectional=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("cudnn", [True, False])
def test_rnns_simulate_on_a_gpu_card(name: str, cudnn: bool) -> None:
    mf, bf, lf = CASES[name]
    with torch.backends.cudnn.flags(enabled=cudnn):
        report = estimate_memory(mf, bf, lf, 4, recipe=Recipe(optimizer="adamw"), gpu="A100-80GB")
    assert report.allocated_peak_bytes > 0
    ran = {a.op for a in report.trace.allocations}
    assert ("_cudnn_rnn_backward" in ran) == cudnn
    assert any(line.startswith("cuDNN RNNs:") for line in report.assumptions) == cudnn
    assert report.trace.flops > 0


def test_policy_reproduces_cudnns_reported_reserves() -> None:
    """pytorch/pytorch#2895, P100, fp32: 4 layers, hidden 320, input 123 (from the parameter counts), on 25,000
    tokens (inferred: the script is not quoted): cuDNN reported 736,000,000 B (LSTM) and 864,000,000 B (GRU)."""
    assert reserve_bytes(Geometry(LSTM, 123, 320, 0, 4, False), 25_000, torch.float32, 0.0) == 736_000_000
    assert reserve_bytes(Geometry(GRU, 123, 320, 0, 4, False), 25_000, torch.float32, 0.0) == 864_000_000
    # the workspace bound is above what cuDNN reported for that LSTM (17,730,560 B)
    assert workspace_bytes(Geometry(LSTM, 123, 320, 0, 4, False), 25_000, torch.float32) >= 17_730_560
    # parameters: 4 x gates x (320 x (123 + 320) + 2 x 320) for layer 0 ... as the counts
    assert Geometry(LSTM, 123, 320, 0, 4, False).num_weights() + 320 * 10 + 10 == 3_038_090
