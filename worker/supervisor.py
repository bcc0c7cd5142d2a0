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
4. On exit it maps the exit code (`worker.trainer.classify_exit`) to the job's final state and error code.
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
import queue
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import IO, Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from peagle.engine.procs import signal_group
from peagle.errors import EXIT_CODES
from peagle.fileio import atomic_write_json, read_json
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec
from service.channels import dataset_id
from service.db import states
from service.db.init_from import init_source
from service.db.lease import (
    Batch,
    Lease,
    LeaseLost,
    complete_checkpoint_steps,
    dataset_files,
    finish,
    heartbeat,
    ingest,
    job_owner_id,
    job_status,
    record_task_id,
    requeue_crashed,
)
from service.db.session import session_scope
from service.settings import Settings
from worker.live import Publisher
from worker.progress import ProgressCollector, recover
from worker.provenance import worker_provenance
from worker.redact import Redactor
from worker.trainer import build_command, classify_exit, start_trainer, trainer_env, trainer_environment

__all__ = ["Outcome", "Supervisor"]

log = logging.getLogger(__name__)


class Outcome:
    """Final status names returned by `Supervisor.run` besides job states."""

    LEASE_LOST = "lease_lost"


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
        self.run_dir = settings.resolved_artifact_root() / lease.job_id
        self.collector = ProgressCollector()
        self.lines: queue.Queue[tuple[str, str] | None] = queue.Queue()
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

    def _reader(self, stream: IO[str], name: str) -> None:
        try:
            for line in stream:
                self.lines.put((name, line))
        finally:
            self.lines.put(None)

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
            ck_root = self.run_dir / "checkpoints"
            gone = sorted(s for s in self._known_steps - new
                          if not (ck_root / f"step_{s:06d}" / "COMPLETE").exists())
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
        spec, missing = self._resolve_datasets(spec)
        if missing:
            return self._end(states.FAILED, code="data_invalid", message=missing, retryable=False,
                             event=("error", f"data_invalid: {missing}"))
        spec, gone = self._resolve_init_from(spec)
        if gone:
            return self._end(states.FAILED, code="spec_invalid", message=gone, retryable=False,
                             event=("error", f"spec_invalid: {gone}"))
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
        ids = [ds_id for src in spec.data.sources if (ds_id := dataset_id(src.path)) is not None]
        ids += [ds_id for ps in spec.eval.prompt_sets if (ds_id := dataset_id(ps.name)) is not None]
        if not ids:
            return spec, None
        with session_scope(self.factory) as s:
            files = dataset_files(s, self.lease.job_id, ids)

        def local(items: list[Any], field: str, where: str) -> list[Any]:
            """`items` with each `dataset:<id>` in `field` replaced by the file (KeyError names a missing one)."""
            out = []
            for i, item in enumerate(items):
                ds_id = dataset_id(getattr(item, field))
                if ds_id is not None and ds_id not in files:
                    raise KeyError(f"{where}.{i}.{field}: dataset {ds_id!r} not found")
                out.append(item if ds_id is None else item.model_copy(update={field: files[ds_id]}))
            return out

        try:
            sources = local(spec.data.sources, "path", "data.sources")
            prompt_sets = local(spec.eval.prompt_sets, "name", "eval.prompt_sets")
        except KeyError as exc:
            return spec, str(exc.args[0])
        self.redact = Redactor(self.settings, self.run_dir, {files[i]: i for i in ids if i in files})
        return spec.model_copy(update={"data": spec.data.model_copy(update={"sources": sources}),
                                       "eval": spec.eval.model_copy(update={"prompt_sets": prompt_sets})}), None

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
            if any((self.run_dir / "checkpoints").glob("step_*/COMPLETE")):
                return spec, None  # a resumed attempt reads only its own checkpoints (peagle.pipeline.warm_start)
            return spec, f"draft.init_from: {found.problem}"
        return spec.model_copy(update={"draft": spec.draft.model_copy(
            update={"init_from": str(found.export_dir)})}), None

    def _public_spec(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """The trainer's resolved spec as the owner sees it: their own data refs, no server path."""
        warm = (self.lease.spec.get("draft") or {}).get("init_from")
        if warm is not None and isinstance(resolved.get("draft"), dict):
            resolved = {**resolved, "draft": {**resolved["draft"], "init_from": warm}}
        mine = (self.lease.spec.get("data") or {}).get("sources") or []
        sources = (resolved.get("data") or {}).get("sources")
        if isinstance(sources, list) and len(sources) == len(mine):
            resolved = {**resolved, "data": {**resolved["data"], "sources": [
                {**s, "path": m.get("path")} if isinstance(s, dict) else s for s, m in zip(sources, mine, strict=True)]}}
        return self.redact.value(resolved)

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
        streams: list[tuple[IO[str] | None, str]] = [(self.proc.stdout, "out"), (self.proc.stderr, "err")]
        readers = [threading.Thread(target=self._reader, args=(st, n), daemon=True) for st, n in streams]
        for t in readers:
            t.start()
        open_streams = 2
        next_flush = next_beat = time.monotonic()
        try:
            while open_streams or self.proc.poll() is None:
                try:
                    item = self.lines.get(timeout=0.1)
                except queue.Empty:
                    item = ("", "")
                if item is None:
                    open_streams -= 1
                elif item[0] == "out":
                    self.collector.add_line(self.redact.text(item[1]))
                elif item[0] == "err":
                    self._stderr(item[1])
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
        for part in self.redact.text(line).replace("\r", "\n").split("\n"):
            if part.strip():
                self.stderr_tail.append(part)
                low = part.lower()
                level = "error" if ("error" in low or part.startswith("Traceback")) else "info"
                self.collector.log(level, part)

    # ---------------------------------------------------------------- outcome

    def _exit(self, rc: int) -> str:
        with session_scope(self.factory) as s:
            status = job_status(s, self.lease.job_id)
        step = self.collector.last_checkpoint_step
        stopped_cleanly = rc == EXIT_CODES["interrupted"] or (
            self.term_sent_at is not None and self.collector.checkpoints_seen > self.checkpoints_at_term)
        where = f"checkpoint step {step}" if step is not None else "the last complete checkpoint"
        if status == states.CANCELLING:
            return self._end(states.CANCELLED, event=("cancelled", "cancelled by request"))
        if rc == 0:
            late = " (the pause request came after the last step)" if status == states.PAUSING else ""
            return self._end(states.SUCCEEDED, event=("succeeded", "training finished" + late))
        if status == states.PAUSING and (stopped_cleanly or self.kill_sent):
            return self._end(states.PAUSED, event=("paused", f"paused; resume continues from {where}"))
        if self.shutdown and stopped_cleanly:
            return self._requeue(message=f"worker shut down; requeued, resumes from {where}")
        if rc < 0 or rc == EXIT_CODES["interrupted"]:
            name = signal.Signals(-rc).name if rc < 0 else "SIGTERM"
            why = f"trainer killed by {name}" + (" (the kernel OOM killer sends SIGKILL)" if rc == -9 else "")
            return self._crash(why=why, code="host_oom" if rc == -9 else "trainer_killed")
        failure = classify_exit(returncode=rc, stderr_tail=list(self.stderr_tail), last_error=self.collector.last_error)
        if failure.restart:  # a new attempt resumes from what was done (regeneration cache, checkpoints)
            return self._crash(why=f"{failure.code}: {self.redact.text(failure.message)}", code=failure.code)
        return self._end(states.FAILED, code=failure.code, message=failure.message, retryable=failure.retryable,
                         event=("error", f"{failure.code}: {failure.message}"))

    def _end(self, status: str, *, code: str | None = None, message: str | None = None, retryable: bool | None = None,
             event: tuple[str, str] | None = None) -> str:
        message = self.redact.text(message) if message is not None else None
        event = (event[0], self.redact.text(event[1])) if event is not None else None
        with session_scope(self.factory) as s:
            ok = finish(s, self.lease, status=status, error_code=code, error_message=message,
                        retryable=retryable, event=event)
        if not ok:
            return Outcome.LEASE_LOST
        if self.publisher is not None:
            self.publisher.publish_status(self.lease.job_id, status)
        return status

    def _requeue(self, *, message: str) -> str:
        # No message is sent here: the worker is stopping and could still take it (then die with it).
        # The job is queued with no task id, so a reaper sends it once a worker is there.
        return self._end(states.QUEUED, event=("interrupted", message))

    def _crash(self, *, why: str, code: str) -> str:
        with session_scope(self.factory) as s:
            act = requeue_crashed(s, self.lease, reason=why, code=code)
        if act is None:
            return Outcome.LEASE_LOST
        if act.status == states.QUEUED and not self.shutdown:  # a stopping worker could take it back
            self._send()
        if self.publisher is not None:
            self.publisher.publish_status(self.lease.job_id, act.status)
        return act.status

    def _send(self) -> None:
        if self.send_task is None:
            return  # the reaper re-sends queued jobs that have no broker message
        try:
            task_id = self.send_task(self.lease.job_id, self.lease.queue)
        except Exception as exc:  # noqa: BLE001 - broker down: the reaper re-sends later
            log.warning("job %s: requeue message not sent (%s); the reaper will", self.lease.job_id, exc)
            return
        with session_scope(self.factory) as s:
            record_task_id(s, self.lease.job_id, task_id, only_if_unsent=True)
