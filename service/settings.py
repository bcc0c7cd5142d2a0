"""Service settings (pydantic-settings, `PEAGLE_` prefix), built by `get_settings()`.

Nothing is read at import time: call `get_settings()` where settings are needed (the FastAPI lifespan,
the Celery worker init, a CLI command) and pass the object down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "get_settings"]


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
    secret_key: str = Field(default="dev-insecure-change-me", description="Signs short-lived stream tokens.")
    max_upload_bytes: int = Field(default=512 * 1024 * 1024, ge=1, description="Largest dataset upload.")
    max_concurrent_jobs: int = Field(default=4, ge=1, description="Per owner: running jobs.")
    max_queued_jobs: int = Field(default=100, ge=1, description="Per owner: queued jobs.")
    max_upload_bytes_per_owner: int = Field(default=10 * 1024**3, ge=1, description="Per owner: total uploads.")
    worker_queue: str = Field(default="cpu", description="Celery queue this worker consumes (per GPU kind).")
    heartbeat_seconds: float = Field(default=5.0, gt=0, description="Worker lease heartbeat interval.")
    lease_seconds: float = Field(default=60.0, gt=0, description="A job whose heartbeat is older is requeued.")
    kill_grace_seconds: float = Field(default=60.0, gt=0, description="SIGTERM -> SIGKILL grace for trainers.")
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
    read_pool_size: int = Field(default=4, ge=1, description="PostgreSQL only: connections per API process of "
                                "the async pool that serves job lists on the event loop (service.db.aio); 4 kept up "
                                "with 100 closed-loop clients (2 or 8 were no faster).")
    log_level: Literal["debug", "info", "warning", "error"] = "info"

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
