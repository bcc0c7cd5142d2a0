"""`peagle jobs ...`: talk to a running service (`--url`/`PEAGLE_URL`, `--api-key`/`PEAGLE_API_KEY`)."""

from __future__ import annotations

import json
import queue
import shlex
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from peagle.client import JobDict, PeagleClient, ServiceError, StreamKind
from peagle.progress import format_duration

jobs_app = typer.Typer(add_completion=False, no_args_is_help=True, help="Submit and follow jobs on a peagle service.")

_URL = typer.Option("http://127.0.0.1:8000", "--url", envvar="PEAGLE_URL", help="Service base URL.")
_KEY = typer.Option(None, "--api-key", envvar="PEAGLE_API_KEY", help="API key (Bearer).")


def _client(url: str, key: str | None) -> PeagleClient:
    return PeagleClient(url, key)


def _fail(exc: ServiceError) -> None:
    typer.echo(f"error: {exc}", err=True)
    for d in exc.details:
        typer.echo(f"  {d.get('param') or ''}: {d.get('message', d)}", err=True)
    raise typer.Exit(1)


def _print(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


@jobs_app.command("submit")
def submit(
    spec: Path | None = typer.Argument(None, help="Spec file (YAML or JSON); or use --preset."),
    preset: str | None = typer.Option(None, "--preset", help="Preset name (tiny, demo, ...)."),
    override: str | None = typer.Option(None, "--override", help='JSON deep-merged into the preset.'),
    name: str | None = typer.Option(None, "--name"),
    idempotency_key: str | None = typer.Option(None, "--idempotency-key", help="Retry-safe submission."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Validate and estimate only."),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """Submit a job; prints it (or the estimate) as JSON."""
    data = None
    if spec is not None:
        import yaml

        text = spec.read_text(encoding="utf-8")
        data = json.loads(text) if spec.suffix == ".json" else yaml.safe_load(text)
    with _client(url, api_key) as c:
        try:
            job = c.submit(data, preset=preset, overrides=json.loads(override) if override else None, name=name,
                           idempotency_key=idempotency_key, dry_run=dry_run)
        except ServiceError as exc:
            _fail(exc)
    _print(job)


@jobs_app.command("list")
def list_jobs(
    status: list[str] | None = typer.Option(None, "--status"),
    tag: str | None = typer.Option(None, "--tag"),
    limit: int = typer.Option(50, "--limit", help="At most this many rows."),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """One line per job: id, status, phase, progress, name."""
    with _client(url, api_key) as c:
        try:
            for i, job in enumerate(c.list_jobs(status=status, tag=tag, limit=min(limit, 200))):
                if i >= limit:
                    break
                pct = (job.get("progress") or {}).get("percent")
                typer.echo(f"{job['id']}\t{job['status']}\t{job.get('phase') or '-'}\t"
                           f"{'-' if pct is None else f'{pct:.0f}%'}\t{job.get('name', '')}")
        except ServiceError as exc:
            _fail(exc)


@jobs_app.command("get")
def get(job_id: str, url: str = _URL, api_key: str | None = _KEY) -> None:
    """The job as JSON."""
    with _client(url, api_key) as c:
        try:
            _print(c.get_job(job_id))
        except ServiceError as exc:
            _fail(exc)


@jobs_app.command("cancel")
def cancel(job_id: str, url: str = _URL, api_key: str | None = _KEY) -> None:
    """Cancel a job (idempotent)."""
    with _client(url, api_key) as c:
        try:
            typer.echo(c.action(job_id, "cancel")["status"])
        except ServiceError as exc:
            _fail(exc)


#: Events `--follow` does not show: a phase change is already a log line (`phase training: ...`, written by
#: the trainer's `peagle.progress.ProgressLog` in the same batch, so in order with the other lines), and
#: progress only updates the job row.
_EVENTS_IN_THE_LOG = frozenset({"phase", "progress"})


def _log_line(rec: dict[str, Any]) -> str:
    return f"{rec['time']} {rec['level']:<7} {rec['message']}"


def _event_line(rec: dict[str, Any]) -> str:
    return f"{rec['time']} {'event':<7} {rec.get('kind')}: {rec.get('message') or ''}"


def _status_line(job: JobDict, phase_event: dict[str, Any] | None) -> str:
    """Where the job is now: status, phase (since when, and what it does) and progress with the time left."""
    text = f"job {job.get('id')}: {job.get('status')}"
    phase = job.get("phase")
    if phase:
        text += f", phase {phase}"
        if phase_event is not None and phase_event.get("phase") == phase:
            text += f" since {phase_event['time']}"
            message = phase_event.get("message") or ""
            if message and message != f"phase: {phase}":
                text += f" ({message})"
    p = job.get("progress") or {}
    step, total = p.get("step"), p.get("total_steps")
    if isinstance(step, int) and isinstance(total, int) and total > 0:
        unit = "conversations regenerated" if p.get("phase") == "regenerating" else "steps"
        text += f"; {step}/{total} {unit} ({100 * step // total}%)"
        left = p.get("seconds_remaining")
        if isinstance(left, int | float) and job.get("status") == "running":
            text += f", eta {format_duration(left)}"
    return text


def _events_so_far(c: PeagleClient, job_id: str) -> tuple[int, dict[str, Any] | None]:
    """The job's last event seq and its latest `phase` event."""
    after, phase = 0, None
    while True:
        page = c.page(job_id, "events", after=after, limit=1000)
        for rec in page["data"]:
            if rec.get("kind") == "phase":
                phase = rec
        if page["next_after"] is not None:
            after = int(page["next_after"])
        if not page.get("has_more"):
            return after, phase


def _follow(url: str, key: str | None, job_id: str, after: dict[StreamKind, int]) -> Iterator[str]:
    """The job's log lines and its events (but `_EVENTS_IN_THE_LOG`) as they come, until the job ends.
    Each stream is read by its own thread and client (SSE, reconnecting)."""
    q: queue.Queue[tuple[str, Any]] = queue.Queue()

    def pump(kind: StreamKind) -> None:
        try:
            with _client(url, key) as c:
                for rec in c.stream(job_id, kind, after=after[kind]):
                    q.put((kind, rec))
        except Exception as exc:  # noqa: BLE001 - raised again in the main thread
            q.put(("error", exc))
        q.put(("end", kind))

    for stream in after:
        threading.Thread(target=pump, args=(stream,), daemon=True, name=f"peagle-follow-{stream}").start()
    running = len(after)
    while running:
        try:
            kind, item = q.get(timeout=0.5)  # a timeout keeps Ctrl-C working
        except queue.Empty:
            continue
        if kind == "end":
            running -= 1
        elif kind == "error":
            raise item
        elif kind == "logs":
            yield _log_line(item)
        elif item.get("kind") not in _EVENTS_IN_THE_LOG:
            yield _event_line(item)


@jobs_app.command("logs")
def logs(
    job_id: str,
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends."),
    tail: int = typer.Option(100, "--tail", help="Lines to show first."),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """Print log lines. `--follow` first says where the job is (status, phase, progress), then streams its
    log lines (phase changes among them) and events (attempts, checkpoints, evaluations, status changes)
    live over SSE until it ends."""
    with _client(url, api_key) as c:
        try:
            if follow:
                events_after, phase = _events_so_far(c, job_id)
                typer.echo(_status_line(c.get_job(job_id), phase))
            page = c.page(job_id, "logs", tail=tail)
            for rec in page["data"]:
                typer.echo(_log_line(rec))
            if follow:
                cursors: dict[StreamKind, int] = {"logs": int(page["next_after"] or 0), "events": events_after}
                for line in _follow(url, api_key, job_id, cursors):
                    typer.echo(line)
                typer.echo(_status_line(c.get_job(job_id), None))
        except ServiceError as exc:
            _fail(exc)


@jobs_app.command("checkpoints")
def checkpoints(
    job_id: str,
    as_json: bool = typer.Option(False, "--json", help="Print the checkpoints as JSON (evaluation included)."),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """List a job's checkpoints: tau_sim, measured AL and the serving speedup measured in vLLM (batch 1 and a
    batch of all speedup prompts; the hardware it ran on)."""
    with _client(url, api_key) as c:
        try:
            cks = c.checkpoints(job_id)
        except ServiceError as exc:
            _fail(exc)
    if as_json:
        _print(cks)
        return

    def num(v: Any) -> str:
        return f"{v:.3f}" if isinstance(v, int | float) else "-"

    for ck in sorted(cks, key=lambda x: x["step"]):
        serving = (ck.get("evaluation") or {}).get("serving") or {}
        speed = ", ".join(f"batch {r['batch_size']} {r.get('speedup_text') or num(r.get('speedup'))}"
                          for r in (serving.get("batch_1"), serving.get("batch_n")) if r)  # fmt: skip
        hw = serving.get("hardware") or {}
        where = f" on {hw.get('gpu') or hw.get('cpu')} ({hw.get('cpu_count')} CPUs)" if speed else ""
        flags = "".join((" best" if ck.get("is_best") else "", " latest" if ck.get("is_latest") else ""))
        typer.echo(f"step {ck['step']:>7}{flags}: tau_sim {num(ck.get('tau_sim'))}, AL "
                   f"{num(ck.get('acceptance_length'))}" + (f", speedup {speed}{where}" if speed else ""))


@jobs_app.command("download")
def download(
    job_id: str,
    out: Path | None = typer.Option(
        None, "--out", help="Destination folder (default: JOB_ID-step_NNNNNN, the folder the archive unpacks to)."
    ),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: the best)."),
    training_state: bool = typer.Option(
        False, "--training-state", help="Also download training_state.pt (optimizer/RNG state, for resuming)."
    ),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """Download a checkpoint's vLLM files (resumable, sha256-verified) and print the vllm serve command."""
    with _client(url, api_key) as c:
        try:
            ck = c.select_checkpoint(job_id, step)
            dest = out if out is not None else Path(ck["folder"])  # what the archive unpacks to
            paths = c.download_checkpoint(job_id, int(ck["step"]), dest, training_state=training_state)
            for p in paths:
                typer.echo(str(p))
        except ServiceError as exc:
            _fail(exc)
    typer.echo(f"serve with: vllm serve {serve_path(dest)}")


def serve_path(folder: Path) -> str:
    """How `vllm serve` names a downloaded folder: relative ones as `./NAME` (never mistaken for a hub id)."""
    text = str(folder)
    return shlex.quote(text if folder.is_absolute() or text.startswith(".") else f"./{text}")
