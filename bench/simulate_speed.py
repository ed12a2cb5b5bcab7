"""Wall time of one full simulation (2 iterations) and the simulator's peak RSS.

Cases: resnet50 b64 224px fp32 AdamW on A100-80GB; bert-large b4 s512 fp32;
a 32-layer 7B LLaMA-style config b1 s4096 bf16 on H100-80GB; llama-3-8b b2
s8192 with selective checkpointing, on one H100-80GB (amp-bf16) and as one rank
of FSDP over 8 (param_dtype bf16, reduce_dtype fp32), whose time should be
about the single GPU's (one rank is simulated). Each is timed in a warm process
(after one small simulation), as a service worker runs it.
"""

from __future__ import annotations

import resource
import time

import torch
import torch.nn.functional as F

from estimator.pipeline import estimate_memory
from estimator.simulate.recipe import Recipe


def resnet50():
    import torchvision

    return torchvision.models.resnet50()


def images(b, d):
    return torch.empty(b, 3, 224, 224, device=d), torch.zeros(b, dtype=torch.long, device=d)


def llama7b():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def tokens(seq):
    def make(b, d):
        ids = torch.zeros(b, seq, dtype=torch.long, device=d)
        return {"input_ids": ids}, ids
    return make


def lm_loss(out, labels):
    return F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten())


def preset(name: str, seq_len: int, training: dict):
    """A transformers preset through the request path: (factory, batches, loss, recipe)."""
    from estimator.models import build
    from estimator.request.adapt import job_of
    from estimator.request.parse import parse_request

    job = job_of(parse_request({"model": {"source": "transformers", "preset": name},
                                "input": {"seq_len": seq_len}, "training": training}))
    b = build(job.model, job.input)
    return b.factory, b.batch_factory, b.loss_fn, job.recipe


def main() -> None:
    bert = preset("bert-large-uncased", 512, {})
    cases = [
        ("resnet50 b64", resnet50, images, F.cross_entropy, 64, Recipe(), "A100-80GB", 2.0),
        ("bert-large b4 s512", *bert[:3], 4, bert[3], "A100-80GB", 5.0),
        ("llama-7b b1 s4096 bf16", llama7b, tokens(4096), lm_loss, 1, Recipe(precision="bf16"), "H100-80GB", 20.0),
    ]
    one = preset("llama-3-8b", 8192, {"gradient_checkpointing": "selective", "precision": "amp-bf16"})
    fsdp = preset("llama-3-8b", 8192, {"gradient_checkpointing": "selective", "distributed": {
        "strategy": "fsdp", "world_size": 8, "fsdp": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}})
    cases += [
        ("llama-3-8b b2 s8192 sac", *one[:3], 2, one[3], "H100-80GB", 20.0),
        ("  fsdp 8, one rank", *fsdp[:3], 2, fsdp[3], "H100-80GB", 20.0),
    ]
    # The first simulation in a process pays for imports and torch's one-time
    # kernel registration; service workers pay it once, at startup.
    t0 = time.perf_counter()
    estimate_memory(resnet50, images, F.cross_entropy, 1, recipe=Recipe(), gpu="A100-80GB")
    print(f"{'first simulation (cold)':<24} {time.perf_counter() - t0:6.2f} s (resnet50 b1; one-time per process)")
    for name, mf, bf, lf, bs, recipe, gpu, aim in cases:
        t0 = time.perf_counter()
        r = estimate_memory(mf, bf, lf, bs, recipe=recipe, gpu=gpu)
        dt = time.perf_counter() - t0
        print(f"{name:<24} {dt:6.2f} s (aim {aim:.0f} s, ratio {dt / aim:.2f})  "
              f"device peak {r.device_peak_bytes / 2**30:.2f} GiB on {gpu}, events {len(r.trace.events)}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"peak RSS {rss / 2**30:.2f} GiB (aim 2 GiB)")


if __name__ == "__main__":
    main()
