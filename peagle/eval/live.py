"""The AL hook the trainer calls during training (`Trainer(evaluate_hook=...)`).

    hook = al_hook(spec, model, tok, k, target_path=path)        # Trainer(evaluate_hook=hook)
    metrics = hook(draft, step)                                   # {acceptance_length, al_pos_*} or {}

The decoder is `peagle.eval.decoder.measuring_engine`'s: the reference decoder on the draft in memory, or
vLLM (the probe engine, under the guard) on an export of it written to a temporary folder.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from peagle.data.prompts import PromptSources, prompt_ids
from peagle.eval.decoder import eos_ids, measuring_engine, resolved_eval
from peagle.spec import TrainSpec
from peagle.spec.metrics import ACCEPTANCE_LENGTH, al_pos_values

__all__ = ["al_hook"]


def _architectures(target_path: Path | str) -> list[str]:
    try:
        cfg = json.loads((Path(target_path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ["LlamaForCausalLM"]
    return list(cfg.get("architectures") or ["LlamaForCausalLM"])


def al_hook(
    spec: TrainSpec, model: Any, tok: Any, k: int, *, target_path: Path | str,
    architectures: list[str] | None = None, sources: PromptSources | None = None,
) -> Any:
    """`evaluate_hook` measuring AL during training on the first `eval.al_num_prompts` prompts of the first
    prompt set (all of them when the resolved `checkpoints.select_best_by` is acceptance_length, which
    ranks checkpoints by it), with the decoder of `measuring_engine`: the reference decoder on the draft in memory,
    or vLLM on an export of it written to a temporary folder (one engine start per call).

    Args:
        spec: the job spec (resolved or not).
        model: the target in this process, or None (the vLLM target engine).
        tok: the target's tokenizer.
        k: K at evaluation.
        target_path: the local target folder vLLM loads as verifier.
        architectures: the verifier's architectures for the temporary export (default: its config.json's).
        sources: the job's own prompt sets (`PromptSources`).
    """
    resolved = resolved_eval(spec)
    prompts = prompt_ids(resolved, tok, sources, first_only=True)[0][1]
    if resolved.checkpoints.select_best_by != ACCEPTANCE_LENGTH:
        prompts = prompts[: resolved.eval.al_num_prompts]
    engine = measuring_engine(resolved, model, None)
    max_new = resolved.eval.max_new_tokens

    def hook(draft: Any, step: int) -> dict[str, float]:
        from peagle.eval.reference import evaluate_prompts

        was_training = draft.training
        draft.eval()
        try:
            if engine == "reference":
                rep = evaluate_prompts(model, draft, prompts, num_speculative_tokens=k, max_new_tokens=max_new,
                                       eos_token_ids=eos_ids(model, tok))  # fmt: skip
                al, per_pos = rep.acceptance_length, rep.per_position
            else:
                al, per_pos = _vllm_al_of_draft(draft, prompts, k, max_new, target_path,
                                                architectures or _architectures(target_path))  # fmt: skip
        finally:
            draft.train(was_training)
        return {} if al is None else {ACCEPTANCE_LENGTH: al, **al_pos_values(per_pos)}

    return hook


def _vllm_al_of_draft(
    draft: Any, prompts: list[list[int]], k: int, max_new: int, target_path: Path | str, arch: list[str]
) -> tuple[float | None, list[float]]:
    from peagle.eval.serve_check import run_vllm_probe
    from peagle.export.writer import export_draft

    local = Path(target_path)
    name = str(local.resolve()) if local.is_dir() else str(target_path)  # a folder, or a hub id as given
    with tempfile.TemporaryDirectory(prefix="peagle-al-") as tmp:
        out = export_draft(draft, Path(tmp) / "export", num_speculative_tokens=k, verifier_name_or_path=name,
                           verifier_architectures=arch)
        res = run_vllm_probe(out, prompts, max_new_tokens=max_new, num_speculative_tokens=k, verifier=target_path)
    return res.get("acceptance_length"), list(res.get("per_position") or [])
