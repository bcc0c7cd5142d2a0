"""Serve-check probe: runs INSIDE the vLLM venv (`.vllm-venv/bin/python peagle/eval/vllm_probe.py ...`).

It imports only the standard library, vLLM and what vLLM itself ships (torch, safetensors); never
`peagle` (the project venv and vLLM's pin different transformers). `peagle.eval.serve_check` writes the
prompts (token ids, already chat-templated, so both decoders see identical inputs), starts this script
as a subprocess and reads the JSON it writes.

What it does:
1. `LLM(model=<export dir>)`: vLLM reads the speculators config, takes the verifier from it, and (for
   `speculators_model_type: "peagle"`) turns on parallel drafting with K = `speculative_tokens`
   (or `--num-speculative-tokens`).
2. Verifies parallel drafting is really on: the engine's speculative config has `method == "eagle3"`
   and `parallel_drafting is True`, and the drafter's `mask_hidden` buffer equals the exported tensor
   (not the plain-EAGLE fallback, which skips `mask_hidden`).
3. Generates greedily from the prompts and reads vLLM's spec-decode counters (`llm.get_metrics()`):
   AL = 1 + accepted / drafts, per-position rate_k = accepted_at_k / drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def _parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="export directory (speculators format)")
    p.add_argument("--prompts", required=True, help='JSON file: [{"prompt_token_ids": [...]}, ...]')
    p.add_argument("--out", required=True, help="where to write the JSON result")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    return p.parse_args(argv)


def _mask_hidden_of(worker: Any) -> Any:
    """Runs in the engine's worker: the drafter's `mask_hidden` buffer (or None when absent)."""
    runner = getattr(worker, "model_runner", worker)
    drafter = getattr(runner, "drafter", None)
    model = getattr(drafter, "model", None)
    buf = getattr(model, "mask_hidden", None)
    if buf is None:
        return None
    return buf.detach().float().cpu().flatten().tolist()


def _spec_counters(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "per_pos": []}
    for m in metrics:
        name = m.name.removeprefix("vllm:")
        if name == "spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            acc = out["per_pos"]
            out["per_pos"] = [a + b for a, b in zip(acc + [0] * (len(vals) - len(acc)), vals, strict=False)]
        elif name in (
            "spec_decode_num_drafts",
            "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens",
        ):
            out[name.removeprefix("spec_decode_")] += int(m.value)
    return out


def main(argv: list[str]) -> int:
    args = _parse_args(argv)
    # In-process engine: the probe inspects the drafter module directly (mask_hidden really loaded).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm import __version__ as vllm_version
    from vllm.inputs import TokensPrompt

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    spec_override: dict[str, Any] = {}
    if args.num_speculative_tokens is not None:
        spec_override["num_speculative_tokens"] = args.num_speculative_tokens
    t0 = time.time()
    kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": "bfloat16",
        "enforce_eager": True,
        "max_model_len": args.max_model_len,
        "seed": 0,
        "disable_log_stats": False,
    }
    if spec_override:
        kwargs["speculative_config"] = spec_override
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = 0.5
    llm = LLM(**kwargs)
    load_s = time.time() - t0

    sc = llm.llm_engine.vllm_config.speculative_config
    spec = {
        "method": getattr(sc, "method", None),
        "parallel_drafting": bool(getattr(sc, "parallel_drafting", False)),
        "num_speculative_tokens": getattr(sc, "num_speculative_tokens", None),
        "draft_model": getattr(getattr(sc, "draft_model_config", None), "model", None),
        "draft_architectures": list(
            getattr(
                getattr(getattr(sc, "draft_model_config", None), "hf_config", None), "architectures", None
            )
            or []
        ),
    }
    problems = []
    if spec["method"] != "eagle3":
        problems.append(f"speculative method is {spec['method']!r}, expected 'eagle3'")
    if not spec["parallel_drafting"]:
        problems.append("parallel_drafting is off: the draft would run as plain sequential EAGLE-3")
    mask_loaded: bool | None = None
    try:
        got = llm.collective_rpc(_mask_hidden_of)[0]
    except Exception as exc:  # noqa: BLE001 - introspection is best effort across vLLM versions
        got = None
        problems.append(f"could not inspect the drafter's mask_hidden: {type(exc).__name__}: {exc}")
    if got is not None:
        want = load_file(str(Path(args.model) / "model.safetensors"))["mask_hidden"].float().flatten()
        have = torch.tensor(got)
        mask_loaded = bool(have.shape == want.shape and torch.allclose(have, want, atol=1e-2, rtol=1e-2))
        if not mask_loaded:
            problems.append("the drafter's mask_hidden differs from the exported tensor")
    elif not problems:
        mask_loaded = False
        problems.append("the drafter has no mask_hidden buffer (plain-EAGLE fallback)")

    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=False)
    t1 = time.time()
    results = llm.generate([TokensPrompt(prompt_token_ids=p["prompt_token_ids"]) for p in prompts], params)
    gen_s = time.time() - t1
    outputs = [list(r.outputs[0].token_ids) for r in results]
    c = _spec_counters(llm.get_metrics())
    drafts = c["num_drafts"]
    al = 1.0 + c["num_accepted_tokens"] / drafts if drafts else None
    per_pos = [a / drafts for a in c["per_pos"]] if drafts else []
    result = {
        "engine": "vllm",
        "vllm_version": vllm_version,
        "device": device,
        "speculative_config": spec,
        "mask_hidden_loaded": mask_loaded,
        "parallel_drafting_ok": not problems,
        "problems": problems,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "num_drafts": drafts,
        "num_draft_tokens": c["num_draft_tokens"],
        "num_accepted_tokens": c["num_accepted_tokens"],
        "accepted_per_pos": c["per_pos"],
        "acceptance_length": al,
        "per_position": per_pos,
        "tokens_generated": sum(len(o) for o in outputs),
        "outputs": outputs,
        "load_seconds": round(load_s, 2),
        "generate_seconds": round(gen_s, 2),
    }
    Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return 0 if not problems else 3


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
