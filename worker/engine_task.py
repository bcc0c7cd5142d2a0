"""The engine side of a split job (`resources.engine`, issue 37): the Celery task `peagle.engine_chunk`.

    peagle.engine_chunk(job_id, kind, index)    # kind: capture (micro-batches), eval (held-out shards) or
                                                # regenerate (a conversation range, `peagle.data.remote_regen`)

An engine worker (`python -m worker --role engine`) runs it in its main process (the `solo` pool,
`service.queue.ENGINE_DELIVERY`): the task takes the chunk in the database (`service.db.engine_tasks`: its
own lease), gets the engine the job's plan needs from `WarmEngine` (`peagle.target.remote`: started once,
kept between chunks of the same configuration, `peagle.split.protocol.engine_key`), runs the chunk on the
shared volume (`peagle.target.remote.run_capture_chunk`: results written whole, then the chunk's marker;
`peagle.data.remote_regen.run_regen_chunk`) and records tokens and seconds. Between micro-batches it extends its lease and stops when the job is paused,
cancelled or over, or the chunk was given to another worker; a pause or cancel also stops its engine.

The chunk's row names this worker ``<Celery node name>:<pid>`` (`worker_name`): the dispatcher sends a job's
next chunk to the worker-direct queue of that node when its engine is warm for it (`worker.dispatch`).

`vllm serve` is started through `peagle.engine` (its guard dies with this process), so a killed engine
worker leaves no engine behind; `WarmEngine` stops it `engine_keep_warm_seconds` after the last chunk,
when a chunk needs another configuration, and when the worker shuts down (`stop_warm_engine`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from peagle.run_folder import job_dir
from service.db.engine_tasks import beat_chunk, end_chunk, job_control, job_stopping, start_chunk
from service.db.session import make_engine, make_session_factory, session_scope
from service.settings import Settings

__all__ = ["WarmEngine", "run_chunk", "stop_warm_engine", "worker_name"]

log = logging.getLogger(__name__)


class WarmEngine:
    """The one capture engine of this engine worker, kept warm between chunks of the same key."""

    def __init__(self, keep_warm_s: float) -> None:
        self.keep_warm_s = keep_warm_s
        self.key: str | None = None
        self.engine: Any = None  # a `peagle.target.remote.CaptureEngine` (or `GenerateEngine`)
        self.idle_since: float | None = None
        self.stop_if: Any = None  # asked while idle: True stops the engine (its job was paused or cancelled)
        self._lock = threading.Lock()
        self._timer: threading.Thread | None = None
        self.starts = 0

    def get(self, key: str, start: Any) -> Any:
        """The engine for `key` (`start()` builds one when the warm one is another's or none is warm)."""
        with self._lock:
            self.idle_since = None
            if self.engine is not None and self.key == key and self.engine.server.proc is not None:
                return self.engine
            self._stop_locked()
            self.engine, self.key = start(), key
            self.starts += 1
            return self.engine

    def release(self, stop_if: Any = None) -> None:
        """The chunk is over: the engine idles; a watcher stops it after `keep_warm_s`, or as soon as
        `stop_if()` says so (the job it last served was paused or cancelled)."""
        with self._lock:
            self.idle_since = time.monotonic()
            self.stop_if = stop_if
            if self._timer is None or not self._timer.is_alive():
                self._timer = threading.Thread(target=self._watch, name="peagle-warm-engine", daemon=True)
                self._timer.start()

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, max(self.keep_warm_s, 0.05)))
            with self._lock:
                if self.engine is None:
                    return
                if self.idle_since is None:
                    continue
                if time.monotonic() - self.idle_since >= self.keep_warm_s:
                    log.info("warm engine idle for %.0f s: stopped", self.keep_warm_s)
                    self._stop_locked()
                    return
                try:
                    stop = bool(self.stop_if()) if self.stop_if is not None else False
                except Exception:  # noqa: BLE001 - the database may be away: ask again next second
                    stop = False
                if stop:
                    log.info("the job of the warm engine's last chunk was paused or cancelled: engine stopped")
                    self._stop_locked()
                    return

    def _stop_locked(self) -> None:
        eng, self.engine, self.key = self.engine, None, None
        if eng is not None:
            eng.stop()

    def stop(self) -> None:
        """Stop the engine now (idempotent)."""
        with self._lock:
            self._stop_locked()


#: The worker process's warm engine (set by `register`; the solo pool runs every chunk in this process).
_WARM: list[WarmEngine] = []


def warm_engine(settings: Settings) -> WarmEngine:
    """This process's `WarmEngine` (made on first use)."""
    if not _WARM:
        _WARM.append(WarmEngine(settings.engine_keep_warm_seconds))
    return _WARM[0]


def stop_warm_engine(**_: object) -> None:
    """Celery's `worker_shutdown`: stop the warm engine."""
    for w in _WARM:
        w.stop()


def _devices(gpus: int) -> str | None:
    """The engine's CUDA_VISIBLE_DEVICES: the first `gpus` of this worker's (None: a CPU engine)."""
    if gpus <= 0:
        return None
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join((visible or [str(i) for i in range(gpus)])[:gpus])


def worker_name() -> str:
    """This engine worker in `engine_task.worker`: ``<Celery node name>:<pid>`` (the node name, which names its
    worker-direct queue, is the host's name outside a Celery task)."""
    from celery import current_task

    node = getattr(getattr(current_task, "request", None), "hostname", None)
    return f"{node or socket.gethostname()}:{os.getpid()}"


def _job_stopping(settings: Settings, job_id: str) -> bool:
    engine = make_engine(settings.resolved_database_url())
    try:
        with session_scope(make_session_factory(engine)) as s:
            return job_stopping(s, job_id)
    finally:
        engine.dispose()


def run_chunk(settings: Settings, job_id: str, kind: str, index: int, *, worker: str | None = None,
              warm: WarmEngine | None = None) -> str:
    """Run one chunk of `job_id` on this engine worker; returns the chunk's final state (or `skipped`)."""
    from peagle.data import remote_regen
    from peagle.split import protocol
    from peagle.target import remote

    name = worker or worker_name()
    warm = warm or warm_engine(settings)
    engine = make_engine(settings.resolved_database_url())
    factory = make_session_factory(engine)
    run = job_dir(settings.resolved_artifact_root(), job_id)
    d = protocol.remote_dir(run)
    if kind == "regenerate":
        d = protocol.regen_dir(run)
    try:
        plan = protocol.read_regen_plan(d) if kind == "regenerate" else protocol.read_plan(d)
        if plan is None:  # not claimed: the chunk stays `sent`, so its re-send goes out without a lease to lapse
            log.warning("job %s chunk %s/%s: no plan in %s on this worker (is the shared volume mounted here?): "
                        "skipped", job_id, kind, index, d)
            return "skipped"
        gpus = int((plan.get("spec", {}).get("resources", {}).get("engine") or {}).get("gpus", 0))
        with session_scope(factory) as s:
            generation = start_chunk(s, job_id, kind, index, worker=name, gpus=gpus,
                                     lease_seconds=settings.lease_seconds)
        if generation is None:
            log.info("job %s chunk %s/%s: not this worker's (done, stopped or running elsewhere): skipped",
                     job_id, kind, index)
            return "skipped"
        stop = threading.Event()  # the chunk must stop: job paused, cancelled or over, chunk given away
        done = threading.Event()

        def beat() -> None:  # the chunk's lease, extended while it runs (the engine's start included)
            while not done.wait(settings.heartbeat_seconds):
                try:
                    with session_scope(factory) as s:
                        go = job_control(s, job_id, kind, index, worker=name) and beat_chunk(
                            s, job_id, kind, index, worker=name, lease_seconds=settings.lease_seconds)
                except Exception as exc:  # noqa: BLE001 - the database may come back before the lease lapses
                    log.warning("job %s chunk %s/%s: heartbeat failed (%s)", job_id, kind, index, exc)
                    continue
                if not go:
                    stop.set()
                    return

        beater = threading.Thread(target=beat, name="peagle-chunk-lease", daemon=True)
        beater.start()

        def start() -> Any:
            storage = Path(settings.home).resolve() / "engine" / f"capture-{os.getpid()}"
            return remote.start_capture_engine(plan, storage_dir=storage, log_path=run / "logs" / f"engine-{name.replace(':', '-')}.log",
                                               devices=_devices(gpus))

        def start_generate() -> Any:
            return remote.start_generate_engine(
                plan, log_path=run / "logs" / f"engine-{name.replace(':', '-')}.log", devices=_devices(gpus))

        try:
            if kind == "regenerate":
                gen = warm.get(protocol.engine_key(plan), start_generate)
                answered = remote_regen.run_regen_chunk(d, index, gen.tokenizer, gen.backend, worker=name)
                stats: dict[str, Any] | None = {"tokens": answered["tokens"], "seconds": answered["seconds"]}
            elif kind == "eval":
                cap = warm.get(protocol.engine_key(plan), start).capture(plan)
                import torch

                dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
                    str(plan["spec"]["target"].get("dtype")), torch.bfloat16)
                stats = remote.run_eval_chunk(d, cap, aux_dtype=dtype, worker=name)
            else:
                cap = warm.get(protocol.engine_key(plan), start).capture(plan)
                stats = remote.run_capture_chunk(d, index, cap, worker=name, should_stop=stop.is_set)
        except Exception as exc:  # the task boundary: recorded, the dispatcher re-sends or fails the job
            done.set()
            log.exception("job %s chunk %s/%s failed", job_id, kind, index)
            warm.stop()
            with session_scope(factory) as s:
                end_chunk(s, job_id, kind, index, worker=name, state="failed",
                          error=f"{type(exc).__name__} (details in the engine worker's log)")
            return "failed"
        done.set()
        if stats is None:
            if stop.is_set():
                warm.stop()  # a pause or cancel leaves no engine running
            with session_scope(factory) as s:
                end_chunk(s, job_id, kind, index, worker=name, state="stopped")
            return "stopped"
        warm.release(lambda: _job_stopping(settings, job_id))
        with session_scope(factory) as s:
            end_chunk(s, job_id, kind, index, worker=name, state="done", tokens=int(stats["tokens"]),
                      seconds=float(stats["seconds"]))
        return "done"
    finally:
        with contextlib.suppress(Exception):
            engine.dispose()
