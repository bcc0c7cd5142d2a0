"""`peagle jobs retrain JOB --data ...` and `peagle promotion ...` against a running service (docs/retrain.md).

    peagle jobs retrain job_01... --data new.jsonl --data dataset:ds_01... --max-steps 200 --batch-size 1 --batch-size 8
    peagle promotion current | decisions [--job JOB] | promote JOB | undo TARGET
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from peagle.cli.jobs import _KEY, _URL, _client, _fail, _print
from peagle.client import PeagleClient, ServiceError
from peagle.spec import DATASET_PREFIX

__all__ = ["promotion_app", "register"]

promotion_app = typer.Typer(add_completion=False, no_args_is_help=True,
                            help="The current draft per target and its promotion decisions.")


def _data(c: PeagleClient, values: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Dataset ids and sources of `--data` values: `dataset:<id>`, `builtin:<name>`, or a local file (uploaded)."""
    datasets: list[str] = []
    sources: list[dict[str, Any]] = []
    for v in values:
        if v.startswith(DATASET_PREFIX):
            datasets.append(v.removeprefix(DATASET_PREFIX))
        elif v.startswith("builtin:"):
            sources.append({"path": v})
        elif Path(v).is_file():
            typer.echo(f"uploading {v} ...", err=True)
            datasets.append(str(c.upload_dataset(Path(v))["id"]))
        else:
            typer.echo(f"error: --data {v!r}: not a file here, a dataset:<id> or a builtin:<name>", err=True)
            raise typer.Exit(2)
    return datasets, sources


def retrain(
    job_id: str = typer.Argument(..., help="The succeeded job whose draft to continue from."),
    data: list[str] = typer.Option(..., "--data", help="New data: a local file (uploaded), dataset:<id> or "
                                   "builtin:<name>; repeat for several."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Sets optim.max_steps of the child."),
    override: str | None = typer.Option(None, "--override", help="JSON deep-merged into the parent's spec."),
    step: int | None = typer.Option(None, "--step", help="Start from this checkpoint step (default: the best)."),
    batch_size: list[int] = typer.Option([1], "--batch-size", help="Promote only if faster at every one of these "
                                         "batch sizes; repeat for several."),
    name: str | None = typer.Option(None, "--name"),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """Retrain: a child job warm-started from JOB's best checkpoint on new data; prints it as JSON. At its end
    it is measured beside the current draft and promoted only if it beats it (docs/retrain.md)."""
    overrides: dict[str, Any] = json.loads(override) if override else {}
    if max_steps is not None:
        overrides.setdefault("optim", {})["max_steps"] = max_steps
    with _client(url, api_key) as c:
        try:
            datasets, sources = _data(c, data)
            job = c.retrain(job_id, datasets=datasets, sources=sources, overrides=overrides or None,
                            checkpoint_step=step, promotion_batch_sizes=batch_size, name=name)
        except ServiceError as exc:
            _fail(exc)
    _print(job)


@promotion_app.command("current")
def current(target: str | None = typer.Option(None, "--target"), url: str = _URL, api_key: str | None = _KEY) -> None:
    """The current draft of each target (job and checkpoint step)."""
    with _client(url, api_key) as c:
        try:
            rows = c.promotion("current", target=target)
        except ServiceError as exc:
            _fail(exc)
    for r in rows:
        typer.echo(f"{r['target']}: {r['job_id']} step {r['checkpoint_step']} (since {r['updated_at']})")
    if not rows:
        typer.echo("no current draft")


@promotion_app.command("decisions")
def decisions(
    job: str | None = typer.Option(None, "--job", help="Decisions about this job or measured against it."),
    target: str | None = typer.Option(None, "--target"),
    as_json: bool = typer.Option(False, "--json", help="Every field, both sides' numbers included."),
    url: str = _URL, api_key: str | None = _KEY,
) -> None:
    """Promotion decisions, newest first: what was decided, by whom, and why."""
    with _client(url, api_key) as c:
        try:
            rows = c.promotion("decisions", job_id=job, target=target)
        except ServiceError as exc:
            _fail(exc)
    if as_json:
        _print(rows)
        return
    for r in rows:
        typer.echo(f"{r['created_at']} {r['decision']:<12} {r['job_id']} ({r['target']}, by {r['decided_by']}): "
                   f"{r['reason']}")


@promotion_app.command("promote")
def promote(job_id: str = typer.Argument(...), step: int | None = typer.Option(None, "--step"),
            url: str = _URL, api_key: str | None = _KEY) -> None:
    """Force: make a succeeded job the current draft of its target, unmeasured."""
    with _client(url, api_key) as c:
        try:
            _print(c.promote(job_id, step))
        except ServiceError as exc:
            _fail(exc)


@promotion_app.command("undo")
def undo(target: str = typer.Argument(..., help="The target (spec target.model)."),
         url: str = _URL, api_key: str | None = _KEY) -> None:
    """The current draft of TARGET goes back to the one before."""
    with _client(url, api_key) as c:
        try:
            _print(c.undo_promotion(target))
        except ServiceError as exc:
            _fail(exc)


def register(app: typer.Typer, jobs_app: typer.Typer) -> None:
    """`peagle jobs retrain` and `peagle promotion ...`."""
    jobs_app.command("retrain")(retrain)
    app.add_typer(promotion_app, name="promotion")
