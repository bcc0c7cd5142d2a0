"""Operator commands: `python -m api.admin create-key --owner NAME --scope write` (prints the secret ONCE),
`list-keys`, `revoke-key PREFIX`, `reencrypt-webhook-secrets`, `migrate`. The database URL comes from `service.settings.get_settings()`.
"""

from __future__ import annotations

import sqlalchemy as sa
import typer

from service.db import repo
from service.db.models import ApiKey, Owner
from service.db.session import make_engine, make_session_factory, session_scope
from service.settings import get_settings

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Administer the peagle service.")


def _sessions():
    settings = get_settings()
    from service.db import upgrade

    url = settings.resolved_database_url()
    if settings.embedded and url.startswith("sqlite"):
        upgrade(url)
    return make_session_factory(make_engine(url))


@app.command("create-key")
def create_key(
    owner: str = typer.Option(..., "--owner", help="Owner name (created if new)."),
    scope: list[str] = typer.Option(["write"], "--scope", help="read | write | admin (repeatable)."),
    name: str = typer.Option("", "--name", help="A label for the key."),
) -> None:
    """Create an API key and print its secret (shown once; only its hash is stored)."""
    try:
        with session_scope(_sessions()) as s:
            row, secret = repo.create_key(s, owner, scope, name)
            prefix = row.prefix
    except ValueError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    typer.echo(secret)
    typer.echo(f"created key {prefix} for owner {owner!r} with scopes {sorted(scope)}; store the secret now, "
               "it is not shown again", err=True)


@app.command("list-keys")
def list_keys() -> None:
    """List keys (prefix, owner, scopes, revoked)."""
    with session_scope(_sessions()) as s:
        for key, owner in s.execute(sa.select(ApiKey, Owner.name).join(Owner)).all():
            state = "revoked" if key.revoked_at else "active"
            typer.echo(f"{key.prefix}\t{owner}\t{','.join(key.scopes)}\t{state}\t{key.name}")


@app.command("revoke-key")
def revoke_key(prefix: str = typer.Argument(..., help="The key's prefix (second part of the key).")) -> None:
    """Revoke a key: it stops working at once (and so do its cookies and stream tokens)."""
    with session_scope(_sessions()) as s:
        if not repo.revoke_key(s, prefix):
            typer.echo(f"error: no active key with prefix {prefix!r}", err=True)
            raise typer.Exit(1)
    typer.echo(f"revoked {prefix}")


@app.command("reencrypt-webhook-secrets")
def reencrypt_webhook_secrets() -> None:
    """Encrypt webhook secrets under the current PEAGLE_SECRET_KEY: plaintext ones (from before migration 0003)
    and ones under PEAGLE_SECRET_KEY_PREVIOUS (after a rotation). Safe to run while the service runs."""
    from service.crypto import SecretError
    from service.db import webhooks as wh

    settings = get_settings()
    problem = settings.secret_key_problem()
    if problem:
        typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(2)
    try:
        with _sessions()() as s:
            n = wh.rewrap_secrets(s, wh.secret_box(settings))
    except SecretError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"re-encrypted {n} webhook secret(s)")


@app.command("migrate")
def migrate() -> None:
    """Apply every migration (`alembic upgrade head`)."""
    from service.db import upgrade

    upgrade(get_settings().resolved_database_url())
    typer.echo("database at head")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
