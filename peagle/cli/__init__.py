"""The `peagle` command line (typer). Errors are one line with the reason and a non-zero exit.

Commands are registered by the modules that own them; this file only assembles the app.
"""

from __future__ import annotations

import sys

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Train, evaluate and export P-EAGLE drafts.")


@app.callback()
def _root() -> None:
    """Train, evaluate and export P-EAGLE drafts; talk to a running peagle service."""


@app.command("fixtures")
def fixtures_cmd(
    which: str = typer.Argument("all", help="smollm2 | tiny | parity | all"),
) -> None:
    """Build the offline fixture folders (SmolLM2-135M-Instruct, tiny Llama, the parity draft: a SmolLM2
    draft trained for a few minutes) into the cache."""
    from peagle import builtin

    if which not in ("smollm2", "tiny", "parity", "all"):
        typer.echo(f"error: unknown fixture {which!r} (smollm2 | tiny | parity | all)", err=True)
        raise typer.Exit(2)
    if which in ("smollm2", "all"):
        typer.echo(f"smollm2: {builtin.smollm2_dir()}")
    if which in ("tiny", "all"):
        typer.echo(f"tiny: {builtin.tiny_llama_dir()}")
    if which in ("parity", "all"):
        from peagle.parity_fixture import parity_draft_dir

        typer.echo(f"parity: {parity_draft_dir()}")


from peagle.cli import run as cli_run  # noqa: E402 - train, export, eval, validate

cli_run.register(app)
from peagle.cli.jobs import jobs_app  # noqa: E402 - `peagle jobs ...` against a running service

app.add_typer(jobs_app, name="jobs")
from peagle.cli import retrain as cli_retrain  # noqa: E402 - `peagle jobs retrain`, `peagle promotion ...`

cli_retrain.register(app, jobs_app)
from peagle.cli import drafts as cli_drafts  # noqa: E402 - `peagle drafts upload|list|delete`

cli_drafts.register(app)


def main() -> None:
    """Entry point of the `peagle` console script."""
    try:
        app()
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
