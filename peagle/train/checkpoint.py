"""Crash-safe checkpoints in RUN/checkpoints (layout: docs/service.md 7; its names: `peagle.run_folder`).

A checkpoint is written into a temporary directory (`.tmp-step_000100-<pid>`): `training_state.pt`
(fp32 weights, optimizer, scheduler, RNG, step/epoch/data position), whatever `extra_writer(tmp, draft)`
adds (the vLLM export: `config.json`, `model.safetensors`), `meta.json` (step, epoch, metrics, size +
sha256 of every file) and finally `COMPLETE`, each fsync'ed; then the directory is atomically renamed
to `step_000100` and `state.json` (`latest`, `best`, `best_metric`) is replaced atomically.

Only directories with `COMPLETE` whose files match `meta.json` (size, and sha256 unless told not to)
are ever resumed. Retention keeps the newest `keep_last` complete checkpoints plus the best one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from peagle.errors import CheckpointError
from peagle.fileio import atomic_write_json, publish_dir
from peagle.run_folder import (
    CHECKPOINTS,
    COMPLETE,
    STATE_FILE,
    complete_checkpoints,
    is_complete,
    step_dirname,
    step_of,
)
from peagle.spec.files import TRAINING_STATE_FILE
from peagle.spec.metrics import ACCEPTANCE_LENGTH, LOSS, TAU_SIM, eval_key

__all__ = [
    "CheckpointInfo",
    "best_metric_value",
    "find_resumable",
    "init_source_dir",
    "load_init_weights",
    "load_training_state",
    "read_init_weights",
    "read_state",
    "save_checkpoint",
    "verify_checkpoint",
]

ExtraWriter = Callable[[Path, Any], None]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def best_metric_value(metrics: dict[str, float], select_best_by: str) -> tuple[str, float] | None:
    """(name, value as "higher is better") of the metric that ranks checkpoints, or None if absent.

    `tau_sim` prefers the held-out `eval_tau_sim`; `loss` prefers `eval_loss` (negated);
    `acceptance_length` falls back to the tau_sim rule when AL was not measured at this checkpoint.

    Raises:
        ValueError: `select_best_by` is not one of those three (an `auto` the caller did not resolve:
            `TrainSpec.resolve` decides it).
    """
    tau = [(eval_key(TAU_SIM), 1.0), (TAU_SIM, 1.0)]
    orders = {
        ACCEPTANCE_LENGTH: [(ACCEPTANCE_LENGTH, 1.0), *tau],
        TAU_SIM: tau,
        LOSS: [(eval_key(LOSS), -1.0), (LOSS, -1.0)],
    }
    if select_best_by not in orders:
        raise ValueError(f"select_best_by {select_best_by!r}: one of {sorted(orders)} (resolve 'auto' first)")
    order = orders[select_best_by]
    for name, sign in order:
        v = metrics.get(name)
        if v is not None and v == v:  # not NaN
            return name, sign * float(v)
    return None


@dataclass(frozen=True)
class CheckpointInfo:
    """What `save_checkpoint` wrote: `dir` (relative to the run dir), files, metrics, whether it is best."""

    step: int
    dir: str
    path: Path
    files: list[dict[str, Any]]
    metrics: dict[str, float]
    is_best: bool


def read_state(ckpt_root: Path) -> dict[str, Any]:
    """RUN/checkpoints/state.json (empty dict when absent)."""
    p = Path(ckpt_root) / STATE_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.exists() else {}


def save_checkpoint(
    ckpt_root: Path,
    *,
    step: int,
    epoch: float,
    training_state: dict[str, Any],
    metrics: dict[str, float],
    draft: Any = None,
    extra_writer: ExtraWriter | None = None,
    keep_last: int = 2,
    select_best_by: str = "tau_sim",
) -> CheckpointInfo:
    """Write one complete checkpoint of `step` crash-safely, update state.json, prune old ones.

    Args:
        ckpt_root: RUN/checkpoints.
        step, epoch: position of the run (also inside `training_state`).
        training_state: what `torch.save` writes to training_state.pt (weights, optimizer, ...).
        metrics: floats stored in meta.json and used to rank checkpoints.
        draft: handed to `extra_writer`.
        extra_writer: `extra_writer(tmp_dir, draft)` writes the vLLM export into the checkpoint
            before it is marked complete.
        keep_last: newest complete checkpoints kept (the best one is kept in addition).
        select_best_by: `tau_sim`, `acceptance_length` or `loss` (see `best_metric_value`); the spec's
            `auto` resolved (`TrainSpec.resolve`).
    """
    root = Path(ckpt_root)
    root.mkdir(parents=True, exist_ok=True)
    name = step_dirname(step)
    final = root / name
    # a re-save of the same step (e.g. after a resume) replaces it; fsync'ed, then renamed into place
    with publish_dir(final, tmp_name=f".tmp-{name}-{os.getpid()}", durable=True) as tmp:
        torch.save(training_state, tmp / TRAINING_STATE_FILE)
        if extra_writer is not None:
            extra_writer(tmp, draft)
        files = []
        for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
            files.append({"path": f.relative_to(tmp).as_posix(), "size": f.stat().st_size, "sha256": _sha256(f)})
        meta = {"step": step, "epoch": epoch, "metrics": metrics, "files": files}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True), encoding="utf-8")
        (tmp / COMPLETE).write_text("ok\n", encoding="utf-8")

    state = read_state(root)
    ranked = best_metric_value(metrics, select_best_by)
    best = state.get("best")
    is_best = False
    if best is None or not is_complete(root / best):
        is_best = True
    elif ranked is not None:
        prev = state.get("best_rank")
        is_best = prev is None or ranked[1] > prev
    if is_best:
        best = name
        state["best_rank"] = ranked[1] if ranked else None
        state["best_metric"] = {ranked[0]: metrics[ranked[0]]} if ranked else None
    state.update({"latest": name, "best": best, "select_best_by": select_best_by})
    atomic_write_json(root / STATE_FILE, state, indent=2, sort_keys=True, durable=True)
    _prune(root, keep_last=keep_last, keep={name, str(best)})
    return CheckpointInfo(step=step, dir=f"{root.name}/{name}", path=final, files=files, metrics=metrics,
                          is_best=is_best)


def _prune(root: Path, *, keep_last: int, keep: set[str]) -> None:
    complete = complete_checkpoints(root)
    keep = keep | {p.name for p in complete[-keep_last:]}
    for p in root.iterdir():
        stale_tmp = p.name.startswith((".tmp-", ".trash-")) and p.is_dir()
        old = step_of(p.name) is not None and p.is_dir() and p.name not in keep
        if stale_tmp or old:
            shutil.rmtree(p, ignore_errors=True)


def verify_checkpoint(path: Path, *, check_hash: bool = True) -> list[str]:
    """Problems of a checkpoint directory (empty list = complete and intact)."""
    path = Path(path)
    if not is_complete(path):
        return [f"{path.name}: no {COMPLETE} marker (interrupted while saving)"]
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [f"{path.name}/meta.json unreadable: {exc}"]
    problems = []
    names = {f["path"] for f in meta.get("files", [])}
    if TRAINING_STATE_FILE not in names:
        problems.append(f"{path.name}: {TRAINING_STATE_FILE} not listed in meta.json")
    for f in meta.get("files", []):
        p = path / f["path"]
        if not p.is_file():
            problems.append(f"{path.name}/{f['path']} missing")
        elif p.stat().st_size != f["size"]:
            problems.append(f"{path.name}/{f['path']} has {p.stat().st_size} bytes, meta.json says {f['size']}")
        elif check_hash and _sha256(p) != f["sha256"]:
            problems.append(f"{path.name}/{f['path']} sha256 mismatch")
    return problems


def find_resumable(ckpt_root: Path, *, check_hash: bool = True, warn: Callable[[str], None] | None = None) -> Path | None:
    """The newest intact complete checkpoint under RUN/checkpoints, or None. Broken ones are skipped."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    for p in reversed(complete_checkpoints(root)):
        problems = verify_checkpoint(p, check_hash=check_hash)
        if not problems:
            return p
        if warn is not None:
            warn("skipping checkpoint: " + "; ".join(problems))
    return None


def load_training_state(path: Path, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load training_state.pt of a verified checkpoint directory."""
    problems = verify_checkpoint(path, check_hash=False)
    if problems:
        raise CheckpointError("; ".join(problems))
    try:
        return torch.load(Path(path) / TRAINING_STATE_FILE, map_location=map_location, weights_only=True)
    except (OSError, RuntimeError, EOFError) as exc:
        raise CheckpointError(f"{path}/{TRAINING_STATE_FILE} could not be loaded: {exc}") from exc


# --------------------------------------------------------------------------------------------------
# Warm start (`draft.init_from`, peagle/spec/init_from.py): another run's weights as a new run's start
# --------------------------------------------------------------------------------------------------


def init_source_dir(path: str | Path, *, step: int | None = None) -> Path:
    """The export folder (`config.json` + `model.safetensors`) a warm start reads from `path`.

    `path` is an export folder or a checkpoint folder (both hold the export), or a run directory: its
    checkpoint of `step`, else its best one (`checkpoints/state.json`).

    Raises:
        CheckpointError: nothing of that kind there (the message says what was looked for).
    """
    p = Path(path).expanduser()
    if step is None and (p / "config.json").is_file():
        return p
    ckpts = p / CHECKPOINTS
    if not ckpts.is_dir():
        raise CheckpointError(f"draft.init_from: {p} is neither an export folder (config.json + model.safetensors) "
                              "nor a run directory (checkpoints/)")
    name = step_dirname(step) if step is not None else read_state(ckpts).get("best")
    if not name:
        raise CheckpointError(f"draft.init_from: {p} has no best checkpoint (checkpoints/state.json)")
    found = ckpts / str(name)
    if not is_complete(found) or not (found / "config.json").is_file():
        what = f"checkpoint of step {step}" if step is not None else f"best checkpoint {name}"
        raise CheckpointError(f"draft.init_from: the {what} of {p} is gone or incomplete (kept: "
                              f"{', '.join(d.name for d in complete_checkpoints(ckpts)) or 'none'})")
    return found


def read_init_weights(export_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json, tensors) of a valid export folder (`peagle validate`'s rules, then its weights).

    Raises:
        ExportInvalidError: the folder breaks an export rule.
        CheckpointError: the weights cannot be read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from peagle.export.rules import check_export, read_export_config

    check_export(export_dir)
    cfg = read_export_config(export_dir)
    try:
        state = load_file(str(Path(export_dir) / "model.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"draft.init_from: {export_dir}/model.safetensors could not be read: {exc}") from None
    return cfg, {k.removeprefix("model."): v for k, v in state.items()}


def load_init_weights(draft: Any, state: dict[str, torch.Tensor], *, source: str) -> None:
    """Copy an export's tensors `state` (every tensor of the draft) into `draft`, in place, cast to each
    parameter's dtype.

    The vocabulary mapping (`d2t` [Vd], `t2d` [V]) must be the draft's own: the rows of `lm_head` mean
    target tokens through it.

    Raises:
        CheckpointError: a tensor the draft does not have or lacks, one of another shape, or another mapping.
    """
    own = draft.state_dict()
    unknown, missing = sorted(set(state) - set(own)), sorted(set(own) - set(state))
    if unknown or missing:
        raise CheckpointError(f"draft.init_from: {source} does not hold this draft's tensors (unexpected: "
                              f"{', '.join(unknown[:5]) or 'none'}; missing: {', '.join(missing[:5]) or 'none'})")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise CheckpointError(f"draft.init_from: {name} of {source} has shape {tuple(t.shape)}, this draft's "
                                  f"is {tuple(own[name].shape)}")
        if name in ("d2t", "t2d") and not torch.equal(t.to(own[name].dtype).cpu(), own[name].cpu()):
            raise CheckpointError(f"draft.init_from: the draft vocabulary mapping ({name}) of {source} differs "
                                  "from this run's")
    with torch.no_grad():
        for name, t in state.items():
            own[name].copy_(t.to(own[name].dtype))
