"""Typed HTTP client of the peagle service (httpx; torch-free; never imports the service code).

    with PeagleClient("http://127.0.0.1:8000", api_key) as c:
        job = c.submit(preset="tiny", idempotency_key="run-1")
        for rec in c.stream(job["id"], "logs"):          # SSE, reconnects with Last-Event-ID
            print(rec["message"])
        c.download_checkpoint(job["id"], step=None, dest=Path("draft/"))   # best checkpoint, sha256-checked

Errors of the service raise `ServiceError` (status, code, message, param, details).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, TypedDict

import httpx

from peagle.errors import PeagleError
from peagle.spec.files import TRAINING_ONLY_FILES

__all__ = ["JobDict", "PeagleClient", "ServiceError"]

StreamKind = Literal["events", "metrics", "logs"]


class JobDict(TypedDict, total=False):
    """A job as the API returns it (see the OpenAPI schema `JobOut`)."""

    id: str
    name: str
    tags: list[str]
    status: str
    phase: str | None
    progress: dict[str, Any]
    attempt: int
    error: dict[str, Any] | None
    best_checkpoint_step: int | None
    latest_checkpoint_step: int | None
    spec: dict[str, Any]
    created_at: str


class ServiceError(PeagleError):
    """An error answer of the service (the `{"error": {...}}` envelope)."""

    code = "service_error"

    def __init__(self, status: int, code: str, message: str, param: str | None = None,
                 details: list[Any] | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.param, self.details = status, code, message, param, details or []


class PeagleClient:
    """Client of the `/v1` API. `api_key` is sent as `Authorization: Bearer`."""

    def __init__(self, base_url: str, api_key: str | None, *, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout,
                                 transport=transport)

    def __enter__(self) -> PeagleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _raise(r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            raise ServiceError(r.status_code, "http_error", r.text[:500]) from None
        raise ServiceError(r.status_code, err.get("code", "error"), err.get("message", ""), err.get("param"),
                           err.get("details"))

    def _req(self, method: str, url: str, **kw: Any) -> Any:
        r = self.http.request(method, url, **kw)
        self._raise(r)
        return r.json() if r.content else None

    # ------------------------------------------------------------------ jobs
    def submit(self, spec: dict[str, Any] | None = None, *, preset: str | None = None,
               overrides: dict[str, Any] | None = None, name: str | None = None, tags: list[str] | None = None,
               idempotency_key: str | None = None, dry_run: bool = False) -> JobDict:
        """Create a job (or, with `dry_run`, get its estimate)."""
        body = {k: v for k, v in {"spec": spec, "preset": preset, "overrides": overrides, "name": name,
                                  "tags": tags}.items() if v is not None}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
        return self._req("POST", "/v1/jobs", json=body, headers=headers,
                         params={"dry_run": "true"} if dry_run else None)

    def list_jobs(self, *, status: list[str] | None = None, tag: str | None = None, q: str | None = None,
                  limit: int = 50) -> Iterator[JobDict]:
        """Every matching job, newest first (follows the cursor pages)."""
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": limit, "status": status or [], "tag": tag, "q": q, "after": after}
            page = self._req("GET", "/v1/jobs", params={k: v for k, v in params.items() if v not in (None, [])})
            yield from page["data"]
            if not page["has_more"]:
                return
            after = page["next_after"]

    def get_job(self, job_id: str) -> JobDict:
        return self._req("GET", f"/v1/jobs/{job_id}")

    def action(self, job_id: str, action: Literal["cancel", "pause", "resume"]) -> JobDict:
        return self._req("POST", f"/v1/jobs/{job_id}/{action}")

    def clone(self, job_id: str, overrides: dict[str, Any] | None = None) -> JobDict:
        return self._req("POST", f"/v1/jobs/{job_id}/clone", json={"overrides": overrides or {}})

    def retrain(self, job_id: str, *, datasets: list[str] | None = None, sources: list[dict[str, Any]] | None = None,
                **body: Any) -> JobDict:
        """`POST /v1/jobs/{id}/retrain`: the child job (`body`: overrides, checkpoint_step,
        promotion_batch_sizes, name, tags; docs/retrain.md)."""
        payload = {"datasets": datasets or [], "sources": sources or [],
                   **{k: v for k, v in body.items() if v is not None}}
        return self._req("POST", f"/v1/jobs/{job_id}/retrain", json=payload)

    def promotion(self, what: Literal["current", "decisions"], **params: Any) -> list[dict[str, Any]]:
        """The current drafts or the promotion decisions (`target`, `job_id` filters)."""
        page = self._req("GET", f"/v1/promotion/{what}", params={k: v for k, v in params.items() if v is not None})
        return list(page["data"])

    def promote(self, job_id: str, checkpoint_step: int | None = None) -> dict[str, Any]:
        """Force `job_id` to be the current draft of its target."""
        body: dict[str, Any] = {"job_id": job_id}
        if checkpoint_step is not None:
            body["checkpoint_step"] = checkpoint_step
        return self._req("POST", "/v1/promotion/promote", json=body)

    def undo_promotion(self, target: str) -> dict[str, Any]:
        """The current draft of `target` goes back to the one before."""
        return self._req("POST", "/v1/promotion/undo", json={"target": target})

    def page(self, job_id: str, kind: StreamKind, **params: Any) -> dict[str, Any]:
        """One page of events/metrics/logs (`after`, `limit`, metric `keys`/`max_points`, log `tail`)."""
        return self._req("GET", f"/v1/jobs/{job_id}/{kind}", params={k: v for k, v in params.items() if v is not None})

    def stream(self, job_id: str, kind: StreamKind, *, after: int = 0, reconnect: bool = True,
               retry_s: float = 1.0) -> Iterator[dict[str, Any]]:
        """Records of a job's SSE stream in order, until the job ends; reconnects with Last-Event-ID."""
        last = after
        while True:
            try:
                with self.http.stream("GET", f"/v1/jobs/{job_id}/{kind}/stream",
                                      headers={"Last-Event-ID": str(last), "Accept": "text/event-stream"},
                                      timeout=httpx.Timeout(self.http.timeout.connect, read=None)) as r:
                    if r.status_code >= 400:
                        r.read()
                        self._raise(r)
                    event: dict[str, str] = {}
                    for line in r.iter_lines():
                        if line == "":
                            if event.get("event") == "end":
                                return
                            if "data" in event and "id" in event:
                                last = int(event["id"])
                                yield json.loads(event["data"])
                            event = {}
                        elif not line.startswith(":"):
                            field, _, value = line.partition(":")
                            event[field] = value[1:] if value.startswith(" ") else value
            except (httpx.TransportError, httpx.RemoteProtocolError):
                if not reconnect:
                    raise
            time.sleep(retry_s)

    # ------------------------------------------------------------------ checkpoints
    def checkpoints(self, job_id: str) -> list[dict[str, Any]]:
        return self._req("GET", f"/v1/jobs/{job_id}/checkpoints")["data"]

    def serve_command(self, job_id: str, step: int) -> dict[str, Any]:
        return self._req("GET", f"/v1/jobs/{job_id}/checkpoints/{step}/serve")

    def download_file(self, url: str, dest: Path, sha256: str | None = None) -> Path:
        """Download `url` to `dest`, resuming a partial file with Range + If-Range; checks sha256."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={have}-", "If-Range": f'"{sha256}"'} if have and sha256 else {}
        with self.http.stream("GET", url, headers=headers) as r:
            if r.status_code == 416:
                have, mode = 0, "wb"
            else:
                if r.status_code >= 400:
                    r.read()
                    self._raise(r)
                mode = "ab" if r.status_code == 206 else "wb"
                with part.open(mode) as fh:
                    for chunk in r.iter_bytes():
                        fh.write(chunk)
        if sha256:
            h = hashlib.sha256()
            with part.open("rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
            if h.hexdigest() != sha256:
                part.unlink()
                raise ServiceError(200, "checksum_mismatch", f"{url}: sha256 {h.hexdigest()} != {sha256}")
        part.replace(dest)
        return dest

    def select_checkpoint(self, job_id: str, step: int | None) -> dict[str, Any]:
        """The checkpoint at `step` (None: the best, else the latest)."""
        cks = self.checkpoints(job_id)
        if not cks:
            raise ServiceError(404, "not_found", f"job {job_id} has no complete checkpoint yet")
        if step is None:
            return next((c for c in cks if c["is_best"]), None) or next((c for c in cks if c["is_latest"]), cks[-1])
        at_step = next((c for c in cks if c["step"] == step), None)
        if at_step is None:
            raise ServiceError(404, "not_found", f"job {job_id} has no checkpoint at step {step}")
        return at_step

    def download_checkpoint(self, job_id: str, step: int | None, dest: Path, *,
                            training_state: bool = False) -> list[Path]:
        """Download a checkpoint (`step=None`: the best, else the latest) into `dest`.

        By default only what `vllm serve` reads (config.json, model.safetensors, ...); the optimizer and
        RNG state (`training_state.pt`, several times the weights' size) only with `training_state=True`.
        """
        ck = self.select_checkpoint(job_id, step)
        files = [f for f in ck["files"] if training_state or f["path"] not in TRAINING_ONLY_FILES]
        return [self.download_file(f["url"], dest / f["path"], f["sha256"]) for f in files]

    # ------------------------------------------------------------------ datasets
    def upload_dataset(self, path: Path, fmt: str = "auto") -> dict[str, Any]:
        with path.open("rb") as fh:
            return self._req("POST", "/v1/datasets", files={"file": (path.name, fh)}, data={"format": fmt},
                             timeout=None)

    # ------------------------------------------------------------------ uploaded drafts
    def upload_draft(self, path: Path) -> dict[str, Any]:
        """Upload a draft checkpoint for warm starts (`POST /v1/drafts`; docs/warm_start.md): an export folder
        is packed as a tar.gz (its files under one top folder, in a temporary file), an archive (.tar, .tar.gz,
        .tgz, .zip) is sent as it is. Returns the draft: `id`, `status` (`ready` or `invalid`, `report.error`
        says why), `init_from` (`draft:<id>`, for a spec's `draft.init_from`)."""
        import tarfile
        import tempfile

        if not path.is_dir():
            with path.open("rb") as fh:
                return self._req("POST", "/v1/drafts", files={"file": (path.name, fh)}, timeout=None)
        files = sorted(f for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        if not files:
            raise PeagleError(f"{path}: an empty folder (an export folder holds config.json and the weights)")
        with tempfile.TemporaryFile(suffix=".tar.gz") as tmp:
            with tarfile.open(fileobj=tmp, mode="w:gz") as tar:
                for f in files:
                    tar.add(f, arcname=f"{path.name}/{f.relative_to(path).as_posix()}", recursive=False)
            tmp.seek(0)
            return self._req("POST", "/v1/drafts", files={"file": (f"{path.name}.tar.gz", tmp)}, timeout=None)

    def list_drafts(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """The owner's uploaded drafts, newest first (every page)."""
        out: list[dict[str, Any]] = []
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": min(limit, 200), **({"after": after} if after else {})}
            page = self._req("GET", "/v1/drafts", params=params)
            out.extend(page["data"])
            if not page["has_more"] or len(out) >= limit:
                return out[:limit]
            after = page["next_after"]

    def get_draft(self, draft_id: str) -> dict[str, Any]:
        return self._req("GET", f"/v1/drafts/{draft_id}")

    def delete_draft(self, draft_id: str) -> None:
        """Delete an uploaded draft (refused, 409, while an unfinished job starts from it)."""
        self._req("DELETE", f"/v1/drafts/{draft_id}")
