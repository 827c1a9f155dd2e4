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
    help="Read the TCP bearer token (32 to 4096 bytes) from this file, your own with mode "
    "0600 (default: $FORKD_CONTROLLER_TOKEN, else $FORKD_RUN/controller.token, made once).",
)
@click.option(
    "--audit-log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Append-only JSON audit log (default $FORKD_HOME/controller-audit.log).",
)
@click.option(
    "--prewarm",
    "prewarm",
    multiple=True,
    metavar="TAG=K",
    help="Keep K QEMU processes started and waiting for TAG (repeatable); spawns of TAG "
    "take them first and the pool refills in the background.",
)
@click.option(
    "--max-sandboxes",
    type=click.IntRange(min=1),
    help="VMs the daemon runs at once: running sandboxes, pool processes and ones starting; "
    "a spawn, pool fill or resume past it is refused (409). Default 512.",
)
@click.option(
    "--max-sandboxes-per-client",
    type=click.IntRange(min=1),
    help="VMs one client (a uid on the socket, an address on TCP) may have started and still "
    "run: sandboxes it spawned or resumed, pools it filled; past it a spawn, pool fill or "
    "resume is refused (429). Default: half of --max-sandboxes.",
)
def serve(
    socket_path: Path | None,
    listen: str | None,
    token_file: Path | None,
    audit_log: Path | None,
    prewarm: tuple[str, ...],
    max_sandboxes: int | None,
    max_sandboxes_per_client: int | None,
) -> None:
    """Run the controller daemon: owns this host's store and sandboxes (docs/api.md)."""
    from forkd.controller import server
    from forkd.controller.backend import MAX_SANDBOXES
    from forkd.controller.client import default_socket

    pools = [_prewarm_arg(p) for p in prewarm]
    if listen:
        shown = token_file or server.token_path()
        click.echo(
            f"forkd controller: TCP {listen} (bearer token: {shown} or $FORKD_CONTROLLER_TOKEN)",
            err=True,
        )
    click.echo(f"forkd controller: unix socket {socket_path or default_socket()}", err=True)
    for tag, k in pools:
        click.echo(f"forkd controller: prewarming {k} processes for {tag}", err=True)
    server.serve(socket_path, listen, audit_log, token_file, pools,
                 max_sandboxes or MAX_SANDBOXES, max_sandboxes_per_client)


def _prewarm_arg(text: str) -> tuple[str, int]:
    tag, sep, k = text.rpartition("=")
    if not sep or not tag or not k.strip().isdigit():
        raise click.BadParameter(f"{text!r}: expected TAG=K with K >= 0", param_hint="--prewarm")
    return tag, int(k)


def register(cli: click.Group) -> None:
    cli.add_command(serve)
