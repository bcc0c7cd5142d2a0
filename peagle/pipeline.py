"""The whole `peagle train` pipeline: spec -> data -> vocab -> capture -> train -> evaluate -> export.

    result = run_pipeline(spec, run_dir, sink=sink, resume="auto")

Phases (each announced as a `phase` event on the sink, in this order): `validating` (target and
tokenizer load, aux layer ids, provenance), `preparing_data` + `building_vocab` (`peagle.data.prepare`,
cached in RUN/data), `capturing` (offline feature shards of the train and held-out rows when
`resources.capture == "offline"`), `training` (the trainer; every checkpoint carries the vLLM export,
written by `export_draft` before its COMPLETE marker), `evaluating` (the reference decoder on the best checkpoint's EXPORT, i.e. on exactly
the bf16 weights vLLM will serve), `exporting` (RUN/export = the best export + eval.json), optional
`serve_check` (vLLM), `done`. The run directory layout is in docs/service.md 7.

A resumed run (`resume="auto"`) reloads the prepared data by spec hash and the newest COMPLETE checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.errors import CheckpointError, TargetLoadError
from peagle.fileio import atomic_write_json, publish_dir
from peagle.spec import TrainSpec
from peagle.spec.metrics import ACCEPTANCE_LENGTH, PER_POSITION, TAU_SIM, al_pos_values, eval_key
from peagle.spec.targets import portable_verifier
from peagle.train.heartbeat import ProgressLog
from peagle.train.progress import ProgressSink

__all__ = ["PipelineResult", "build_initial_draft", "load_target", "resolve_dtype", "run_pipeline", "verifier_name"]


@dataclass
class PipelineResult:
    """Where the pipeline ended: the export dir, the best checkpoint, and the evaluation."""

    run_dir: Path
    export_dir: Path | None = None
    best_checkpoint: str | None = None
    eval: dict[str, Any] = field(default_factory=dict)
    serve_check: dict[str, Any] | None = None


def resolve_dtype(spec: TrainSpec, device: torch.device) -> torch.dtype:
    """`target.dtype` as `TrainSpec.resolve` decides it (auto = bf16 on CUDA, fp32 on CPU)."""
    name = spec.resolve(cuda_available=device.type == "cuda").target.dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_target(spec: TrainSpec, device: torch.device) -> tuple[Any, Any, Path | str]:
    """Load (model, tokenizer, resolved path) of the spec's target, eval mode on `device`.

    Raises:
        TargetLoadError: unknown builtin, missing folder, or transformers cannot load it (one line).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from peagle.builtin import resolve_target

    try:
        path = resolve_target(spec.target.model)
    except (ValueError, FileNotFoundError) as exc:
        raise TargetLoadError(f"target.model: {exc}") from None
    try:
        tok = AutoTokenizer.from_pretrained(str(path), revision=spec.target.revision)
        model = AutoModelForCausalLM.from_pretrained(
            str(path), revision=spec.target.revision, dtype=resolve_dtype(spec, device)
        )
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TargetLoadError(f"target.model {spec.target.model!r} cannot be loaded: {first}") from None
    model.to(device).eval()  # type: ignore[arg-type]  # transformers' decorated `to`
    model.requires_grad_(False)
    return model, tok, path


def verifier_name(spec: TrainSpec, resolved: Path | str) -> str:
    """What the export names as verifier (`peagle.spec.targets`): `target.name_or_path`, a builtin's hub id
    (or its builtin name), else the hub id / local folder the target was loaded from."""
    portable = portable_verifier(spec.target.model, spec.target.name_or_path)
    if portable is not None:
        return portable
    return str(Path(resolved).resolve()) if isinstance(resolved, Path) else str(resolved)


def _git_rev() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _provenance(device: torch.device, resolved: dict[str, Any]) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    pkgs: dict[str, str | None] = {}
    for name in ("peagle", "torch", "transformers", "tokenizers", "safetensors"):
        try:
            pkgs[name] = version(name)
        except PackageNotFoundError:
            pkgs[name] = None
    return {
        "packages": pkgs,
        "python": sys.version.split()[0],
        "git_rev": _git_rev(),
        "host": platform.node(),
        "platform": platform.platform(),
        "device": str(device),
        "cuda_device": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "argv": list(sys.argv),
        "pid": os.getpid(),
        "resolved": resolved,
    }


def _write_json(path: Path, data: Any) -> None:
    atomic_write_json(path, data, indent=2, sort_keys=True, default=str, newline=True)


class _NoPhases:
    """Forwards everything except `phase` events (the pipeline announces phases itself), but those in
    `allow`, which the callee announces at the moment it gets there (remembered in `seen`)."""

    def __init__(self, sink: ProgressSink, allow: tuple[str, ...] = ()) -> None:
        self.sink, self.allow, self.seen = sink, allow, set[str]()

    def metric(self, step: int, epoch: float, values: dict[str, float]) -> None:
        self.sink.metric(step, epoch, values)

    def event(self, kind: str, **fields: Any) -> None:
        if kind == "phase" and fields.get("phase") in self.allow:
            self.seen.add(str(fields["phase"]))
        elif kind == "phase":
            return
        self.sink.event(kind, **fields)

    def log(self, level: str, message: str) -> None:
        self.sink.log(level, message)


def _phase(sink: ProgressSink, phase: str, message: str) -> None:
    sink.event("phase", phase=phase, message=message)


def run_pipeline(
    spec: TrainSpec,
    run_dir: str | Path,
    *,
    sink: ProgressSink,
    resume: str = "auto",
    dataset_root: Path | None = None,
) -> PipelineResult:
    """Run the whole training pipeline of `spec` into `run_dir` (layout: module docstring).

    Args:
        spec: the validated job spec.
        run_dir: RUN (created if missing).
        sink: receives every progress record (the CLI also appends them to RUN/progress.jsonl).
        resume: `auto` (continue from the newest COMPLETE checkpoint) or `never`.
        dataset_root: where `dataset:<id>` sources live.

    Raises:
        The `peagle.errors` classes (spec/data/target/export/resource/checkpoint problems) and
        `TrainingInterrupted` after a SIGTERM (checkpoint saved).
    """
    from peagle.data.prepare import prepare_data
    from peagle.engine.locate import vllm_available
    from peagle.export.writer import export_draft
    from peagle.model.draft import PEagleDraft
    from peagle.target.capture import resolve_aux_layer_ids
    from peagle.target.runtime import feature_sources, load_target_runtime, wait_for_rank0
    from peagle.train.loop import Trainer, resolve_device
    from peagle.train.optim import total_steps

    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    result = PipelineResult(run_dir=run)
    sink = ProgressLog(sink)  # phase changes and a step line every LOG_EVERY_S seconds in the job log

    _phase(sink, "validating", "loading the target and resolving the spec")
    device = resolve_device(spec)
    torch.manual_seed(spec.optim.seed)
    base = spec.resolve(cuda_available=device.type == "cuda", vllm_available=vllm_available())
    target = load_target_runtime(base, device)  # the whole target (hf), or its frozen parts (vllm)
    model, tok, target_path = target.model, target.tokenizer, target.path
    n_layers = target.num_layers
    try:
        aux_ids = resolve_aux_layer_ids(spec.draft.aux_layer_ids, n_layers)
    except ValueError as exc:
        raise TargetLoadError(f"draft.aux_layer_ids: {exc}") from None
    vocab_size = target.vocab_size
    verifier = verifier_name(spec, target_path)
    k_eval = int(base.eval.num_speculative_tokens or 0)
    if target.engine == "vllm":
        sink.log("info", f"target engine: vLLM (the trainer holds the draft and the target's embeddings, lm_head "
                         f"and final norm; engine GPUs: {target.engine_devices or 'none, CPU'})")

    _phase(sink, "preparing_data", "reading, templating and packing the data")
    # prepare_data announces building_vocab when it gets there: a data error stays under preparing_data
    data_sink = _NoPhases(sink, allow=("regenerating", "building_vocab"))
    if target.engine == "vllm" and os.environ.get("RANK", "0") != "0":
        wait_for_rank0(run / "data")  # rank 0 runs the engines; the data it prepared is reloaded below
    regen = base.data.regenerate
    by_engine = regen.enabled is True and regen.engine == "vllm"
    prepared = prepare_data(
        base,
        tok,
        run,
        target_vocab_size=vocab_size,
        dataset_root=dataset_root,
        sink=data_sink,
        model=model if regen.enabled is True and regen.engine == "hf" else None,
        **({"regen_engine": target.engine_config(base)} if by_engine else {}),
    )
    if "building_vocab" not in data_sink.seen:  # reloaded from RUN/data: vocabulary included
        _phase(sink, "building_vocab", "draft vocabulary and mask token (reloaded)")
    vocab = prepared.vocab

    _phase(sink, "capturing", f"target features ({spec.resources.capture}, {target.engine})")
    # the capture engine (if any) runs for as long as the sources need it, and stops before evaluation
    with feature_sources(target, base, prepared, run, vocab=vocab, aux_ids=aux_ids,
                         sink=_NoPhases(sink)) as (source, eval_source):
        steps = total_steps(spec.optim, source.num_batches())
        resolved = base.resolve(cuda_available=device.type == "cuda", target_num_layers=n_layers,
                                mask_token_id=int(prepared.mask_token_id),
                                draft_vocab_size=int(vocab.draft_vocab_size), max_steps=int(steps))
        _write_json(run / "resolved_spec.json", resolved.model_dump(mode="json"))
        facts = {
            "target_path": str(target_path),
            "target_engine": target.engine,
            "engine_devices": target.engine_devices,
            "verifier_name_or_path": verifier,
            "target_num_layers": n_layers,
            "target_vocab_size": vocab_size,
            "aux_layer_ids": aux_ids,
            "mask_token_id": int(prepared.mask_token_id),
            "draft_vocab_size": int(vocab.draft_vocab_size),
            "total_steps": int(steps),
            "train_rows": len(prepared.train),
            "eval_rows": len(prepared.eval),
        }
        _write_json(run / "provenance.json", _provenance(device, facts))

        draft = build_initial_draft(spec, target.parts, vocab, int(prepared.mask_token_id), aux_ids)
        arch = target.architectures

        def write_export(tmp_dir: Path, d: PEagleDraft) -> None:
            export_draft(
                d,
                tmp_dir,
                num_speculative_tokens=spec.peagle.num_depths,
                verifier_name_or_path=verifier,
                verifier_architectures=arch,
                in_place=True,
            )

        trainer = Trainer(
            spec,
            draft,
            source,
            run_dir=run,
            eval_source=eval_source,
            sink=sink,
            extra_writer=write_export,
            evaluate_hook=_al_hook(spec, model, tok, k_eval) if spec.eval.prompt_sets else None,
            device=device,
            resume=resume,
        )
        trainer.train()

    best = _best_checkpoint(run / "checkpoints")
    result.best_checkpoint = best.name
    _phase(sink, "evaluating", f"acceptance length of {best.name} (reference decoder, K={k_eval})")
    result.eval = _evaluate_export(spec, best, model, tok, k_eval, sink)
    if result.eval.get(ACCEPTANCE_LENGTH) is not None:
        values = {ACCEPTANCE_LENGTH: result.eval[ACCEPTANCE_LENGTH]}
        values.update(al_pos_values(result.eval.get(PER_POSITION, [])))
        sink.metric(trainer.step, trainer.step / max(steps, 1) * spec.optim.epochs, values)
    # `checkpoint_step` lets the service record this AL on the evaluated checkpoint itself.
    step_of_best = best.name.rsplit("_", 1)[-1]
    sink.event("eval", metrics=result.eval, checkpoint=best.name,
               checkpoint_step=int(step_of_best) if step_of_best.isdigit() else None)

    _phase(sink, "exporting", "RUN/export = the best checkpoint's vLLM export")
    export_dir = _copy_export(best, run / "export")
    _write_json(export_dir / "eval.json", {"checkpoint": best.name, **result.eval})
    result.export_dir = export_dir
    sink.event("export", dir="export", checkpoint=best.name, message=f"exported {best.name} to RUN/export")

    if spec.eval.serve_check or spec.eval.engine == "vllm":
        _phase(sink, "serve_check", "loading the export in vLLM with parallel drafting")
        result.serve_check = _serve_check(spec, export_dir, tok, k_eval, sink, target_path)
    _phase(sink, "done", f"done: {_al_text(result.eval, spec)} ({best.name})")
    return result


def build_initial_draft(spec: TrainSpec, model: Any, vocab: Any, mask_token_id: int, aux_ids: list[int]) -> Any:
    """The untrained draft of a run (seeded by `optim.seed`, embeddings/lm_head rows from the target, the
    decoder layers / fc / final norm too when `draft.layer_init == "target"`).

    Args:
        spec: the job spec (`draft.num_layers`, `optim.seed`).
        model: the loaded target.
        vocab: the run's `DraftVocab` (`selected`, `t2d`).
        mask_token_id: the resolved mask token.
        aux_ids: the resolved aux layer ids.
    """
    from peagle.model.draft import DraftConfig, PEagleDraft
    from peagle.model.initialization import init_from_target, init_layers_from_target

    torch.manual_seed(spec.optim.seed)
    cfg = DraftConfig.from_target(
        model.config,
        num_layers=spec.draft.num_layers,
        draft_vocab_size=vocab.draft_vocab_size,
        mask_token_id=mask_token_id,
        aux_layer_ids=aux_ids,
    )
    draft = PEagleDraft(cfg)
    init_from_target(draft, model, vocab.t2d)
    if spec.draft.layer_init == "target":
        init_layers_from_target(draft, model)
    return draft


def _best_checkpoint(root: Path) -> Path:
    from peagle.train.checkpoint import read_state

    state = read_state(root)
    for name in (state.get("best"), state.get("latest")):
        if name and (root / name / "COMPLETE").exists():
            return root / name
    raise CheckpointError(f"{root}: no complete checkpoint to export")


def _prompt_ids(spec: TrainSpec, tok: Any) -> list[tuple[str, list[list[int]]]]:
    from peagle.eval.reference import load_prompts, tokenize_prompts

    return [
        (ps.name, tokenize_prompts(tok, load_prompts(ps.name, ps.num_prompts)))
        for ps in spec.eval.prompt_sets
    ]


def _eos_ids(model: Any, tok: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tok.eos_token_id
    return [int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None]


def _evaluate_export(
    spec: TrainSpec, ckpt: Path, model: Any, tok: Any, k: int, sink: ProgressSink
) -> dict[str, Any]:
    from peagle.eval.reference import evaluate_prompts
    from peagle.export.writer import load_exported_draft

    draft = load_exported_draft(ckpt).to(next(model.parameters()).device)
    meta = json.loads((ckpt / "meta.json").read_text(encoding="utf-8"))
    out: dict[str, Any] = {
        TAU_SIM: meta.get("metrics", {}).get(eval_key(TAU_SIM), meta.get("metrics", {}).get(TAU_SIM))
    }
    sets = {}
    for name, prompts in _prompt_ids(spec, tok):
        rep = evaluate_prompts(
            model, draft, prompts, num_speculative_tokens=k, max_new_tokens=spec.eval.max_new_tokens,
            eos_token_ids=_eos_ids(model, tok),
        )  # fmt: skip
        sets[name] = rep.to_dict()
        sink.log(
            "info",
            f"{name} ({len(prompts)} prompts, reference decoder): AL {rep.acceptance_length:.2f}, "
            f"acceptance per draft position {[round(x, 2) for x in rep.per_position]}",
        )
    if sets:
        first = next(iter(sets.values()))
        out.update(
            acceptance_length=first["acceptance_length"], per_position=first["per_position"],
            tokens_generated=first["tokens_generated"], num_speculative_tokens=k,
        )  # fmt: skip
    out["prompt_sets"] = sets
    return out


def _al_text(ev: dict[str, Any], spec: TrainSpec) -> str:
    """`AL 1.23 (reference decoder, humaneval, 8 prompts)`: the measured AL of an eval, rounded for people."""
    al = ev.get(ACCEPTANCE_LENGTH)
    if not isinstance(al, int | float):
        return "AL not measured (no eval.prompt_sets)"
    first = spec.eval.prompt_sets[0] if spec.eval.prompt_sets else None
    where = f", {first.name}, {first.num_prompts} prompts" if first else ""
    return f"AL {al:.2f} (reference decoder{where})"


def _al_hook(spec: TrainSpec, model: Any, tok: Any, k: int) -> Any:
    """`evaluate_hook` measuring AL during training: the first `eval.al_num_prompts` prompts of the first
    prompt set (all of them when checkpoints.select_best_by = acceptance_length, which ranks by it)."""
    prompts = _prompt_ids(spec, tok)[0][1]
    if spec.checkpoints.select_best_by != ACCEPTANCE_LENGTH:
        prompts = prompts[: spec.eval.al_num_prompts]

    def hook(draft: Any, step: int) -> dict[str, float]:
        from peagle.eval.reference import evaluate_prompts

        was_training = draft.training
        draft.eval()
        rep = evaluate_prompts(
            model, draft, prompts, num_speculative_tokens=k, max_new_tokens=spec.eval.max_new_tokens,
            eos_token_ids=_eos_ids(model, tok),
        )  # fmt: skip
        draft.train(was_training)
        return {
            ACCEPTANCE_LENGTH: rep.acceptance_length,
            **al_pos_values(rep.per_position),
        }

    return hook


def _copy_export(ckpt: Path, dest: Path) -> Path:
    from peagle.export.writer import check_export

    with publish_dir(dest, tmp_name=dest.name + ".tmp") as tmp:
        for name in ("config.json", "model.safetensors"):
            shutil.copy2(ckpt / name, tmp / name)
        check_export(tmp)
    return dest


def _serve_check(
    spec: TrainSpec, export_dir: Path, tok: Any, k: int, sink: ProgressSink, target_path: Path | str
) -> dict[str, Any] | None:
    from peagle.errors import ResourceError
    from peagle.eval.serve_check import compare_reports, run_vllm_probe, vllm_python

    if vllm_python() is None:
        sink.event("warning", message="serve check skipped: vLLM is not installed (make vllm-env)")
        return None
    eval_json = json.loads((export_dir / "eval.json").read_text(encoding="utf-8"))
    name, prompts = _prompt_ids(spec, tok)[0]
    try:
        res = run_vllm_probe(  # vLLM loads the folder the run trained against; the export names it portably
            export_dir, prompts, max_new_tokens=spec.eval.max_new_tokens, num_speculative_tokens=k,
            verifier=target_path,
        )
    except ResourceError as exc:
        sink.event("warning", message=f"serve check failed: {exc}")
        return None
    ref = dict(eval_json.get("prompt_sets", {}).get(name, {}))
    cmp = compare_reports(ref, res)
    _write_json(export_dir / "serve_check.json", cmp)
    # Keys prefixed `vllm_`: the reference decoder's `acceptance_length` stays the job's AL metric.
    v_al, r_al = cmp["vllm"].get("acceptance_length"), cmp["reference"].get("acceptance_length")
    def al(v: Any) -> str:
        return "n/a" if v is None else f"{v:.2f}"

    step = str(eval_json.get("checkpoint", "")).rsplit("_", 1)[-1]
    sink.event(
        "eval",
        message=f"vLLM serve check ({name}, {len(prompts)} prompts): AL {al(v_al)} in vLLM vs {al(r_al)} in "
        f"the reference decoder, parallel drafting {'on' if res.get('parallel_drafting_ok') else 'NOT on'}",
        # `checkpoint_step`: the service records vLLM's AL on the checkpoint, next to the reference AL
        checkpoint_step=int(step) if step.isdigit() else None,
        metrics={
            "engine": "vllm",
            **{f"vllm_{k}": v for k, v in cmp["vllm"].items()},
            "al_ratio_vllm_over_reference": cmp["al_ratio_vllm_over_reference"],
        },
    )
    if not res.get("parallel_drafting_ok"):
        sink.event(
            "warning",
            message="vLLM did not run the export with parallel drafting: " + "; ".join(res["problems"]),
        )
    return cmp
