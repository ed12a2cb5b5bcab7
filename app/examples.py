"""The API's examples (``/docs``, ``/redoc``, ``/openapi.json``): requests for each kind of job, and real answers.

>>> parse_request(REQUESTS["preset"]["value"]).model.preset          # doctest: +SKIP
'llama-3-8b'

The answers are what ``POST /estimate`` returned for the requests they name (batchfit 0.6.0, torch 2.14.1, on
this repository's catalog), trimmed: each card's curve to its first two points and its last, the assumptions to
the first three. tests/test_api_examples.py checks that every request parses, that the answers fit the response
schema, and (sim_slow) that the FSDP answer is still what the library answers.
"""

from __future__ import annotations

from typing import Any

RESNET50 = {
    "model": {"source": "torchvision", "name": "resnet50", "kwargs": {"num_classes": 10}},
    "input": {"image_size": [3, 224, 224]},
    "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw"}, "gradient_checkpointing": False,
                 "grad_accumulation_steps": 1},
    "gpus": ["A100-80GB", "H100-80GB"],
}
PRESET = {
    "model": {"source": "transformers", "preset": "llama-3-8b"},
    "input": {"seq_len": 2048},
    "training": {"precision": "bf16", "optimizer": {"name": "adamw"}, "gradient_checkpointing": True},
    "gpus": ["H200-141GB", "H100-80GB"],
    "planner": {"suggestions": False},
}
INLINE_CONFIG = {
    "model": {"source": "transformers", "task": "causal-lm", "config": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 4096}},
    "input": {"seq_len": 4096},
    "training": {"precision": "amp-bf16", "optimizer": {"name": "adamw", "fused": True}},
    "gpus": ["A100-40GB", "L40S-48GB"],
}
FSDP = {
    "model": {"source": "transformers", "preset": "llama-3-8b"},
    "input": {"seq_len": 2048},
    # FSDP2's mixed precision (param_dtype) computes in bf16 without autocast: training.precision stays fp32
    "training": {"precision": "fp32", "optimizer": {"name": "adamw"}, "gradient_checkpointing": True,
                 "distributed": {"strategy": "fsdp", "world_size": 8,
                                 "fsdp": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}},
    "gpus": ["H100-80GB", "A100-80GB"],
}
CUSTOM_CARD = {
    "model": {"source": "timm", "name": "vit_base_patch16_224"},
    "input": {"image_size": [3, 224, 224]},
    "training": {"precision": "amp-fp16", "optimizer": {"name": "sgd", "momentum": 0.9}},
    "gpus": [{"name": "lab-card-24g", "memory_bytes": 24 * 2**30, "compute_capability": "8.6",
              "context_bytes": 384 * 2**20}, "L4-24GB"],
}

# name -> an OpenAPI Example object (``openapi_examples`` of the request body)
REQUESTS: dict[str, dict[str, Any]] = {
    "resnet50": {"summary": "ResNet-50 on two cards", "value": RESNET50},
    "preset": {"summary": "A transformers preset: Llama 3 8B, seq 2048, pure bf16, AdamW, checkpointing",
               "description": "On an H100 a batch fits, but none within the headroom; planner.suggestions false "
                              "skips the search for changes that would make one fit (several full simulations). "
                              "Its answer is the response example `preset`.", "value": PRESET},
    "inline-config": {"summary": "An inline transformers config (a Llama-style model of 0.85 B parameters)",
                      "description": "model.config is a config.json; with model_type it stands alone, with a "
                                     "preset it overrides the preset's keys. Nothing is fetched from the Hub.",
                      "value": INLINE_CONFIG},
    "fsdp-8": {"summary": "FSDP over 8 ranks: Llama 3 8B, bf16 compute, fp32 reduce",
               "description": "The batch sizes answered are each rank's micro-batch. Its answer is the response "
                              "example `fsdp-8`.", "value": FSDP},
    "custom-card": {"summary": "A custom card beside a catalog one (timm ViT-B/16, fp16 autocast, SGD)",
                    "description": "A card not in the catalog (GET /gpus): its capacity as nvidia-smi reports it, "
                                   "its compute capability, optionally its CUDA context.", "value": CUSTOM_CARD},
}

FSDP_ANSWER = {
    "results": [
        {
            "gpu": "H100-80GB",
            "capacity_bytes": 85520809984,
            "min_batch_size": 1,
            "max_batch_size": 16,
            "recommended_batch_size": 13,
            "search": {"method": "affine-checked", "checked_batch": 17},
            "memory": {
                "batch_size": 16,
                "allocated_peak_bytes": 74883072000,
                "reserved_peak_bytes": 84685094912,
                "device_peak_bytes": 85230354432,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "max_memory": {
                "batch_size": 16,
                "allocated_peak_bytes": 74883072000,
                "reserved_peak_bytes": 84685094912,
                "device_peak_bytes": 85230354432,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "recommended_memory": {
                "batch_size": 13,
                "allocated_peak_bytes": 63589785600,
                "reserved_peak_bytes": 73205284864,
                "device_peak_bytes": 73750544384,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "curve": [
                {
                    "batch_size": 1,
                    "device_peak_bytes": 30937186304,
                    "step_seconds": 0.31092914153221435,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 2,
                    "device_peak_bytes": 31631343616,
                    "step_seconds": 0.6218582830644287,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 16,
                    "device_peak_bytes": 85230354432,
                    "step_seconds": 4.97486626451543,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
            ],
            "step_seconds": 4.042078839918787,
            "epoch_seconds": None,
            "meets_epoch_limit": None,
            "max_tokens_per_batch": 32768,
            "max_seq_len": None,
            "accumulation": None,
            "learning_rate": None,
            "batch_schedule": [],
            "world_size": 8,
            "global_batch_size": 104,
            "min_world_size": None,
            "recommended_world_size": None,
            "suggestions": [],
        },
        {
            "gpu": "A100-80GB",
            "capacity_bytes": 85899345920,
            "min_batch_size": 1,
            "max_batch_size": 16,
            "recommended_batch_size": 14,
            "search": {"method": "affine-checked", "checked_batch": 17},
            "memory": {
                "batch_size": 16,
                "allocated_peak_bytes": 74833002496,
                "reserved_peak_bytes": 85129691136,
                "device_peak_bytes": 85570093056,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "max_memory": {
                "batch_size": 16,
                "allocated_peak_bytes": 74833002496,
                "reserved_peak_bytes": 85129691136,
                "device_peak_bytes": 85570093056,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "recommended_memory": {
                "batch_size": 14,
                "allocated_peak_bytes": 67304144896,
                "reserved_peak_bytes": 76160172032,
                "device_peak_bytes": 76600573952,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "FSDPLlamaForCausalLM",
            },
            "curve": [
                {
                    "batch_size": 1,
                    "device_peak_bytes": 30790385664,
                    "step_seconds": 0.9856055159466667,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 2,
                    "device_peak_bytes": 31425822720,
                    "step_seconds": 1.9712110318933334,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 16,
                    "device_peak_bytes": 85570093056,
                    "step_seconds": 15.769688255146667,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
            ],
            "step_seconds": 13.798477223253334,
            "epoch_seconds": None,
            "meets_epoch_limit": None,
            "max_tokens_per_batch": 32768,
            "max_seq_len": None,
            "accumulation": None,
            "learning_rate": None,
            "batch_schedule": [],
            "world_size": 8,
            "global_batch_size": 112,
            "min_world_size": None,
            "recommended_world_size": None,
            "suggestions": [],
        },
    ],
    "breakdown": {
        "parameters": 6552709120,
        "gradients": 0,
        "optimizer_state": 8030261248,
        "activations": 26610926080,
        "temporaries": 33621541376,
        "inputs": 524288,
        "buffers": 1024,
        "workspace": 67108864,
        "communication": 0,
        "paged_optimizer_state": 0,
        "batch_size": 16,
    },
    "per_sample_bytes": 3764353901,
    "fixed_bytes": 14653409574,
    "parameter_count": 8030261248,
    "flops_per_sample": 123003568390144,
    "assumptions": [
        "attention: sdpa (transformers' default for LlamaForCausalLM)",
        (
            "NCCL's own buffers are not in the prediction: NCCL allocates them with cudaMalloc, outside PyTorch's "
            "caching allocator (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer; "
            "https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html#nccl-buffsize); keep "
            "planner.reserve_bytes above them"
        ),
        (
            "fsdp: fully_shard (FSDP2) on each of 32 blocks (transformers' decoder layers) and on the root, over 8 "
            "ranks; gathered parameters freed after each block's forward, gathered again in backward (the last "
            "block's kept, as torchtitan does); compute in bf16, gradients reduced in fp32 (MixedPrecisionPolicy, no "
            "autocast)"
        ),
    ],
    "warnings": [],
    "provenance": {
        "batchfit": "0.6.0",
        "torch": "2.14.1",
        "catalog": "2026-12-03",
        "seconds": 23.126,
        "simulations": 4,
    },
}

PRESET_ANSWER = {
    "results": [
        {
            "gpu": "H200-141GB",
            "capacity_bytes": 150754820096,
            "min_batch_size": 1,
            "max_batch_size": 23,
            "recommended_batch_size": 16,
            "search": {"method": "affine-checked", "checked_batch": 24},
            "memory": {
                "batch_size": 23,
                "allocated_peak_bytes": 134735136768,
                "reserved_peak_bytes": 146075025408,
                "device_peak_bytes": 146620284928,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "LlamaForCausalLM",
            },
            "max_memory": {
                "batch_size": 23,
                "allocated_peak_bytes": 134735136768,
                "reserved_peak_bytes": 146075025408,
                "device_peak_bytes": 146620284928,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "LlamaForCausalLM",
            },
            "recommended_memory": {
                "batch_size": 16,
                "allocated_peak_bytes": 108413495296,
                "reserved_peak_bytes": 123358674944,
                "device_peak_bytes": 123903934464,
                "fits": True,
                "peak_phase": "backward",
                "peak_module": "LlamaForCausalLM",
            },
            "curve": [
                {
                    "batch_size": 1,
                    "device_peak_bytes": 82237718528,
                    "step_seconds": 0.31092914153221435,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 2,
                    "device_peak_bytes": 83550535680,
                    "step_seconds": 0.6218582830644287,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 23,
                    "device_peak_bytes": 146620284928,
                    "step_seconds": 7.151370255240931,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
            ],
            "step_seconds": 4.97486626451543,
            "epoch_seconds": None,
            "meets_epoch_limit": None,
            "max_tokens_per_batch": 47104,
            "max_seq_len": None,
            "accumulation": None,
            "learning_rate": None,
            "batch_schedule": [],
            "world_size": 1,
            "global_batch_size": 16,
            "min_world_size": None,
            "recommended_world_size": None,
            "suggestions": [],
        },
        {
            "gpu": "H100-80GB",
            "capacity_bytes": 85520809984,
            "min_batch_size": 1,
            "max_batch_size": 6,
            "recommended_batch_size": None,
            "search": {"method": "affine-checked", "checked_batch": 24},
            "memory": {
                "batch_size": 6,
                "allocated_peak_bytes": 80369918976,
                "reserved_peak_bytes": 84523614208,
                "device_peak_bytes": 85068873728,
                "fits": True,
                "peak_phase": "optimizer",
                "peak_module": "",
            },
            "max_memory": {
                "batch_size": 6,
                "allocated_peak_bytes": 80369918976,
                "reserved_peak_bytes": 84523614208,
                "device_peak_bytes": 85068873728,
                "fits": True,
                "peak_phase": "optimizer",
                "peak_module": "",
            },
            "recommended_memory": None,
            "curve": [
                {
                    "batch_size": 1,
                    "device_peak_bytes": 82237718528,
                    "step_seconds": 0.31092914153221435,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 2,
                    "device_peak_bytes": 83550535680,
                    "step_seconds": 0.6218582830644287,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
                {
                    "batch_size": 6,
                    "device_peak_bytes": 85068873728,
                    "step_seconds": 1.8655748491932862,
                    "epoch_seconds": None,
                    "meets_epoch_limit": None,
                },
            ],
            "step_seconds": None,
            "epoch_seconds": None,
            "meets_epoch_limit": None,
            "max_tokens_per_batch": 12288,
            "max_seq_len": None,
            "accumulation": None,
            "learning_rate": None,
            "batch_schedule": [],
            "world_size": 1,
            "global_batch_size": None,
            "min_world_size": None,
            "recommended_world_size": None,
            "suggestions": [],
        },
    ],
    "breakdown": {
        "parameters": 16060522496,
        "gradients": 0,
        "optimizer_state": 32121044992,
        "activations": 38154740224,
        "temporaries": 48330965504,
        "inputs": 753664,
        "buffers": 1024,
        "workspace": 67108864,
        "communication": 0,
        "paged_optimizer_state": 0,
        "batch_size": 23,
    },
    "per_sample_bytes": 2588826136,
    "fixed_bytes": 75192135632,
    "parameter_count": 8030261248,
    "flops_per_sample": 123003568390144,
    "assumptions": [
        "attention: sdpa (transformers' default for LlamaForCausalLM)",
        "gradient checkpointing: transformers' per-layer checkpointing (non-reentrant)",
        "the 32 blocks of model.layers simulated at depths 1, 2, 3 and the step deepened to 32 (repeated blocks: the "
        "events a full simulation records)",
        "CUDA context on H200-141GB: 520 MiB (catalog default; driver dependent)",
    ],
    "warnings": [
        {
            "code": "no-recommendation",
            "message": (
                "H100-80GB: batch 1 fits but not within 90.0% of the usable memory (planner.headroom); no batch is "
                "recommended"
            ),
        },
    ],
    "provenance": {
        "batchfit": "0.6.0",
        "torch": "2.14.1",
        "catalog": "2026-12-03",
        "seconds": 15.236,
        "simulations": 4,
    },
}


# name -> an OpenAPI Example object (the 200 answer of POST /estimate)
RESPONSES: dict[str, dict[str, Any]] = {
    "fsdp-8": {"summary": "The answer to the request example fsdp-8 (trimmed)", "value": FSDP_ANSWER},
    "preset": {"summary": "The answer to the request example preset: no recommendation on the H100 (trimmed)",
               "value": PRESET_ANSWER},
}
ANSWERED = {"fsdp-8": FSDP, "preset": PRESET}  # the request each answer answers


def add_examples(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's OpenAPI document) with the examples: the requests on every route whose body is an
    ``EstimateRequest`` (or may be one), the answers on ``POST /estimate``'s 200. Added after FastAPI builds the
    document, which drops every null (an answer's ``"max_batch_size": null`` is what it says)."""
    request = {"$ref": "#/components/schemas/EstimateRequest"}
    for path in schema.get("paths", {}).values():
        body = path.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is not None and (body.get("schema") == request or request in body.get("schema", {}).get("oneOf", [])):
            body["examples"] = REQUESTS  # POST /estimate's body is one of a request and a request by profile
    ok = schema["paths"]["/estimate"]["post"]["responses"]["200"]["content"]["application/json"]
    ok["examples"] = RESPONSES
    return schema
