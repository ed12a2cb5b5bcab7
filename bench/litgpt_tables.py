"""Predicted vs published: LitGPT's 2023 resource tables for Llama 2 7B fine-tuning on one A100-SXM4-40GB.

LitGPT (lit-gpt, 2023; ../shared/research/peft-notes.md): bf16-true, Alpaca, the longest sample 1304
tokens, ``torch.cuda.max_memory_allocated()``. Its defaults assumed here: LoRA r=8, alpha=16, dropout 0.05
on the query and value projections only (``lora_query``, ``lora_value``), AdamW (torch's, on the adapters,
in bf16 as the model is), no activation checkpointing; QLoRA ``bnb.nf4`` quantizes every linear layer,
the head too (``skip_modules: []``), without peft's ``prepare_model_for_kbit_training`` (LitGPT keeps its
norms in bf16). batchfit runs transformers' LlamaForCausalLM (the ``llama-2-7b`` preset) with peft and
bitsandbytes 0.50.2, not LitGPT's own model code.

``--bnb-2023`` also runs QLoRA with ``MatMul4Bit`` saving its input for backward, as bitsandbytes did until
0.43.2 (LitGPT's 0.41 in 2023: ``ctx.tensors = (A, B)``); bitsandbytes-foundation/bitsandbytes 9e753741
(PR #1270, 2024-07-16, "fix QLoRA mem bug: delete useless buffered activation") keeps ``(None, B)``: a
frozen weight's gradient is never asked for, so the layer input is not needed. 0.50.2, which batchfit runs,
has the fix. Prints one line per case: predicted / published.

    .venv/bin/python bench/litgpt_tables.py [--bnb-2023]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

GB = 1e9
SEQ = 1304
LORA = {"method": "lora", "r": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
NF4 = {"method": "bnb-4bit", "quant_type": "nf4", "double_quant": False, "compute_dtype": "bf16",
       "skip_modules": [], "prepare_for_kbit_training": False}
# (name, micro-batch, quantization, published max_memory_allocated in GB; None: OOM on the 40 GB card)
CASES: list[tuple[str, int, dict[str, Any] | None, float | None]] = [
    ("LoRA mb1", 1, None, 21.30),
    ("LoRA mb2", 2, None, 29.07),
    ("QLoRA nf4 mb1", 1, NF4, 14.14),
    ("LoRA mb4", 4, None, None),
]


def request(batch: int, quantization: dict[str, Any] | None) -> dict[str, Any]:
    model: dict[str, Any] = {"source": "transformers", "preset": "llama-2-7b", "peft": LORA}
    if quantization is not None:
        model["quantization"] = {**quantization}
    return {"model": model, "input": {"seq_len": SEQ},
            "training": {"precision": "bf16", "optimizer": {"name": "adamw", "weight_decay": 0.01}},
            "gpus": ["A100-40GB"], "batch_size": batch,
            "planner": {"confirm": "none", "curve_points": 0, "suggestions": False}}


def save_inputs_as_2023() -> None:
    """bitsandbytes 0.41's MatMul4Bit: the layer input kept for backward beside the packed weight."""
    from bitsandbytes.autograd._functions import MatMul4Bit

    forward = MatMul4Bit.forward

    def kept(ctx: Any, A: Any, B: Any, out: Any = None, bias: Any = None, quant_state: Any = None) -> Any:
        output = forward(ctx, A, B, out, bias, quant_state)
        if getattr(ctx, "tensors", (None, None))[1] is not None:
            ctx.tensors = (A, ctx.tensors[1])
        return output

    MatMul4Bit.forward = staticmethod(kept)  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bnb-2023", action="store_true", help="also QLoRA with MatMul4Bit saving its input")
    args = parser.parse_args()
    from estimator.pipeline import estimate
    from estimator.request.parse import parse_request

    def run(name: str, batch: int, quant: dict[str, Any] | None, published: float | None) -> None:
        t0 = time.perf_counter()
        memory = estimate(parse_request(request(batch, quant))).results[0].memory
        got = memory.allocated_peak_bytes / GB
        if published is None:
            verdict = f"published OOM on 40 GB; predicted fits={memory.fits}"
        else:
            verdict = f"published {published:.2f} GB, ratio {got / published:.3f} ({(got / published - 1):+.1%})"
        print(f"{name:22s} predicted allocated {got:6.2f} GB  {verdict}  [{time.perf_counter() - t0:.0f} s]",
              flush=True)

    for case in CASES:
        run(*case)
    if args.bnb_2023:
        save_inputs_as_2023()
        name, batch, quant, published = CASES[2]
        run(name + " (bnb 0.41)", batch, quant, published)


if __name__ == "__main__":
    main()
