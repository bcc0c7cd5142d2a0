"""`peagle drafts ...`: uploaded draft checkpoints for warm starts, against a running service (docs/warm_start.md).

    peagle drafts upload ./my-export          # a folder (packed as a tar.gz) or a .tar/.tar.gz/.tgz/.zip
    peagle drafts list [--json]
    peagle drafts delete drf_...

`upload` prints the draft's id, status and the `draft.init_from` value to use; an `invalid` draft (the
export validator refused it) prints the reason and exits 1.
"""

from __future__ import annotations

from pathlib import Path

import typer

from peagle.cli.jobs import _KEY, _URL, _client, _fail, _print
from peagle.client import ServiceError
from peagle.errors import PeagleError

__all__ = ["drafts_app", "register"]

drafts_app = typer.Typer(add_completion=False, no_args_is_help=True,
                         help="Uploaded draft checkpoints: the start of warm-started jobs (draft.init_from).")


@drafts_app.command("upload")
def upload(
    path: Path = typer.Argument(..., help="An export folder (packed as a tar.gz) or an archive of one."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole draft record."),
    url: str = _URL,
    api_key: str | None = _KEY,
) -> None:
    """Upload a draft checkpoint; prints its id, status and the `draft.init_from` value."""
    if not path.exists():
        typer.echo(f"error: {path}: no such file or folder", err=True)
        raise typer.Exit(2)
    with _client(url, api_key) as c:
        try:
            d = c.upload_draft(path)
        except ServiceError as exc:
            _fail(exc)
        except (PeagleError, OSError) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    if as_json:
        _print(d)
    else:
        typer.echo(f"{d['id']} {d['status']}" + (f" init_from={d['init_from']}" if d["status"] == "ready" else
                                                  f": {(d.get('report') or {}).get('error')}"))
    if d["status"] != "ready":
        raise typer.Exit(1)


@drafts_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json"), url: str = _URL, api_key: str | None = _KEY) -> None:
    """The uploaded drafts, newest first: id, status, size, file name."""
    with _client(url, api_key) as c:
        try:
            rows = c.list_drafts()
        except ServiceError as exc:
            _fail(exc)
    if as_json:
        _print(rows)
        return
    for d in rows:
        typer.echo(f"{d['id']} {d['status']:<8} {d['size']:>12} {d['created_at']} {d['filename']}")
    if not rows:
        typer.echo("no uploaded drafts")


@drafts_app.command("delete")
def delete(draft_id: str = typer.Argument(...), url: str = _URL, api_key: str | None = _KEY) -> None:
    """Delete an uploaded draft (refused while an unfinished job starts from it)."""
    with _client(url, api_key) as c:
        try:
            c.delete_draft(draft_id)
        except ServiceError as exc:
            _fail(exc)
    typer.echo(f"deleted {draft_id}")


def register(app: typer.Typer) -> None:
    """Add `peagle drafts` to the app."""
    app.add_typer(drafts_app, name="drafts")
