"""The run folder's layout: the one owner of every name in it (torch-free, standard library only).

    run = job_dir(artifact_root, "job_01J...")          # ARTIFACT_ROOT/job_01J...
    ckpt = run / CHECKPOINTS / step_dirname(100)        # RUN/checkpoints/step_000100
    is_complete(ckpt)                                   # its COMPLETE marker is there (written last)
    complete_checkpoints(run / CHECKPOINTS)             # [.../step_000050, .../step_000100], oldest first
    step_of("step_000100") == 100
    archive_folder("job_01J...", 100)                   # "job_01J...-step_000100" (what the archive unpacks to)
    job_ref("job_01J...", 100)                          # "job:job_01J...@step_100" (a warm start's source)
    resolve_inside(run, "../x") is None                 # a name that leaves its folder is refused

The layout (docs/service.md 7):

    ARTIFACT_ROOT/<job id>/                   job_dir
      checkpoints/                            CHECKPOINTS
        state.json                            STATE_FILE: {"latest", "best", "best_metric", "select_best_by"}
        step_000100/                          step_dirname(100); step_of parses it back
          ... COMPLETE                        COMPLETE, written last (peagle.train.checkpoint)
      export/                                 EXPORT: the best checkpoint's export (peagle.eval.final)
    HOME/cache/archives/<job id>/step_000100-<key>.tar   archive_cache_file (the API's checkpoint archives)

Every reader calls these: the trainer's checkpoints (`peagle.train.checkpoint`), the evaluation end
(`peagle.eval.final`), the API's checkpoint routes, the warm start (`service.db.init_from`), promotion and
the worker. No torch, no pydantic: the API and the service layer import it.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = [
    "CHECKPOINTS",
    "COMPLETE",
    "EXPORT",
    "JOB_PREFIX",
    "STATE_FILE",
    "archive_cache_file",
    "archive_file",
    "archive_folder",
    "checkpoint_relpath",
    "complete_checkpoints",
    "inside",
    "is_complete",
    "job_dir",
    "job_ref",
    "parse_job_ref",
    "resolve_inside",
    "step_dirname",
    "step_of",
]

#: The run folder's subfolder of checkpoints.
CHECKPOINTS = "checkpoints"
#: The run folder's subfolder of the best checkpoint's export (`vllm serve RUN/export`).
EXPORT = "export"
#: RUN/checkpoints/state.json: which checkpoint is the latest and which the best.
STATE_FILE = "state.json"
#: The marker the trainer writes last into a checkpoint folder: without it the folder is not a checkpoint.
COMPLETE = "COMPLETE"
#: How a warm start (`draft.init_from`) names a job's checkpoint: `job:<id>` or `job:<id>@step_<N>`.
JOB_PREFIX = "job:"

_STEP_PREFIX = "step_"
_STEP_NAME = re.compile(r"step_([0-9]{6,})")
_ID = r"[A-Za-z0-9_]{1,64}"
_JOB_REF = re.compile(rf"job:(?P<id>{_ID})(?:@step_(?P<step>[0-9]{{1,9}}))?")


def _path_part(job_id: str) -> str:
    """`job_id` when it is one plain folder name (no separator, not `.`/`..`, no NUL), else ValueError."""
    if not job_id or job_id in (".", "..") or any(c in job_id for c in "/\\\0"):
        raise ValueError(f"job id {job_id!r} is not a folder name")
    return job_id


def job_dir(artifact_root: Path, job_id: str, *, artifact_dir: str | None = None) -> Path:
    """The job's run folder: `artifact_dir` (the job row's, written by the worker when it claims the job;
    relative to `artifact_root` unless absolute) when given, else `artifact_root/<job_id>`.

    Raises:
        ValueError: `job_id` is not one plain folder name (it would leave the artifact root).
    """
    _path_part(job_id)
    if artifact_dir:
        p = Path(artifact_dir)
        return p if p.is_absolute() else Path(artifact_root) / p
    return Path(artifact_root) / job_id


def step_dirname(step: int) -> str:
    """`step_000100` for step 100: a checkpoint's folder name under RUN/checkpoints (zero-padded to 6
    digits, so names sort by step up to 999999)."""
    return f"{_STEP_PREFIX}{step:06d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder name holds (`step_000100` -> 100), None when `name` is not one."""
    m = _STEP_NAME.fullmatch(name)
    return int(m[1]) if m else None


def checkpoint_relpath(step: int) -> str:
    """`checkpoints/step_000100`: a checkpoint's folder relative to the run folder (the `dir` of a
    `checkpoint` progress record and of the service's checkpoint row)."""
    return f"{CHECKPOINTS}/{step_dirname(step)}"


def is_complete(folder: Path) -> bool:
    """Whether `folder` holds the COMPLETE marker (the checkpoint was fully written; its files may still
    need checking against meta.json: `peagle.train.checkpoint.verify_checkpoint`)."""
    return (Path(folder) / COMPLETE).is_file()


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """The complete checkpoint folders under RUN/checkpoints, oldest (lowest step) first; [] when there is
    no such folder."""
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [(step, p) for p in root.iterdir() if (step := step_of(p.name)) is not None and p.is_dir()
             and is_complete(p)]
    return [p for _, p in sorted(found)]


def archive_folder(job_id: str, step: int) -> str:
    """`<job id>-step_000100`: the folder a checkpoint's archive unpacks to (and `peagle jobs download`
    writes by default; the serve command names it)."""
    return f"{_path_part(job_id)}-{step_dirname(step)}"


def archive_file(job_id: str, step: int) -> str:
    """`<job id>-step_000100.tar`: the archive's download name."""
    return f"{archive_folder(job_id, step)}.tar"


def archive_cache_file(home: Path, job_id: str, step: int, key: str) -> Path:
    """HOME/cache/archives/<job id>/step_000100-<key>.tar: where the API keeps a built archive; `key` tells
    apart the archives of one checkpoint with different file lists (e.g. with training_state.pt)."""
    return Path(home) / "cache" / "archives" / _path_part(job_id) / f"{step_dirname(step)}-{key}.tar"


def inside(path: Path, root: Path) -> bool:
    """Whether `path`, resolved (symlinks followed, `..` removed), is `root` (resolved) or below it."""
    return Path(path).resolve().is_relative_to(Path(root).resolve())


def resolve_inside(root: Path, name: str | Path) -> Path | None:
    """`root / name` resolved, or None when that leaves `root` (a `..`, an absolute name, a symlink that
    points out)."""
    p = (Path(root) / name).resolve()
    return p if inside(p, root) else None


def job_ref(job_id: str, step: int | None = None) -> str:
    """`job:<id>` (the job's best checkpoint) or `job:<id>@step_<N>` (its checkpoint of step N; N is
    not zero-padded): how `draft.init_from` names a job's checkpoint."""
    return f"{JOB_PREFIX}{job_id}" + (f"@{_STEP_PREFIX}{step}" if step is not None else "")


def parse_job_ref(value: str) -> tuple[str, int | None] | None:
    """(job id, step or None) of a `job:<id>[@step_<N>]` value (`job_ref`'s form), None for any other
    string (a wrong shape included: the id is 1-64 of `A-Za-z0-9_`, N at most 9 digits)."""
    m = _JOB_REF.fullmatch(value)
    if m is None:
        return None
    return m["id"], int(m["step"]) if m["step"] is not None else None
