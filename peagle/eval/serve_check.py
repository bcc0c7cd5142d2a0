"""vLLM serve check: load an export in a real vLLM engine with parallel drafting and measure AL there.

vLLM lives in its own venv (`make vllm-env` builds `.vllm-venv`; it pins a different transformers), so
this module never imports it: it writes the tokenised prompts to a temp file, runs
`peagle/eval/vllm_probe.py` with that venv's Python and reads back its JSON (see the probe's docstring for
what it verifies). `PEAGLE_VLLM_PYTHON` points at another interpreter (e.g. a GPU vLLM on a GPU worker);
the probe uses CUDA when that interpreter's torch sees a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from peagle.engine.locate import vllm_python
from peagle.errors import ResourceError

__all__ = ["compare_reports", "loadable_export", "probe_script", "reference_dtypes", "run_eval", "run_vllm_probe",
           "vllm_python"]

def probe_script() -> Path:
    """Path of the script run inside the vLLM venv."""
    return Path(__file__).resolve().with_name("vllm_probe.py")


def _verifier_of(export_dir: Path) -> str | None:
    try:
        cfg = json.loads((export_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    name = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    return name if isinstance(name, str) else None


@contextlib.contextmanager
def loadable_export(export_dir: str | Path, verifier: str | Path | None) -> Iterator[Path]:
    """The export as vLLM on this machine must see it: its config naming `verifier` (a local folder).

    Exports name a portable verifier (a hub id, `builtin:tiny-llama`); loading one here needs the local
    folder. When the names differ, yields a temporary folder with a rewritten `config.json` and links to
    the other files (the export itself is never touched); else yields the export.
    """
    src = Path(export_dir).resolve()
    name = str(verifier.resolve()) if isinstance(verifier, Path) else verifier
    if verifier is None or _verifier_of(src) in (None, name):
        yield src
        return
    cfg = json.loads((src / "config.json").read_text(encoding="utf-8"))
    cfg["speculators_config"]["verifier"]["name_or_path"] = name
    with tempfile.TemporaryDirectory(prefix="peagle-export-") as tmp:
        view = Path(tmp) / src.name
        view.mkdir()
        for entry in src.iterdir():
            if entry.name != "config.json":
                (view / entry.name).symlink_to(entry)
        (view / "config.json").write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        yield view


def run_vllm_probe(
    export_dir: str | Path,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    num_speculative_tokens: int | None = None,
    max_model_len: int = 1024,
    timeout_s: float = 3600.0,
    python: str | Path | None = None,
    log_path: str | Path | None = None,
    verifier: str | Path | None = None,
) -> dict[str, Any]:
    """Run the vLLM probe on an export directory and return its JSON result.

    Args:
        export_dir: a speculators-format export.
        prompts: token ids per prompt (already chat-templated), identical to the reference decoder's.
        max_new_tokens: per prompt (greedy).
        num_speculative_tokens: K override; None = `speculative_tokens` of the config.
        max_model_len: vLLM's context limit (prompt + new tokens must fit).
        timeout_s: wall-clock limit for the subprocess.
        python: the vLLM interpreter; None = `vllm_python()`.
        log_path: where vLLM's own output goes (default: a temp file, named in errors).
        verifier: the target vLLM loads (a local folder); None = the export's verifier mapped to this
            machine by `peagle.builtin.local_verifier` (a builtin's hub id -> its offline folder).

    Returns:
        The probe's result: `speculative_config`, `mask_hidden_loaded`, `parallel_drafting_ok`, `problems`,
        `acceptance_length`, `per_position`, counters, `outputs` (token ids), timings.

    Raises:
        ResourceError: no vLLM venv, or the probe crashed / timed out (message names the log).
    """
    py = Path(python) if python is not None else vllm_python()
    if py is None:
        raise ResourceError(
            "vLLM is not installed: run `make vllm-env` (builds .vllm-venv) or set PEAGLE_VLLM_PYTHON"
        )
    named = _verifier_of(Path(export_dir))
    if verifier is None and named:
        from peagle.builtin import local_verifier

        verifier = local_verifier(named)
    with loadable_export(export_dir, verifier) as model_dir, \
            tempfile.TemporaryDirectory(prefix="peagle-vllm-") as tmp:
        prompt_file = Path(tmp) / "prompts.json"
        out_file = Path(tmp) / "result.json"
        prompt_file.write_text(json.dumps([{"prompt_token_ids": list(map(int, p))} for p in prompts]))
        log = Path(log_path) if log_path is not None else Path(tmp) / "vllm.log"
        cmd = [
            str(py), str(probe_script()), "--model", str(model_dir), "--prompts", str(prompt_file),
            "--out", str(out_file), "--max-new-tokens", str(max_new_tokens), "--max-model-len", str(max_model_len),
        ]  # fmt: skip
        if num_speculative_tokens is not None:
            cmd += ["--num-speculative-tokens", str(num_speculative_tokens)]
        # TQDM_DISABLE would crash vLLM's generate (it divides by the disabled bar's elapsed time, 0).
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("PYTHON", "VIRTUAL_ENV")) and k != "TQDM_DISABLE"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        iomp = py.parent.parent / "lib" / "libiomp5.so"  # vLLM CPU wants Intel OpenMP preloaded for spec decode
        if iomp.is_file() and "libiomp5" not in env.get("LD_PRELOAD", ""):
            env["LD_PRELOAD"] = ":".join(x for x in (str(iomp), env.get("LD_PRELOAD", "")) if x)
        env["HF_HUB_OFFLINE"] = "1"
        with log.open("w") as fh:
            try:
                proc = subprocess.run(
                    cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False
                )
            except subprocess.TimeoutExpired:
                raise ResourceError(f"vLLM serve check timed out after {timeout_s:.0f} s") from None
        if not out_file.exists():
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise ResourceError(f"vLLM serve check failed (exit {proc.returncode}): " + " | ".join(tail))
        result = json.loads(out_file.read_text())
    return result


def compare_reports(reference: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """Side by side: AL and per-position of both engines, their ratio, and output agreement.

    Args:
        reference: `EvalReport.to_dict(with_outputs=True)` of the reference decoder.
        vllm: `run_vllm_probe` result.
    """
    ref_al, v_al = reference.get("acceptance_length"), vllm.get("acceptance_length")
    ratio = v_al / ref_al if ref_al and v_al else None
    ref_out, v_out = reference.get("outputs") or [], vllm.get("outputs") or []
    same = sum(1 for a, b in zip(ref_out, v_out, strict=False) if list(a) == list(b))
    return {
        "reference": {
            k: reference.get(k)
            for k in ("acceptance_length", "per_position", "num_drafts", "tokens_generated")
        },
        "vllm": {
            k: vllm.get(k)
            for k in (
                "acceptance_length",
                "per_position",
                "num_drafts",
                "tokens_generated",
                "speculative_config",
                "mask_hidden_loaded",
                "parallel_drafting_ok",
                "problems",
                "vllm_version",
                "device",
            )
        },
        "al_ratio_vllm_over_reference": ratio,
        "al_within_5pct": ratio is not None and abs(ratio - 1.0) <= 0.05,
        # Outputs are compared only when both sides carry them (None = not compared, not "0 identical").
        "identical_outputs": same if ref_out and v_out else None,
        "num_prompts": min(len(ref_out), len(v_out)) if ref_out and v_out else None,
    }


#: `--dtype` values of `peagle eval`: `auto` = what the job's own evaluation uses (below).
EVAL_DTYPES = ("auto", "float32", "bfloat16")


def reference_dtypes(export_config: dict[str, Any], dtype: str) -> tuple[Any, Any]:
    """(target dtype, draft dtype) of a reference evaluation of an export.

    `auto` is what the evaluation inside a job does (`peagle.pipeline._evaluate_export`): the target in the
    dtype the export is served in (its config's `torch_dtype`, bf16: about 3x faster than fp32 on a CPU
    with bf16 instructions, and what vLLM runs), the draft in fp32 (`load_exported_draft`'s default).
    `float32` / `bfloat16` put both in that dtype.

    Raises:
        ValueError: any other `dtype`.
    """
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if dtype == "auto":
        return names.get(str(export_config.get("torch_dtype")), torch.float32), torch.float32
    if dtype not in EVAL_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(EVAL_DTYPES)}, got {dtype!r}")
    return names[dtype], names[dtype]


def run_eval(
    export_dir: str | Path,
    *,
    prompts: str,
    num_prompts: int,
    max_new_tokens: int,
    num_speculative_tokens: int | None = None,
    engine: str = "reference",
    target: str | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """AL of an export with the reference decoder, vLLM, or both (what `peagle eval` prints).

    Args:
        export_dir: a validated export directory.
        prompts: `humaneval`, `sharegpt-heldout` or a JSONL path.
        num_prompts, max_new_tokens: first N prompts, tokens per prompt.
        num_speculative_tokens: K; None = the export's `speculative_tokens`.
        engine: `reference`, `vllm` or `both` (both adds the comparison).
        target: target folder for both engines; None = the export's verifier, mapped to this machine by
            `peagle.builtin.local_verifier`.
        dtype: reference decoder dtypes, `auto` (as inside a job), `float32` or `bfloat16`
            (`reference_dtypes`).

    Returns:
        `{"engine", "acceptance_length", "per_position", "tokens_generated", "num_drafts", ...}`; with
        `both`, the reference numbers at top level plus `"vllm"` and `"comparison"`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.errors import TargetLoadError
    from peagle.eval.reference import evaluate_prompts, load_prompts, tokenize_prompts
    from peagle.export.writer import (
        check_export,
        load_exported_draft,
        num_speculative_tokens_of,
        read_export_config,
    )

    check_export(export_dir)
    cfg = read_export_config(export_dir)
    k = num_speculative_tokens or num_speculative_tokens_of(cfg)
    verifier = ((cfg.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")
    if not (target or verifier):
        raise TargetLoadError("no target: pass --target (the export names no verifier)")
    from peagle.builtin import local_verifier

    try:  # the export names a portable verifier; this machine loads its local folder
        tpath = target or local_verifier(str(verifier))
    except (ValueError, FileNotFoundError) as exc:
        raise TargetLoadError(f"verifier {verifier!r} cannot be loaded here: {exc}; pass --target") from None
    target_dtype, draft_dtype = reference_dtypes(cfg, dtype)
    try:
        tok = AutoTokenizer.from_pretrained(str(tpath))
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"target {tpath!r} cannot be loaded: {str(exc).splitlines()[0]}") from None
    ids = tokenize_prompts(tok, load_prompts(prompts, num_prompts))
    out: dict[str, Any] = {"prompts": prompts, "num_prompts": len(ids), "max_new_tokens": max_new_tokens}
    ref: dict[str, Any] | None = None
    if engine in ("reference", "both"):
        try:
            model = AutoModelForCausalLM.from_pretrained(str(tpath), dtype=target_dtype).eval()
        except (OSError, ValueError) as exc:
            raise TargetLoadError(f"target {tpath!r} cannot be loaded: {str(exc).splitlines()[0]}") from None
        draft = load_exported_draft(export_dir, dtype=draft_dtype, validate=False)
        eos = model.generation_config.eos_token_id
        eos_ids = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        rep = evaluate_prompts(
            model, draft, ids, num_speculative_tokens=k, max_new_tokens=max_new_tokens, eos_token_ids=eos_ids
        )
        ref = rep.to_dict(with_outputs=True)
        out.update({"engine": "reference", **{k_: v for k_, v in ref.items() if k_ != "outputs"}})
    if engine in ("vllm", "both"):
        res = run_vllm_probe(export_dir, ids, max_new_tokens=max_new_tokens, num_speculative_tokens=k,
                             verifier=tpath)
        slim = {k_: v for k_, v in res.items() if k_ != "outputs"}
        if ref is None:
            out.update(slim)
        else:
            out["vllm"] = slim
            out["comparison"] = compare_reports(ref, res)
    return out
