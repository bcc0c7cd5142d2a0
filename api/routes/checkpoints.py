"""Checkpoints of a job: list, per-file download (HTTP Range, sha256), deterministic archive, serve command.

Only COMPLETE checkpoints are listed or served: a row marked complete whose folder has no `COMPLETE` marker
any more (retention's `keep_last` deleted it, also one of an earlier attempt after a resume, which the
worker never learns of) is neither listed nor served (404). A file is served only if the checkpoint's `files` list
(written by the trainer, stored by the worker) names it AND its resolved path stays inside the checkpoint
directory (no `..`, no symlink escapes). Range/If-Range/416 come from Starlette's `FileResponse`; the
ETag is the file's sha256, so `If-Range: "<sha256>"` resumes safely.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import shlex
import tarfile
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from api.checkpoint_schemas import CheckpointList, ServeCommand
from api.deps import DB, DownloadReader, Reader, State, releases_db
from api.errors import ApiError
from api.job_lookup import load_job
from api.openapi import AUTH, error_responses, header
from peagle.fileio import atomic_path, atomic_write_text
from peagle.run_folder import (
    archive_cache_file,
    archive_file,
    archive_folder,
    is_complete,
    job_dir,
    resolve_inside,
)
from peagle.spec import metrics as metric_keys
from peagle.spec import portable_verifier
from peagle.spec.files import TRAINING_ONLY_FILES
from service.db import repo
from service.db.models import Checkpoint, Job
from service.settings import Settings

router = APIRouter(prefix="/v1/jobs", tags=["checkpoints"])

Step = Annotated[int, PathParam(ge=0, le=2**31 - 1, description="Checkpoint step.")]

_BINARY = {"schema": {"type": "string", "format": "binary"}}
_TEXT = {"text/plain": {"schema": {"type": "string"}}}
_FILE_HEADERS = {
    "ETag": header("`\"<sha256>\"`: send it as `If-Range` to resume safely."),
    "X-Checksum-SHA256": header("Hex sha256 of the whole file."),
    "Repr-Digest": header("`sha-256=:<base64>:` of the whole file (RFC 9530).", required=False),
    "Accept-Ranges": header("`bytes`."),
    "Content-Disposition": header("`attachment; filename=...`."),
}


def _download_responses(media_type: str) -> dict[int | str, dict[str, Any]]:
    """What Starlette's `FileResponse` answers (Range, If-Range), plus the route's error envelopes."""
    return {
        200: {"content": {media_type: _BINARY}, "description": "The file.", "headers": _FILE_HEADERS},
        206: {"content": {media_type: _BINARY, "multipart/byteranges": _BINARY},
              "description": "Partial content (`Range`; several ranges: `multipart/byteranges`).",
              "headers": {**_FILE_HEADERS, "Content-Range": header("`bytes <start>-<end>/<size>` (one range).",
                                                                    required=False)}},
        **error_responses(*AUTH, 404, 422),
        400: {"content": _TEXT, "description": "Malformed `Range` header."},
        416: {"content": _TEXT, "description": "Range not satisfiable.",
              "headers": {"Content-Range": header("`bytes */<size>`.")}},
    }


_RANGE_PARAMETERS = {"parameters": [
    {"name": "Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "`bytes=<start>-<end>` (one or several ranges)."},
    {"name": "If-Range", "in": "header", "required": False, "schema": {"type": "string"},
     "description": "The `ETag` of a previous answer: the range only if the file is unchanged."},
]}


def _ckpt(session: Any, settings: Settings, job: Job, step: int) -> Checkpoint:
    """The complete checkpoint of `step` whose folder still exists, else 404."""
    ck = repo.get_checkpoint(session, job.id, step)
    if ck is None or not _on_disk(settings, job, ck):
        raise ApiError(404, "not_found", f"job {job.id} has no complete checkpoint at step {step}", param="/step")
    return ck


def _on_disk(settings: Settings, job: Job, ck: Checkpoint) -> bool:
    """Whether the checkpoint's folder is still there and complete (retention deletes old ones)."""
    try:
        return is_complete(_ckpt_dir(settings, job, ck))
    except ApiError:
        return False


def _ckpt_dir(settings: Settings, job: Job, ck: Checkpoint) -> Path:
    """The checkpoint's folder, resolved (404 when its `dir` leaves the job's run folder)."""
    d = resolve_inside(job_dir(settings.resolved_artifact_root(), job.id, artifact_dir=job.artifact_dir), ck.dir)
    if d is None:
        raise ApiError(404, "not_found", "checkpoint directory outside the job's run directory")
    return d


def _checkpoint_out(job: Job, ck: Checkpoint) -> dict[str, Any]:
    base = f"/v1/jobs/{job.id}/checkpoints/{ck.step}"
    m = ck.metrics or {}
    tau = m.get(metric_keys.eval_key(metric_keys.TAU_SIM), m.get(metric_keys.TAU_SIM))
    al = m.get(metric_keys.ACCEPTANCE_LENGTH)
    return {
        "step": ck.step, "dir": ck.dir, "metrics": m,
        "tau_sim": float(tau) if isinstance(tau, int | float) else None,
        "acceptance_length": float(al) if isinstance(al, int | float) else None,
        "is_best": bool(ck.is_best or job.best_checkpoint_step == ck.step),
        "is_latest": job.latest_checkpoint_step == ck.step,
        "files": [{"path": f["path"], "size": int(f.get("size", 0)), "sha256": f.get("sha256", ""),
                   "url": f"{base}/files/{f['path']}"} for f in ck.files or []],
        "created_at": ck.created_at, "archive_url": f"{base}/archive", "serve_url": f"{base}/serve",
        "folder": archive_folder(job.id, ck.step),
        "evaluation": ck.evaluation or None,
    }


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, operation_id="checkpoints-list",
            summary="Complete checkpoints with metrics, best/latest flags and files (size, sha256)",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def list_checkpoints(job_id: str, state: State, session: DB, principal: Reader) -> Any:
    job = load_job(session, principal, job_id)
    return {"object": "list", "data": [_checkpoint_out(job, ck) for ck in repo.list_checkpoints(session, job.id)
                                       if _on_disk(state.settings, job, ck)]}


def _digest_headers(sha: str) -> dict[str, str]:
    headers = {"X-Checksum-SHA256": sha, "ETag": f'"{sha}"'}
    with contextlib.suppress(ValueError):
        headers["Repr-Digest"] = f"sha-256=:{base64.b64encode(bytes.fromhex(sha)).decode()}:"
    return headers


@router.get("/{job_id}/checkpoints/{step}/files/{path:path}", operation_id="checkpoints-download-file",
            summary="Download one checkpoint file (HTTP Range, If-Range; sha256 in X-Checksum-SHA256)",
            response_class=FileResponse, responses=_download_responses("application/octet-stream"),
            openapi_extra=_RANGE_PARAMETERS)
@releases_db
def download_file(job_id: str, step: Step, path: str, state: State, session: DB, principal: DownloadReader) -> Any:
    job = load_job(session, principal, job_id)
    ck = _ckpt(session, state.settings, job, step)
    entry = next((f for f in ck.files or [] if f.get("path") == path), None)
    if entry is None or path.startswith("/") or ".." in Path(path).parts:
        raise ApiError(404, "not_found", f"checkpoint {step} has no file {path!r}", param="/path")
    target = resolve_inside(_ckpt_dir(state.settings, job, ck), path)
    if target is None or not target.is_file():
        raise ApiError(404, "not_found", f"checkpoint {step} has no file {path!r}", param="/path")
    session.close()
    return FileResponse(target, filename=Path(path).name, headers=_digest_headers(str(entry.get("sha256", ""))))


def build_archive(src: Path, files: list[dict[str, Any]], dest: Path, top: str) -> str:
    """Write a deterministic tar of `files` (sorted paths, mtime 0, uid/gid 0, mode 0644) to `dest`.

    Written to a temporary name and renamed, so concurrent builders are safe. Returns its sha256.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()

    class _Hashing(io.RawIOBase):
        def __init__(self, f: Any) -> None:
            self.f = f

        def writable(self) -> bool:
            return True

        def write(self, b: Any) -> int:
            h.update(b)
            return self.f.write(b)

    with atomic_path(dest) as tmp:
        with tmp.open("wb") as raw, tarfile.open(fileobj=_Hashing(raw), mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for f in sorted(files, key=lambda x: x["path"]):
                p = resolve_inside(src, f["path"])
                if p is None or not p.is_file():
                    continue
                info = tarfile.TarInfo(f"{top}/{f['path']}")
                info.size, info.mtime, info.mode = p.stat().st_size, 0, 0o644
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with p.open("rb") as fh:
                    tar.addfile(info, fh)
        sha = h.hexdigest()
        atomic_write_text(dest.with_suffix(".sha256"), sha)
    return sha


@router.get("/{job_id}/checkpoints/{step}/archive", operation_id="checkpoints-archive",
            summary="The checkpoint as a deterministic tar of what vLLM loads (cached, Range-capable)",
            response_class=FileResponse, responses=_download_responses("application/x-tar"),
            openapi_extra=_RANGE_PARAMETERS)
@releases_db
def download_archive(
    job_id: str, step: Step, state: State, session: DB, principal: DownloadReader,
    training_state: Annotated[bool, Query(
        description="Also include training_state.pt (optimizer and RNG state, only needed to resume training; "
                    "several times the size of the weights).")] = False,
) -> Any:
    job = load_job(session, principal, job_id)
    ck = _ckpt(session, state.settings, job, step)
    files = [f for f in ck.files or [] if training_state or f.get("path") not in TRAINING_ONLY_FILES]
    key = hashlib.sha256(json.dumps([job.id, step, files], sort_keys=True).encode()).hexdigest()[:16]
    dest = archive_cache_file(state.settings.home.resolve(), job.id, step, key)
    src = _ckpt_dir(state.settings, job, ck)
    session.close()
    sidecar = dest.with_suffix(".sha256")
    if dest.is_file() and sidecar.is_file():
        sha = sidecar.read_text().strip()
    else:
        sha = build_archive(src, files, dest, archive_folder(job.id, step))
    return FileResponse(dest, filename=archive_file(job.id, step), media_type="application/x-tar",
                        headers=_digest_headers(sha))


def _speedup_note(serving: dict[str, Any], trained_k: int) -> str | None:
    """`Measured in vLLM on cpu AMD EPYC (2 CPUs): batch 1: K=2 fastest, 1.15x faster; batch 8: slower at
    every K (best 0.62x): serve without the draft there.` None when nothing was measured."""
    recs = serving.get("recommended") or []
    if not recs:
        return None
    hw = serving.get("hardware") or {}
    where = hw.get("gpu") or f"{hw.get('cpu') or 'an unknown CPU'} ({hw.get('cpu_count')} CPUs)"
    parts = []
    for r in recs:
        k, x = int(r.get("num_speculative_tokens") or 0), float(r.get("speedup") or 0.0)
        if k:
            parts.append(f"batch {r['batch_size']}: K={k} fastest, {x:.2f}x faster")
        else:
            parts.append(f"batch {r['batch_size']}: slower than the verifier alone at every K "
                         f"(best {x:.2f}x, {1 / x if x else float('inf'):.2f}x slower): serve without the draft there")
    chosen = next((int(r["num_speculative_tokens"]) for r in sorted(recs, key=lambda r: int(r["batch_size"]))
                   if r.get("num_speculative_tokens")), None)  # fmt: skip
    tail = (f" The long form uses K={chosen} (trained: {trained_k})." if chosen and chosen != trained_k else "")
    schedule = (serving.get("recommended_speculative_config") or {}).get("num_speculative_tokens_per_batch_size")
    if schedule:
        said = [f"{'no draft' if not k else f'K={k}'} at batch {a}" + (f"-{b}" if b > a else "")
                for a, b, k in schedule]
        tail += (" By batch size (vLLM's num_speculative_tokens_per_batch_size; the last range holds for every "
                 "larger batch; vLLM 0.32 serves a P-EAGLE draft at one K or none): " + ", ".join(said) + ".")
    return f"Measured in vLLM on {hw.get('device', '?')} {where}: " + "; ".join(parts) + "." + tail


@router.get("/{job_id}/checkpoints/{step}/serve", response_model=ServeCommand, operation_id="checkpoints-serve",
            summary="The exact `vllm serve` command for this checkpoint",
            responses=error_responses(*AUTH, 404, 422))
@releases_db
def serve_command(job_id: str, step: Step, state: State, session: DB, principal: Reader) -> Any:
    job = load_job(session, principal, job_id)
    ck = _ckpt(session, state.settings, job, step)
    d = _ckpt_dir(state.settings, job, ck)
    spec = job.resolved_spec or job.spec
    named = spec.get("target") or {}
    verifier = portable_verifier(str(named.get("model", "")), named.get("name_or_path")) or named.get("model", "")
    k = (spec.get("eval") or {}).get("num_speculative_tokens") or (spec.get("peagle") or {}).get("num_depths", 8)
    try:
        cfg = json.loads((d / "config.json").read_text())
        sc = cfg.get("speculators_config") or {}
        verifier = (sc.get("verifier") or {}).get("name_or_path") or verifier
        props = sc.get("proposal_methods") or []
        if props and props[0].get("speculative_tokens"):
            k = props[0]["speculative_tokens"]
    except (OSError, ValueError, AttributeError):
        pass
    # No server path in the answer: the draft is the folder the archive unpacks to (and `peagle jobs download`
    # writes by default), and a verifier an older export named by a host folder (a builtin's cache) is
    # named portably from the job's own spec (`peagle.spec.targets`).
    name = archive_folder(job.id, step)
    target = job.spec.get("target") or {}
    own = {target.get(k) for k in ("model", "name_or_path")} - {None}
    if str(verifier).startswith("/") and verifier not in own:
        verifier = portable_verifier(str(target.get("model", "")), target.get("name_or_path")) or target.get("model")
    serving = (ck.evaluation or {}).get("serving") or {}
    measured = serving.get("recommended_speculative_config") or {}
    spec_cfg = {"model": f"./{name}", "method": "eagle3",
                "num_speculative_tokens": int(measured.get("num_speculative_tokens") or k), "parallel_drafting": True}
    if measured.get("num_speculative_tokens_per_batch_size"):  # the K schedule (peagle.eval.speedup.k_schedule)
        spec_cfg["num_speculative_tokens_per_batch_size"] = measured["num_speculative_tokens_per_batch_size"]
    return {
        "recommended": serving.get("recommended") or [],
        "speedup_note": _speedup_note(serving, int(k)),
        "command": f"vllm serve {shlex.quote('./' + name)}",
        "long_command": f"vllm serve {shlex.quote(str(verifier))} --speculative-config "
        f"{shlex.quote(json.dumps(spec_cfg))}",
        "speculative_config": spec_cfg, "model_dir": name,
        "note": None if not str(verifier).startswith("builtin:") else (
            f"{verifier} has no hub copy (random test weights): on a machine with peagle, `peagle fixtures tiny` "
            "builds it and prints its folder; use that folder as the verifier of the long form"),
    }
