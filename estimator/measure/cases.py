"""The GPU accuracy suite's cases (bench/gpu_accuracy.py runs them; tests/test_validate.py checks their coverage).

Each case is (name, batch, request JSON without ``gpus``): the request runs
on the measuring machine's own card.
"""

from __future__ import annotations

from typing import Any

LLAMA_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048, "architectures": ["LlamaForCausalLM"]}


def _case(name: str, model: dict[str, Any], batch: int, precision: str = "fp32", *, optimizer: str = "adamw",
          checkpointing: bool = False, training: dict[str, Any] | None = None,
          **inp: Any) -> tuple[str, int, dict[str, Any]]:
    return name, batch, {"model": model, "input": inp, "training": {
        "precision": precision, "optimizer": {"name": optimizer}, "gradient_checkpointing": checkpointing,
        **(training or {})}, "planner": {"confirm": "none", "curve_points": 0}}


def _fine_tuned(model: dict[str, Any], r: int = 16, quantization: str | None = None) -> dict[str, Any]:
    """``model`` with LoRA r on every linear layer (peft), and its base quantized by bitsandbytes when asked."""
    out = {**model, "peft": {"method": "lora", "r": r, "alpha": 2 * r, "dropout": 0.05, "target_modules": "all-linear"}}
    return out if quantization is None else {**out, "quantization": {"method": quantization}}


def TV(name: str) -> dict[str, Any]:
    return {"source": "torchvision", "name": name}


def HF(preset: str, **kwargs: Any) -> dict[str, Any]:
    return {"source": "transformers", "preset": preset, **kwargs}

CASES = [
    _case("resnet50 fp32 sgd", TV("resnet50"), 128, optimizer="sgd"),
    _case("resnet50 amp-bf16 adamw", TV("resnet50"), 256, "amp-bf16"),
    _case("resnet50 amp-fp16 adamw", TV("resnet50"), 256, "amp-fp16"),
    _case("resnet50 bf16 adamw", TV("resnet50"), 256, "bf16"),
    # the cuDNN workspace bound (im2col) and the benchmark search: unmeasured so far
    _case("resnet50 amp-bf16 cudnn.benchmark", TV("resnet50"), 256, "amp-bf16", training={"cudnn_benchmark": True}),
    _case("vit_b_16 amp-bf16", TV("vit_b_16"), 128, "amp-bf16"),
    _case("vit_b_16 fp32 ckpt", TV("vit_b_16"), 64, checkpointing=True),
    _case("vit_l_16 amp-bf16", TV("vit_l_16"), 32, "amp-bf16"),
    # rasbt/pytorch-memory-optim's loop (tests/test_published.py): zero_grad between the loss and backward
    _case("vit_l_16 fp32 adam zero_grad after-forward", TV("vit_l_16"), 64, optimizer="adam",
          training={"zero_grad_at": "after-forward"}),
    _case("convnext_tiny amp-bf16", TV("convnext_tiny"), 128, "amp-bf16"),
    _case("convnext_base fp32 sgd", TV("convnext_base"), 32, optimizer="sgd"),
    _case("efficientnet_b0 amp-fp16", TV("efficientnet_b0"), 128, "amp-fp16"),
    _case("efficientnet_b3 fp32", TV("efficientnet_b3"), 32),
    _case("bert-base amp-bf16", HF("bert-base-uncased"), 32, "amp-bf16", seq_len=512),
    _case("bert-base fp32 sgd", HF("bert-base-uncased"), 16, optimizer="sgd", seq_len=512),
    _case("bert-large amp-fp16", HF("bert-large-uncased"), 16, "amp-fp16", seq_len=512),
    _case("bert-large fp32 ckpt", HF("bert-large-uncased"), 16, checkpointing=True, seq_len=512),
    _case("gpt2 amp-bf16", HF("gpt2"), 16, "amp-bf16", seq_len=1024),
    _case("gpt2 bf16", HF("gpt2"), 16, "bf16", seq_len=1024),
    _case("gpt2 eager fp32", HF("gpt2", attn_implementation="eager"), 8, seq_len=1024),
    _case("gpt2-medium amp-bf16", HF("gpt2-medium"), 8, "amp-bf16", seq_len=1024),
    _case("gpt2-medium amp-bf16 ckpt", HF("gpt2-medium"), 16, "amp-bf16", checkpointing=True, seq_len=1024),
    _case("llama-1b amp-bf16", {"source": "transformers", "config": LLAMA_1B, "task": "causal-lm"}, 4,
          "amp-bf16", seq_len=2048),
    _case("llama-1b bf16 ckpt", {"source": "transformers", "config": LLAMA_1B, "task": "causal-lm"}, 8,
          "bf16", checkpointing=True, seq_len=2048),
    # parameter-efficient and quantized fine-tuning (peft and bitsandbytes): unmeasured so far
    _case("tinyllama lora amp-bf16", _fine_tuned(HF("tinyllama-1.1b")), 8, "amp-bf16", seq_len=2048),
    _case("tinyllama qlora amp-bf16 ckpt", _fine_tuned(HF("tinyllama-1.1b"), quantization="bnb-4bit"), 8,
          "amp-bf16", checkpointing=True, seq_len=2048),
    _case("tinyllama qlora paged_adamw8bit", _fine_tuned(HF("tinyllama-1.1b"), quantization="bnb-4bit"), 4,
          "amp-bf16", optimizer="paged_adamw8bit", seq_len=1024),
    _case("tinyllama llm.int8 lora amp-fp16", _fine_tuned(HF("tinyllama-1.1b"), quantization="bnb-8bit"), 4,
          "amp-fp16", seq_len=1024),
    _case("llama-2-7b qlora bf16 ckpt", _fine_tuned(HF("llama-2-7b"), r=8, quantization="bnb-4bit"), 1, "bf16",
          checkpointing=True, seq_len=1304),
    _case("gpt2 adamw8bit amp-bf16", HF("gpt2"), 16, "amp-bf16", optimizer="adamw8bit", seq_len=1024),
]
MAX_BATCH_CASES = ["resnet50 amp-bf16 adamw", "vit_b_16 amp-bf16", "bert-base amp-bf16", "gpt2 amp-bf16",
                   "llama-1b bf16 ckpt"]
