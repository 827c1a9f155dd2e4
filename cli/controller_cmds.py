"""`forkd serve`: the controller daemon (REST API for snapshots and sandboxes)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.option(
    "--socket",
    "socket_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Unix socket to serve on (default $FORKD_RUN/controller.sock).",
)
@click.option("--listen", help="Also serve on TCP HOST:PORT; requests need the bearer token.")
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Read the TCP bearer token from this file (default: "
    "$FORKD_CONTROLLER_TOKEN, else $FORKD_RUN/controller.token, made once).",
)
@click.option(
    "--audit-log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append-only JSON audit log (default $FORKD_HOME/controller-audit.log).",
)
def serve(
    socket_path: Path | None, listen: str | None, token_file: Path | None, audit_log: Path | None
) -> None:
    """Run the controller daemon: owns this host's store and sandboxes (docs/api.md)."""
    from forkd.controller import server
    from forkd.controller.client import default_socket

    token = token_file.read_text().strip() if token_file else None
    if listen:
        shown = token_file or server.token_path()
        click.echo(
            f"forkd controller: TCP {listen} (bearer token: {shown} or $FORKD_CONTROLLER_TOKEN)",
            err=True,
        )
    click.echo(f"forkd controller: unix socket {socket_path or default_socket()}", err=True)
    server.serve(socket_path, listen, audit_log, token)


def register(cli: click.Group) -> None:
    cli.add_command(serve)
