"""The whole `peagle train` pipeline: spec -> data -> vocab -> capture -> train -> evaluate -> export.

    result = run_pipeline(spec, run_dir, sink=sink, resume="auto")

Phases (each announced as a `phase` event on the sink, in this order): `validating` (target and
tokenizer load, aux layer ids, provenance), `preparing_data` + `building_vocab` (`peagle.data.prepare`,
cached in RUN/data), `capturing` (offline feature shards of the train and held-out rows when
`resources.capture == "offline"`), `training` (the trainer; every checkpoint carries the vLLM export,
written by `export_draft` before its COMPLETE marker), then the evaluation end (`peagle.eval.job`):
`evaluating` (AL of the best checkpoint's EXPORT, i.e. of exactly the bf16 weights vLLM will serve, by the
resolved `eval.engine`, with vLLM's serving speedup), `exporting` (RUN/export = the best export + eval.json),
optional `serve_check` (vLLM against the reference decoder), `done`. The run directory layout is in
docs/service.md 7.

A resumed run (`resume="auto"`) reloads the prepared data by spec hash and the newest COMPLETE checkpoint.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from peagle.errors import TargetLoadError
from peagle.fileio import atomic_write_json
from peagle.spec import TrainSpec
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
    from peagle.eval.job import al_hook, evaluate_run
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
            evaluate_hook=al_hook(base, model, tok, k_eval, target_path=target_path, architectures=arch)
            if spec.eval.prompt_sets else None,
            device=device,
            resume=resume,
        )
        trainer.train()

    # the evaluation end (peagle/eval/job.py): best checkpoint's AL (and serving speedup), export, serve check
    evaluate_run(base, run, result, model=model, tok=tok, k=k_eval, sink=sink, target_path=target_path,
                 step=trainer.step, total_steps=steps)
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
