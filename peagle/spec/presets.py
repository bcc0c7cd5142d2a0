"""Named specs a user can start from (`{"preset": "demo"}`, `peagle train demo`): demo, tiny, two GPU runs.

Each preset is a plain dict validated by `parse_spec`, so a preset can never be an invalid spec.
"""

from __future__ import annotations

from typing import Any

from peagle.spec.schema import TrainSpec, parse_spec

__all__ = ["preset", "preset_names"]


def _demo() -> dict[str, Any]:
    # SmolLM2-135M on ShareGPT, sized to finish on a 2-core CPU in about 30 minutes (README benchmarks).
    # bf16 target: capture is 2.2x faster than fp32 on this CPU (avx512_bf16) and it is the dtype vLLM
    # serves; the draft trains in fp32. One pass over ~240 packed rows (640 conversations): fresh rows
    # beat repeated ones at this size, and online capture costs no disk.
    return {
        "name": "demo: SmolLM2-135M draft on ShareGPT (CPU)",
        "tags": ["demo"],
        "target": {"model": "builtin:smollm2-135m-instruct", "dtype": "bfloat16"},
        "data": {
            "sources": [{"path": "builtin:sharegpt", "max_samples": 640}],
            "max_length": 512,
            "eval_samples": 16,
        },
        "draft": {"num_layers": 1, "draft_vocab_size": 8192},
        "peagle": {"num_depths": 4, "down_sample_ratio": 0.7, "down_sample_ratio_min": 0.2},
        "optim": {
            "lr": 1e-3,
            "epochs": 1,
            "max_steps": 240,
            "pack_length": 1024,
            "schedule": "cosine",
            "warmup_ratio": 0.03,
        },
        "checkpoints": {"every_steps": 120, "keep_last": 2, "select_best_by": "tau_sim"},
        # serve_check: the export is loaded in vLLM with parallel drafting when a vLLM venv is there
        # (`make vllm-env`); without one the phase is skipped with a warning.
        # AL live: 2 prompts every 40 steps (about 10 s each on 2 cores), the 8 prompts after training.
        "eval": {"prompt_sets": [{"name": "humaneval", "num_prompts": 8}], "max_new_tokens": 64, "serve_check": True,
                 "al_every_steps": 40, "al_num_prompts": 2},
        "resources": {"gpus": 0, "device": "cpu"},
    }


def _tiny() -> dict[str, Any]:
    # A tiny random Llama target: seconds end to end; for tests and smoke checks of the service.
    return {
        "name": "tiny: random Llama target (smoke test)",
        "tags": ["tiny"],
        "target": {"model": "builtin:tiny-llama", "dtype": "float32"},
        "data": {"sources": [{"path": "builtin:sharegpt", "max_samples": 24}], "max_length": 128, "eval_samples": 4},
        "draft": {"num_layers": 1, "draft_vocab_size": 512},
        "peagle": {"num_depths": 3},
        "optim": {"lr": 1e-3, "epochs": 1, "max_steps": 12, "pack_length": 256},
        "checkpoints": {"every_steps": 4, "keep_last": 2, "select_best_by": "tau_sim"},
        "eval": {"prompt_sets": [{"name": "humaneval", "num_prompts": 2}], "max_new_tokens": 8},
        "resources": {"gpus": 0, "device": "cpu"},
    }


def _gpu_llama() -> dict[str, Any]:
    # A realistic GPU run: Llama-3.1-8B-Instruct target, K=8, 4 draft layers, Vd=32000.
    return {
        "name": "Llama-3.1-8B-Instruct P-EAGLE (1 GPU)",
        "tags": ["gpu"],
        "target": {"model": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "bfloat16"},
        "data": {
            "sources": [{"path": "builtin:sharegpt"}],
            "max_length": 4096,
            "eval_samples": 256,
            "regenerate": {"enabled": True, "max_new_tokens": 2048, "batch_size": 64},
        },
        "draft": {"num_layers": 4, "draft_vocab_size": 32000, "mask_token_id": 128002},
        "peagle": {"num_depths": 8, "sequence_partitions": 2, "gradient_checkpointing": True},
        "optim": {"lr": 6e-4, "epochs": 5, "pack_length": 8192, "schedule": "cosine", "warmup_ratio": 0.015},
        "checkpoints": {"every_steps": 2000, "keep_last": 3, "select_best_by": "acceptance_length"},
        "eval": {"prompt_sets": [{"name": "humaneval", "num_prompts": 80}], "max_new_tokens": 512},
        "resources": {"gpus": 1, "device": "cuda", "capture": "online"},
    }


def _gpu_qwen() -> dict[str, Any]:
    d = _gpu_llama()
    d["name"] = "Qwen3-8B P-EAGLE (1 GPU)"
    d["target"] = {"model": "Qwen/Qwen3-8B", "dtype": "bfloat16"}
    d["draft"] = {"num_layers": 4, "draft_vocab_size": 32000, "mask_token_id": 151669}
    return d


_PRESETS = {"demo": _demo, "tiny": _tiny, "gpu-llama3-8b": _gpu_llama, "gpu-qwen3-8b": _gpu_qwen}


def preset_names() -> list[str]:
    """Names accepted by `preset`."""
    return list(_PRESETS)


def preset(name: str) -> TrainSpec:
    """A validated preset spec (`demo`, `tiny`, `gpu-llama3-8b`, `gpu-qwen3-8b`)."""
    try:
        factory = _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(_PRESETS)}") from None
    return parse_spec(factory())
