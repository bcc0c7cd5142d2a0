"""The thin supervisor of one job attempt: trainer child process -> database + live channel.

    Supervisor(settings, factory, lease, send_task=..., publisher=...).run()  -> final status

1. Writes the job spec into the run directory (`artifact_root/<job_id>/job_spec.json`) and starts the
   trainer (`worker.trainer`: `python -m peagle train SPEC --out RUN --progress-jsonl - --resume auto`,
   under `torchrun` for several GPUs, in its own process group, dying with the worker, with an
   allow-listed environment that holds none of the worker's secrets).
2. Reader threads collect its stdout (JSON lines) and stderr; the loop writes a batch every
   `flush_seconds` (one transaction, fenced by the lease) and wakes live listeners on Redis.
3. Every `heartbeat_seconds` it extends the lease and reads the desired state: pause/cancel send SIGTERM
   to the trainer's group (it checkpoints and exits 75), SIGKILL after `kill_grace_seconds`. SIGTERM to
   the supervisor's own process (the worker is shutting down, `worker.app.stop_running_jobs`) does the
   same within `shutdown_grace_seconds`, then requeues the job (attempt + 1) to resume from that checkpoint.
4. On exit it maps the exit code to the job's final state and error code (`worker.outcome`, with
   `worker.trainer.classify_exit`).
   A trainer killed by a signal it was not sent is a crash, and so is a target engine that failed
   (`engine_failed`): the job is requeued (attempt+1, resumes from its last complete checkpoint, its
   prepared data and the owner's regeneration cache) up to `max_restarts`, then fails with that code.

What the job's owner reads (events, logs, errors, provenance) names no server path, host, pid or service
address (`worker.redact`); the worker log keeps them for operators.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from peagle.engine.procs import signal_group
from peagle.errors import EXIT_CODES
from peagle.fileio import atomic_write_json, read_json
from peagle.run_folder import CHECKPOINTS, complete_checkpoints, is_complete, job_dir, step_dirname
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec
from service.db import states
from service.db.init_from import init_source
from service.db.lease import (
    Lease,
    LeaseLost,
    complete_checkpoint_steps,
    dataset_files,
    heartbeat,
    job_owner_id,
    job_status,
)
from service.db.progress import Batch, ingest
from service.db.session import session_scope
from service.settings import Settings
from worker.live import Publisher
from worker.outcome import Ending, Outcome, decide_ending, record_crash, record_ending
from worker.progress import ProgressCollector, recover
from worker.provenance import worker_provenance
from worker.redact import Redactor
from worker.refs import dataset_refs, localize_datasets, public_spec
from worker.streams import TrainerOutput, stderr_parts
from worker.trainer import build_command, start_trainer, trainer_env, trainer_environment

__all__ = ["Outcome", "Supervisor"]

log = logging.getLogger(__name__)


class Supervisor:
    """Runs one attempt of one job; see the module docstring."""

    def __init__(self, settings: Settings, factory: sessionmaker[Session], lease: Lease, *,
                 send_task: Callable[[str, str], str] | None = None, publisher: Publisher | None = None,
                 flush_seconds: float = 0.5) -> None:
        self.settings = settings
        self.factory = factory
        self.lease = lease
        self.send_task = send_task
        self.publisher = publisher
        self.flush_seconds = flush_seconds
        self.run_dir = job_dir(settings.resolved_artifact_root(), lease.job_id)
        self.collector = ProgressCollector()
        self.stderr_tail: deque[str] = deque(maxlen=200)
        self.proc: subprocess.Popen[str] | None = None
        self.status = states.RUNNING
        self.term_sent_at: float | None = None
        self.kill_sent = False
        self.checkpoints_at_term = 0
        self.shutdown = False
        self.have_run_files = False
        self._have_resolved = False
        self._files_checked_at = 0.0
        self._known_steps: set[int] = set()
        self.worker_prov: dict[str, Any] = {}
        self.engine_env: dict[str, str] = {}
        self.dispatcher: Any = None  # a split job's chunk dispatcher (`worker.dispatch`, resources.engine)
        self.redact = Redactor(settings, self.run_dir)  # what clients see names no server path

    # ---------------------------------------------------------------- process control

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(PermissionError):
            signal_group(self.proc, sig)

    def _request_stop(self, why: str) -> None:
        if self.term_sent_at is None:
            self.term_sent_at = time.monotonic()
            self.checkpoints_at_term = self.collector.checkpoints_seen
            self.collector.event("stopping", f"{why}: SIGTERM sent to the trainer (it saves a checkpoint)")
            self._signal_group(signal.SIGTERM)

    def _on_sigterm(self, _signum: int, _frame: Any) -> None:
        self.shutdown = True  # the worker is stopping: checkpoint, then requeue the job

    def _grace(self) -> float:
        """SIGTERM -> SIGKILL grace: a stopping worker has only `shutdown_grace_seconds` (below the
        container's stop_grace_period), a pause or cancel `kill_grace_seconds`."""
        if self.shutdown:
            return min(self.settings.kill_grace_seconds, self.settings.shutdown_grace_seconds)
        return self.settings.kill_grace_seconds

    # ---------------------------------------------------------------- database

    def _flush(self, *, final: bool = False) -> None:
        """Write the pending batch (retrying later on database errors); raises LeaseLost."""
        self._pick_up_run_files(force=final)
        if final:
            self.collector.release()
        batch = self.collector.take()
        if not batch:
            return
        try:
            with session_scope(self.factory) as s:
                seqs = ingest(s, self.lease, batch)
        except SQLAlchemyError as exc:
            log.warning("job %s: database write failed (%s); retrying", self.lease.job_id, exc)
            self._requeue_batch(batch)
            if final:
                raise
            return
        if self.publisher is not None:
            self.publisher.publish(self.lease.job_id, seqs, self.status)

    def _requeue_batch(self, batch: Batch) -> None:
        pending = self.collector.take()
        for f in dataclasses.fields(pending):  # lists append; single values: the newer one wins
            value = getattr(pending, f.name)
            if isinstance(value, list):
                getattr(batch, f.name).extend(value)
            elif value is not None:
                setattr(batch, f.name, value)
        self.collector.batch = batch

    def _pick_up_run_files(self, force: bool = False) -> None:
        """Fold the trainer's resolved spec + provenance into the job row (once); prune deleted checkpoints."""
        batch = self.collector.batch
        now = time.monotonic()
        if not self.have_run_files and (force or now - self._files_checked_at > 2.0):
            self._files_checked_at = now
            if not self._have_resolved:
                resolved = read_json(self.run_dir / "resolved_spec.json")
                if resolved is not None:
                    batch.resolved_spec = self._public_spec(resolved)
                    self._have_resolved = True
            trainer = read_json(self.run_dir / "provenance.json")
            if trainer is not None:
                batch.provenance = {"worker": self.worker_prov, "trainer": self.redact.value(trainer)}
                self.have_run_files = self._have_resolved
        if batch.checkpoints:
            new = {int(c["step"]) for c in batch.checkpoints}
            ck_root = self.run_dir / CHECKPOINTS
            gone = sorted(s for s in self._known_steps - new if not is_complete(ck_root / step_dirname(s)))
            batch.missing_checkpoint_steps = gone
            self._known_steps = (self._known_steps | new) - set(gone)

    def _heartbeat(self) -> None:
        with session_scope(self.factory) as s:
            control = heartbeat(s, self.lease, lease_seconds=self.settings.lease_seconds)
        self.status = control.status
        if control.status == states.PAUSING or control.desired_state == states.PAUSED:
            self._request_stop("pause requested")
        elif control.status == states.CANCELLING or control.desired_state == states.CANCELLED:
            self._request_stop("cancel requested")

    # ---------------------------------------------------------------- main loop

    def run(self) -> str:
        """Supervise the attempt to its end; returns the job's final status (or `Outcome.LEASE_LOST`)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            spec = parse_spec(self.lease.spec)  # validated by the API; parsed once, here
        except SpecInvalidError as exc:
            return self._end(states.FAILED, code=exc.code, message=str(exc), retryable=False,
                             event=("error", f"{exc.code}: {exc}"))
        for resolve, code in ((self._resolve_datasets, "data_invalid"), (self._resolve_init_from, "spec_invalid")):
            spec, problem = resolve(spec)
            if problem:
                return self._end(states.FAILED, code=code, message=problem, retryable=False,
                                 event=("error", f"{code}: {problem}"))
        if spec.resources.engine is not None:
            from worker.dispatch import ChunkDispatcher

            self.dispatcher = ChunkDispatcher(self.settings, self.factory, job_id=self.lease.job_id,
                                              queue=self.lease.queue, run_dir=self.run_dir, spec=spec)
        spec_path = self.run_dir / "job_spec.json"
        atomic_write_json(spec_path, spec.model_dump(mode="json"), indent=2)
        argv = build_command(settings=self.settings, spec=spec, spec_path=spec_path, run_dir=self.run_dir)
        with session_scope(self.factory) as s:
            tenant = job_owner_id(s, self.lease.job_id)
            self._known_steps = complete_checkpoint_steps(s, self.lease.job_id)  # earlier attempts' too
        regen_cache = self.settings.home.resolve() / "cache" / f"owner-{tenant}" / "regenerate" if tenant is not None else None
        self.engine_env = trainer_environment(spec=spec, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                              regen_cache=regen_cache)
        self.worker_prov = self.redact.value(worker_provenance(argv=argv, attempt=self.lease.attempt))
        self.collector.batch.provenance = {"worker": self.worker_prov, "trainer": None}
        # which host and process run it is for operators (this log, the job's lease owner), not the tenant
        log.info("job %s: attempt %s on %s (lease owner %s)", self.lease.job_id, self.lease.attempt,
                 socket.gethostname(), self.lease.owner)
        self.collector.event("started", f"attempt {self.lease.attempt} started", {"argv": self.redact.value(argv)})
        self._backfill()
        previous = None
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._supervise(argv)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)

    def _resolve_datasets(self, spec: TrainSpec) -> tuple[TrainSpec, str | None]:
        """The spec the trainer gets: `dataset:<id>` sources and prompt sets become the uploaded file's local
        path (the job owner's datasets only; the Redactor maps the path back in what clients see)."""
        ids = dataset_refs(spec)
        if not ids:
            return spec, None
        with session_scope(self.factory) as s:
            files = dataset_files(s, self.lease.job_id, ids)
        try:
            local = localize_datasets(spec, files)
        except KeyError as exc:
            return spec, str(exc.args[0])
        self.redact = Redactor(self.settings, self.run_dir, {files[i]: i for i in ids if i in files})
        return local, None

    def _resolve_init_from(self, spec: TrainSpec) -> tuple[TrainSpec, str | None]:
        """The spec the trainer gets: a warm start's `job:`/`draft:` source becomes its export folder (the
        job owner's sources only, `service.db.init_from`); or why it cannot."""
        value = spec.draft.init_from
        if value is None:
            return spec, None
        with session_scope(self.factory) as s:
            owner = job_owner_id(s, self.lease.job_id)
            found = init_source(s, owner if owner is not None else -1, value,
                                artifact_root=self.settings.resolved_artifact_root())
        if found.export_dir is None:
            if complete_checkpoints(self.run_dir / CHECKPOINTS):
                return spec, None  # a resumed attempt reads only its own checkpoints (peagle.pipeline.warm_start)
            return spec, f"draft.init_from: {found.problem}"
        return spec.model_copy(update={"draft": spec.draft.model_copy(
            update={"init_from": str(found.export_dir)})}), None

    def _public_spec(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """The trainer's resolved spec as the owner sees it: their own data refs, no server path."""
        return public_spec(resolved, self.lease.spec, redact=self.redact.value)

    def _backfill(self) -> None:
        """Recover what a killed attempt printed but never stored, from RUN/progress.jsonl
        (`worker.progress.recover`), store it with the old floors, then raise them."""
        found = recover(path=self.run_dir / "progress.jsonl", lease=self.lease, collector=self.collector,
                        redact=self.redact.value)
        if found is None:
            return
        self._flush()
        self.lease = replace(self.lease, metric_floor=found.metric_floor, eval_floor=found.eval_floor,
                             final_evaluations=found.final_evaluations)
        self.collector.checkpoints_seen = 0

    def _supervise(self, argv: list[str]) -> str:
        env = trainer_env(job_id=self.lease.job_id, attempt=self.lease.attempt, placement=self.engine_env)
        try:
            self.proc = start_trainer(argv=argv, env=env)
        except OSError as exc:
            log.warning("job %s: cannot start the trainer: %s", self.lease.job_id, exc)
            return self._end(states.FAILED, code="trainer_start_failed", retryable=False,
                             message=f"cannot start the trainer: {exc.strerror or type(exc).__name__}")
        self.collector.event("trainer", "trainer started")  # its pid is in the worker log, not the tenant's events
        output = TrainerOutput(self.proc)  # `worker.streams`: its stdout (progress JSON lines) and stderr
        next_flush = next_beat = time.monotonic()
        try:
            while output.open or self.proc.poll() is None:
                kind, line = output.get(timeout=0.1)
                if kind == "out":
                    self.collector.add_line(self.redact.text(line))
                elif kind == "err":
                    self._stderr(line)
                now = time.monotonic()
                if self.shutdown:
                    self._request_stop("worker shutting down")
                if self.term_sent_at is not None and not self.kill_sent and now - self.term_sent_at > self._grace():
                    self.kill_sent = True
                    self.collector.event("killed", "trainer did not stop within the grace period: SIGKILL sent")
                    self._signal_group(signal.SIGKILL)
                if now >= next_beat:
                    next_beat = now + self.settings.heartbeat_seconds
                    try:
                        self._heartbeat()
                    except SQLAlchemyError as exc:
                        log.warning("job %s: heartbeat failed (%s)", self.lease.job_id, exc)
                if self.dispatcher is not None and self.term_sent_at is None:
                    self._dispatch()
                if now >= next_flush or len(self.collector) >= 500:
                    next_flush = now + self.flush_seconds
                    self._flush()
            rc = self.proc.wait()
            self._flush(final=True)
        except LeaseLost as exc:
            log.warning("%s: stopping the trainer", exc)
            self._signal_group(signal.SIGKILL)
            self.proc.wait()
            return Outcome.LEASE_LOST
        finally:
            if self.proc.poll() is None:  # the supervisor itself failed: never leave a trainer behind
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
            if self.dispatcher is not None:
                with contextlib.suppress(Exception):
                    self.dispatcher.stop()
        return self._exit(rc)

    def _dispatch(self) -> None:
        """Send a split job's released chunks (`worker.dispatch`); a failure is logged and retried next time."""
        now = time.monotonic()
        if now < getattr(self, "_next_dispatch", 0.0):
            return
        self._next_dispatch = now + 0.5
        try:
            self.dispatcher.tick()
        except Exception as exc:  # noqa: BLE001 - the broker or database may come back: next tick
            log.warning("job %s: chunk dispatch failed (%s)", self.lease.job_id, exc)

    def _stderr(self, line: str) -> None:
        for level, part in stderr_parts(self.redact.text(line)):
            self.stderr_tail.append(part)
            self.collector.log(level, part)

    # ---------------------------------------------------------------- outcome (`worker.outcome`)

    def _exit(self, rc: int) -> str:
        with session_scope(self.factory) as s:
            status = job_status(s, self.lease.job_id)
        stopped_cleanly = rc == EXIT_CODES["interrupted"] or (
            self.term_sent_at is not None and self.collector.checkpoints_seen > self.checkpoints_at_term)
        ending = decide_ending(rc=rc, status=status, stopped_cleanly=stopped_cleanly, kill_sent=self.kill_sent,
                               shutdown=self.shutdown, checkpoint_step=self.collector.last_checkpoint_step,
                               stderr_tail=list(self.stderr_tail), last_error=self.collector.last_error,
                               redact=self.redact.text)
        if ending.crash:  # a stopping worker could take the requeued job back: the reaper sends it
            return record_crash(self.factory, self.lease, ending, publisher=self.publisher,
                                send_task=None if self.shutdown else self.send_task)
        return record_ending(self.factory, self.lease, ending, redact=self.redact.text, publisher=self.publisher)

    def _end(self, status: str, *, code: str | None = None, message: str | None = None, retryable: bool | None = None,
             event: tuple[str, str] | None = None) -> str:
        return record_ending(self.factory, self.lease, Ending(status, code=code, message=message, retryable=retryable,
                                                              event=event), redact=self.redact.text, publisher=self.publisher)
