"""Service settings (pydantic-settings, `PEAGLE_` prefix), built by `get_settings()`.

Nothing is read at import time: call `get_settings()` where settings are needed (the FastAPI lifespan,
the Celery worker init, a CLI command) and pass the object down.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["DEFAULT_SECRET_KEY", "MIN_SECRET_KEY_CHARS", "Settings", "get_settings"]

DEFAULT_SECRET_KEY = "dev-insecure-change-me"
MIN_SECRET_KEY_CHARS = 32


class Settings(BaseSettings):
    """Every knob of the API and the workers. Environment: `PEAGLE_<FIELD>` (e.g. `PEAGLE_DATABASE_URL`)."""

    model_config = SettingsConfigDict(env_prefix="PEAGLE_", extra="ignore")

    embedded: bool = Field(
        default=True,
        description="Embedded default: SQLite + Celery filesystem broker + local artifacts (no services).",
    )
    home: Path = Field(default=Path(".peagle"), description="Root of embedded-mode state (db, broker, artifacts).")
    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; default sqlite:///<home>/peagle.db in embedded mode."
    )
    broker_url: str | None = Field(
        default=None, description="Celery broker; default filesystem:// under <home>/broker in embedded mode."
    )
    redis_url: str | None = Field(
        default=None, description="Redis for the live channel; None = database polling (embedded)."
    )
    artifact_root: Path | None = Field(default=None, description="Where jobs write checkpoints; default <home>/artifacts.")
    dataset_root: Path | None = Field(default=None, description="Uploaded datasets; default <home>/datasets.")
    secret_key: str = Field(default=DEFAULT_SECRET_KEY, description="Signs session cookies and stream tokens, "
                            "and (HKDF-derived) encrypts webhook secrets. Outside embedded mode the API refuses "
                            f"to start with the default or one shorter than {MIN_SECRET_KEY_CHARS} characters.")
    secret_key_previous: str = Field(default="", description="The key before the last rotation: still accepted "
                                     "to decrypt webhook secrets (re-encrypted under secret_key when next read).")
    webhook_allow_hosts: str = Field(default="", description="Comma-separated host names, IP addresses or CIDR "
                                     "networks webhooks may reach although they are internal (empty: none).")
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1, description="Largest dataset upload.")
    max_draft_upload_bytes: int = Field(
        default=2 * 1024**3, ge=1, description="Largest uploaded draft (`POST /v1/drafts`, a tar or zip of an "
        "export folder for warm starts): the archive, and again the files it unpacks to, in total.")
    max_request_body_bytes: int = Field(
        default=1024 * 1024, ge=1024, description="Largest request body but a dataset upload's: a longer "
        "`Content-Length` is 413 before the body is read, a chunked body is cut at it (413).")
    max_concurrent_jobs: int = Field(default=4, ge=1, description="Per owner: running jobs.")
    max_queued_jobs: int = Field(default=100, ge=1, description="Per owner: queued jobs.")
    max_upload_bytes_per_owner: int = Field(
        default=10 * 1024**3, ge=1, description="Per owner: bytes on disk of every upload kept, datasets and "
        "drafts together (a draft counts what it unpacks to). Uploads in flight hold what they have written "
        "(an archive and what it unpacked so far), so uploads at once stay within it too; past it 429 "
        "`quota_exceeded`.")
    max_datasets_per_owner: int = Field(
        default=1000, ge=1, description="Per owner: uploaded datasets kept; one more upload is refused with 409 "
        "`dataset_limit_reached` before its body is read.")
    max_dataset_uploads_per_hour: int = Field(
        default=60, ge=1, description="Per owner: dataset uploads in any rolling hour; beyond it 429 "
        "`rate_limited` with `Retry-After` (seconds until the oldest upload of the hour ages out).")
    max_drafts_per_owner: int = Field(
        default=100, ge=1, description="Per owner: uploaded drafts kept (invalid ones too, until deleted); one "
        "more upload is refused with 409 `draft_limit_reached` before its body is read.")
    max_draft_uploads_per_hour: int = Field(
        default=20, ge=1, description="Per owner: draft uploads in any rolling hour; beyond it 429 "
        "`rate_limited` with `Retry-After`, as for datasets.")
    max_dataset_row_bytes: int = Field(
        default=8 * 1024**2, ge=1024, description="Largest single row (JSONL line or array element) of an "
        "uploaded dataset; a dataset with a bigger row is `invalid`, its report naming the line.")
    max_concurrent_validations: int = Field(
        default=2, ge=1, description="Per API process: sandboxed validator subprocesses (datasets and drafts "
        "together) running at once; further uploads wait (their request stays open) until one finishes.")
    sandbox_memory_bytes: int = Field(
        default=4 * 1024**3, ge=64 * 1024**2, description="Address space (RLIMIT_AS) of each child that parses "
        "uploaded bytes (the dataset and draft validators, `peagle.engine.sandbox`); past it the upload is "
        "refused: \"validation stopped: it exceeded the 4 GiB memory limit\". The draft validator imports torch "
        "(about 650 MiB) and maps the draft's weights.")
    sandbox_cpu_seconds: int = Field(
        default=600, ge=1, description="CPU seconds (RLIMIT_CPU, all threads) of each sandboxed child; past "
        "it the upload is refused naming the CPU time limit.")
    sandbox_file_bytes: int = Field(
        default=64 * 1024**2, ge=1024**2, description="Largest file a sandboxed child may write (RLIMIT_FSIZE; "
        "the validators write none).")
    sandbox_wall_seconds: float = Field(
        default=300.0, gt=0, le=3600, description="Wall-clock limit of each sandboxed child: past it its "
        "process group is killed and the upload refused naming the limit. Leftover `.partial-*` uploads "
        "are swept at API start once this much (plus 60 s) older than the start.")
    model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list, description="Folders whose models API jobs may name as an absolute "
        "`target.model` path (`os.pathsep`-separated, or a JSON list); empty = hub ids and builtins only.")
    vllm_on_workers: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Whether the workers can run the vLLM target engine (`resources.target_engine`): "
        "auto = whether this machine can (embedded mode: the API and the worker share it; `make vllm-env`). The "
        "dry run resolves `target_engine: auto` by it, and a job asking for `vllm` where it is `no` is refused.")
    worker_queue: str = Field(default="cpu", description="Celery queue this worker consumes (per GPU kind).")
    worker_gpus: int | None = Field(
        default=None, ge=0, description="GPUs this worker announces (`service.db.workers`); None = those it "
        "sees (CUDA_VISIBLE_DEVICES, else nvidia-smi).")
    worker_check: Literal["auto", "yes", "no"] = Field(
        default="auto", description="Whether the API refuses a job that no live worker can take (none consumes "
        "its queue, or none has resources.gpus GPUs): auto = once workers have announced themselves to the "
        "database; yes = always (no worker running is refused too); no = never.")
    engine_keep_warm_seconds: float = Field(
        default=600.0, ge=0, description="An engine worker (`python -m worker --role engine`) keeps its `vllm serve` "
        "this long after its last chunk for the next chunk of the same engine configuration (target, revision, "
        "dtype, parallelism, mode); it stops it sooner when a chunk needs another configuration.")
    engine_chunk_resend_seconds: float = Field(
        default=600.0, gt=0, description="A split job's engine chunk still unclaimed this long after it was sent "
        "is sent again (its message was lost); a duplicate is harmless (the claim is conditional). Long enough "
        "that a healthy engine queue (at most `resources.engine.replicas` chunks of the job ahead, an engine "
        "start each) rarely trips it.")
    heartbeat_seconds: float = Field(default=5.0, gt=0, description="Worker lease heartbeat interval.")
    lease_seconds: float = Field(default=60.0, gt=0, description="A job whose heartbeat is older is requeued.")
    kill_grace_seconds: float = Field(default=60.0, gt=0, description="SIGTERM -> SIGKILL grace for trainers.")
    shutdown_grace_seconds: float = Field(
        default=45.0, gt=0,
        description="When the worker itself gets SIGTERM (`docker compose stop`): how long its running trainer "
        "may take to save a checkpoint before SIGKILL (the job is requeued either way). Keep it below the "
        "container's stop_grace_period (60 s in docker-compose.yml).")
    requeue_lost_after_seconds: float = Field(
        default=120.0, gt=0,
        description="Reaper: a queued job whose broker message is gone (Redis lost its data, a consumer "
        "dropped it) is sent again once it has been queued this long. A duplicate is harmless.")
    trainer_command: str | None = Field(
        default=None,
        description="Command prefix the worker runs as the trainer (shell words, then `train SPEC ...`); "
        "default `<python> -m peagle`. Tests substitute a fake trainer.",
    )
    webhook_max_attempts: int = Field(default=8, ge=1, le=50, description="Delivery attempts before a webhook "
                                      "message is marked failed.")
    webhook_retry_base_seconds: float = Field(default=5.0, gt=0, description="Webhook back-off: base, 4x, 16x, "
                                              "... seconds (capped at 1 h).")
    webhook_timeout_seconds: float = Field(default=10.0, gt=0, description="Per-attempt webhook HTTP timeout.")
    webhook_poll_seconds: float = Field(default=1.0, gt=0, description="How often the dispatcher looks for "
                                        "new job events and due deliveries.")
    max_webhooks_per_owner: int = Field(default=20, ge=1, description="Per owner: webhook endpoints.")
    webhook_tests_per_minute: int = Field(default=5, ge=1, description="Per owner: `POST /v1/webhooks/{id}/test` "
                                          "messages queued in any 60 s (past it: 429 with Retry-After).")
    db_pool_size: int = Field(default=28, ge=1, le=1000, description="Pooled database connections per API "
                              "process (PostgreSQL and SQLite): as many as the API's request threads (24) and "
                              "some, so a thread never waits for a connection held by a request that waits "
                              "for a thread.")
    db_pool_overflow: int = Field(default=8, ge=0, le=1000, description="Connections past `db_pool_size` opened "
                                  "under a burst (closed when returned).")
    db_pool_timeout_s: float = Field(default=30.0, gt=0, le=600, description="How long a request waits for a "
                                     "pooled connection before it answers 500.")
    read_pool_size: int = Field(default=4, ge=1, description="PostgreSQL only: connections per API process of "
                                "the async pool that serves job lists on the event loop (service.db.aio); 4 kept up "
                                "with 100 closed-loop clients (2 or 8 were no faster).")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level of the Celery worker and its reaper.")
    port: int = Field(default=8000, ge=1, le=65535, description="`make run`: the port the API and dashboard "
                      "listen on (host 127.0.0.1); `make run` says so and stops when it is taken.")
    http_header_timeout_s: float = Field(
        default=20.0, gt=0, le=600, description="The API server (`--http api.timeouts:HttpProtocol`): a request's "
        "line and headers must arrive within this time of the connection opening (or of the next request's first "
        "byte on a kept-alive one), else 408 and the connection is closed.")
    http_body_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="The API server: a request body must arrive within this time of "
        "its headers, plus 1 s per `http_body_min_bytes_per_s` received (an upload at that rate is never cut), "
        "else 408 (or a closed connection once an answer has started).")
    http_body_min_bytes_per_s: int = Field(
        default=32 * 1024, ge=1, description="The API server: the slowest body rate that is not cut at the body "
        "timeout (bytes per second, averaged over the body so far).")
    http_max_connections: int = Field(
        default=1000, ge=1, description="The API server: open connections per process (SSE streams included); "
        "one more is answered 503 and closed at its first request head, which the header timeout bounds.")

    @field_validator("model_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else [p for p in text.split(os.pathsep) if p]
        return value

    def vllm_available(self) -> bool:
        """Whether the workers can start a vLLM engine (`vllm_on_workers`; auto = this machine can)."""
        if self.vllm_on_workers != "auto":
            return self.vllm_on_workers == "yes"
        from peagle.engine.locate import vllm_available

        return vllm_available()

    def secret_key_problem(self) -> str | None:
        """Why `secret_key` is unfit outside embedded mode (None when it is fine, or when embedded)."""
        if self.embedded:
            return None
        if self.secret_key == DEFAULT_SECRET_KEY:
            return "PEAGLE_SECRET_KEY is the built-in default (anyone can forge sessions and tokens)"
        if len(self.secret_key) < MIN_SECRET_KEY_CHARS:
            return f"PEAGLE_SECRET_KEY is shorter than {MIN_SECRET_KEY_CHARS} characters"
        return None

    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite:///{(self.home / 'peagle.db').resolve()}"

    def resolved_broker_url(self) -> str:
        if self.broker_url:
            return self.broker_url
        return "filesystem://"

    def resolved_artifact_root(self) -> Path:
        return (self.artifact_root or self.home / "artifacts").resolve()

    def resolved_dataset_root(self) -> Path:
        return (self.dataset_root or self.home / "datasets").resolve()

    def broker_folder(self) -> Path:
        """Folder of the embedded `filesystem://` broker."""
        return (self.home / "broker").resolve()


def get_settings(**overrides: object) -> Settings:
    """Build settings from the environment, with explicit overrides (tests pass them)."""
    return Settings(**overrides)  # type: ignore[arg-type]
