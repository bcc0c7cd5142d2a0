"""The thin supervisor of one job attempt: trainer child process -> database + live channel.

    Supervisor(settings, factory, lease, send_task=..., publisher=...).run()  -> final status

1. Writes the job spec into the run directory (`artifact_root/<job_id>/job_spec.json`) and starts
   `python -m peagle train SPEC --out RUN --progress-jsonl - --resume auto` (`torchrun` for gpus > 1) in
   its own process group, with a parent-death signal so it never outlives the supervisor.
2. Reader threads collect its stdout (JSON lines) and stderr; the loop writes a batch every
   `flush_seconds` (one transaction, fenced by the lease) and wakes live listeners on Redis.
3. Every `heartbeat_seconds` it extends the lease and reads the desired state: pause/cancel send SIGTERM
   to the trainer's group (it checkpoints and exits 75), SIGKILL after `kill_grace_seconds`. SIGTERM to
   the supervisor's own process (the worker is shutting down, `worker.app.stop_running_jobs`) does the
   same within `shutdown_grace_seconds`, then requeues the job (attempt + 1) to resume from that checkpoint.
4. On exit it maps the exit code (`peagle.errors.EXIT_CODES`) and stderr OOM signatures to the job's
   final state and error code. A trainer killed by a signal it was not sent is a crash: the job is
   requeued (attempt+1, resumes from its last complete checkpoint) up to `max_restarts`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from peagle.errors import EXIT_CODES
from peagle.fileio import atomic_write_json
from peagle.spec import SpecInvalidError, TrainSpec, parse_spec
from service.channels import dataset_id
from service.db import states
from service.db.lease import (
    Lease,
    LeaseLost,
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
from worker.progress import ProgressCollector, parse_line
from worker.provenance import read_json, worker_provenance
from worker.redact import Redactor

__all__ = ["Outcome", "Supervisor", "build_command", "classify_exit", "trainer_environment"]

log = logging.getLogger(__name__)

CODE_BY_EXIT = {v: k for k, v in EXIT_CODES.items()}
CUDA_OOM = ("CUDA out of memory", "OutOfMemoryError: CUDA", "torch.OutOfMemoryError", "CUBLAS_STATUS_ALLOC_FAILED")
HOST_OOM = ("MemoryError", "std::bad_alloc", "Cannot allocate memory", "DefaultCPUAllocator: can't allocate")
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _resolved(spec: TrainSpec | dict[str, Any]) -> TrainSpec:
    """The spec with its target engine resolved as the trainer will (vLLM installed on this worker?)."""
    from peagle.engine.locate import vllm_available

    parsed = parse_spec(spec)
    return parsed.resolve(cuda_available=parsed.resources.gpus > 0, vllm_available=vllm_available())


def build_command(settings: Settings, spec: TrainSpec | dict[str, Any], spec_path: Path, run_dir: Path) -> list[str]:
    """The trainer command line: `peagle train` (under `torchrun` when the trainer gets > 1 GPU: the job's
    GPUs, less those the vLLM target engine takes, `resources.train_gpus`)."""
    resolved = _resolved(spec)
    r = resolved.resources
    gpus = (r.train_gpus or r.gpus) if r.target_engine == "vllm" else r.gpus
    tail = ["train", str(spec_path), "--out", str(run_dir), "--progress-jsonl", "-", "--resume", "auto"]
    if settings.trainer_command:
        return [*shlex.split(settings.trainer_command), *tail]
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                "--module", "peagle", *tail]
    return [sys.executable, "-m", "peagle", *tail]


def trainer_environment(spec: TrainSpec | dict[str, Any], *, visible: str | None, regen_cache: Path | None
                        ) -> dict[str, str]:
    """What the trainer's environment adds for its target engine: its GPUs (`CUDA_VISIBLE_DEVICES`) and the
    engine's (`PEAGLE_ENGINE_DEVICES`), split by `peagle.engine.placement.split_devices`, and the owner's
    own regeneration cache (`PEAGLE_REGEN_CACHE`: a tenant never reads another's cached answers).

    Args:
        spec: the job spec.
        visible: this worker's `CUDA_VISIBLE_DEVICES` (None = every GPU torch would see, numbered from 0).
        regen_cache: the owner's regeneration cache folder.
    """
    from peagle.engine.placement import split_devices

    env: dict[str, str] = {}
    if regen_cache is not None:
        env["PEAGLE_REGEN_CACHE"] = str(regen_cache)
    resolved = _resolved(spec)
    r = resolved.resources
    if r.gpus == 0 or r.target_engine != "vllm":
        return env
    names = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(r.gpus)]
    engine, trainer = split_devices(names[: r.gpus], r.capture_gpus or 0, r.train_gpus or r.gpus)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(trainer)
    env["PEAGLE_ENGINE_DEVICES"] = ",".join(engine)
    return env


def classify_exit(returncode: int, stderr_tail: list[str], last_error: dict[str, Any] | None
                  ) -> tuple[str, str, bool]:
    """(error_code, message, retryable) of a failed trainer exit (returncode not 0 and not 75).

    The exit code names the failure (`EXIT_CODES`); a generic exit 1 is refined by OOM signatures in
    stderr; the message is the trainer's last error event, else the last stderr line.
    """
    text = "\n".join(stderr_tail)
    code = CODE_BY_EXIT.get(returncode, "training_failed")
    if code in ("error", "usage", "training_failed"):
        if any(sig in text for sig in CUDA_OOM):
            code = "cuda_oom"
        elif any(sig in text for sig in HOST_OOM):
            code = "host_oom"
        else:
            code = "training_failed"
    message = (last_error or {}).get("message") or ""
    if not message:
        lines = [ln.strip() for ln in stderr_tail if ln.strip()]
        message = lines[-1] if lines else f"trainer exited with code {returncode}"
    if code == "cuda_oom" and "out of memory" not in message.lower():
        message = f"CUDA out of memory: {message}"
    if code == "host_oom" and "memory" not in message.lower():
        message = f"host out of memory: {message}"
    return code, message, code in ("resource_unavailable",)


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
        self.redact = Redactor(settings, self.run_dir)  # what clients see names no server path

    # ---------------------------------------------------------------- process control

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

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

    def _reader(self, stream: Any, name: str) -> None:
        try:
            for line in stream:
                self.lines.put((name, line))
        finally:
            self.lines.put(None)

    # ---------------------------------------------------------------- database

    def _flush(self, final: bool = False) -> None:
        """Write the pending batch (retrying later on database errors); raises LeaseLost."""
        self._pick_up_run_files(force=final)
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

    def _requeue_batch(self, batch: Any) -> None:
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
            return self._end(states.FAILED, exc.code, str(exc), False, ("error", f"{exc.code}: {exc}"))
        spec, missing = self._resolve_datasets(spec)
        if missing:
            return self._end(states.FAILED, "data_invalid", missing, False, ("error", f"data_invalid: {missing}"))
        spec_path = self.run_dir / "job_spec.json"
        atomic_write_json(spec_path, spec.model_dump(mode="json"), indent=2)
        argv = build_command(self.settings, spec, spec_path, self.run_dir)
        with session_scope(self.factory) as s:
            tenant = job_owner_id(s, self.lease.job_id)
        regen_cache = self.settings.home.resolve() / "cache" / f"owner-{tenant}" / "regenerate" if tenant is not None else None
        self.engine_env = trainer_environment(spec, visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                                              regen_cache=regen_cache)
        self.worker_prov = self.redact.value(
            worker_provenance(argv=argv, attempt=self.lease.attempt, lease_owner=self.lease.owner))
        self.collector.batch.provenance = {"worker": self.worker_prov, "trainer": None}
        self.collector.event("started", f"attempt {self.lease.attempt} started on {self.worker_prov['host']}",
                             {"argv": self.redact.value(argv), "lease_owner": self.lease.owner})
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

    def _public_spec(self, resolved: dict[str, Any]) -> dict[str, Any]:
        """The trainer's resolved spec as the owner sees it: their own data refs, no server path."""
        mine = (self.lease.spec.get("data") or {}).get("sources") or []
        sources = (resolved.get("data") or {}).get("sources")
        if isinstance(sources, list) and len(sources) == len(mine):
            resolved = {**resolved, "data": {**resolved["data"], "sources": [
                {**s, "path": m.get("path")} if isinstance(s, dict) else s for s, m in zip(sources, mine, strict=True)]}}
        return self.redact.value(resolved)

    def _backfill(self) -> None:
        """Recover what a killed attempt printed but never stored, from RUN/progress.jsonl.

        A trainer killed between printing a record and the supervisor's next flush leaves a newer
        checkpoint on disk than metrics in the database; the resumed trainer restarts after that
        checkpoint, so those steps would be a gap. The trainer also appends every record to
        RUN/progress.jsonl: metrics above the stored floor and unknown checkpoints are ingested from it,
        and the floor rises to what was recovered (the resumed trainer's replays are then dropped).
        """
        path = self.run_dir / "progress.jsonl"
        if not path.exists():
            return
        floor, eval_floor = self.lease.metric_floor, self.lease.eval_floor  # dedup on (step, kind)
        seen: set[tuple[int, tuple[str, ...]]] = set()
        known = self.lease.latest_checkpoint_step
        top, top_eval = floor, eval_floor
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                rec = parse_line(line)
                if rec is None:
                    continue
                if rec["type"] == "metric" and isinstance(rec.get("step"), int):
                    key = (rec["step"], tuple(sorted((rec.get("values") or {}).keys())))
                    if (floor is None or rec["step"] > floor) and key not in seen:
                        seen.add(key)
                        self.collector.add(self.redact.value(rec))
                        top = rec["step"] if top is None else max(top, rec["step"])
                elif rec["type"] == "event" and rec.get("kind") == "checkpoint" and \
                        int(rec.get("step") or 0) > (known or 0):
                    self.collector.add(self.redact.value(rec))
                elif rec["type"] == "event" and rec.get("kind") == "eval" and isinstance(rec.get("step"), int) \
                        and (eval_floor is None or rec["step"] > eval_floor):
                    key = (rec["step"], ("eval",))
                    if key not in seen:
                        seen.add(key)
                        self.collector.add(self.redact.value(rec))
                        top_eval = rec["step"] if top_eval is None else max(top_eval, rec["step"])
        if seen:
            self.collector.log("warning", f"recovered {len(seen)} metric record(s) of the previous attempt "
                                          f"from progress.jsonl (up to step {max(top or 0, top_eval or 0)})")
        self._flush()  # with the old floors, then raise them
        self.lease = replace(self.lease, metric_floor=top, eval_floor=top_eval)
        self.collector.checkpoints_seen = 0

    def _supervise(self, argv: list[str]) -> str:
        # No Hugging Face progress bars: stderr lines become job logs, and a bar there is noise
        # ("0%| | 0/272"). Not TQDM_DISABLE: vLLM's serve check divides by a disabled bar's elapsed time.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PEAGLE_JOB_ID": self.lease.job_id,
               "PEAGLE_ATTEMPT": str(self.lease.attempt), "HF_HUB_DISABLE_PROGRESS_BARS": "1"}
        env.update(self.engine_env)
        try:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                bufsize=1, errors="replace", env=env, start_new_session=True, preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            return self._end(states.FAILED, "trainer_start_failed", f"cannot start the trainer: {exc}", False)
        self.collector.event("trainer", f"trainer started (pid {self.proc.pid})", {"pid": self.proc.pid})
        readers = [threading.Thread(target=self._reader, args=(s, n), daemon=True)
                   for s, n in ((self.proc.stdout, "out"), (self.proc.stderr, "err"))]
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
        return self._exit(rc)

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
            return self._end(states.CANCELLED, None, None, None, ("cancelled", "cancelled by request"))
        if rc == 0:
            late = " (the pause request came after the last step)" if status == states.PAUSING else ""
            return self._end(states.SUCCEEDED, None, None, None, ("succeeded", "training finished" + late))
        if status == states.PAUSING and (stopped_cleanly or self.kill_sent):
            return self._end(states.PAUSED, None, None, None, ("paused", f"paused; resume continues from {where}"))
        if self.shutdown and stopped_cleanly:
            return self._requeue(f"worker shut down; requeued, resumes from {where}")
        if rc < 0 or rc == EXIT_CODES["interrupted"]:
            name = signal.Signals(-rc).name if rc < 0 else "SIGTERM"
            why = f"trainer killed by {name}" + (" (the kernel OOM killer sends SIGKILL)" if rc == -9 else "")
            return self._crash(why, "host_oom" if rc == -9 else "trainer_killed")
        code, message, retryable = classify_exit(rc, list(self.stderr_tail), self.collector.last_error)
        return self._end(states.FAILED, code, message, retryable, ("error", f"{code}: {message}"))

    def _end(self, status: str, code: str | None, message: str | None, retryable: bool | None,
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

    def _requeue(self, message: str) -> str:
        # No message is sent here: the worker is stopping and could still take it (then die with it).
        # The job is queued with no task id, so a reaper sends it once a worker is there.
        return self._end(states.QUEUED, None, None, None, ("interrupted", message))

    def _crash(self, why: str, code: str) -> str:
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
