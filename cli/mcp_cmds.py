"""`forkd mcp`: the sandboxes as MCP tools for agents (docs/mcp.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal, cast

import click

DEFAULT_PORT = 7071
DEFAULT_PATH = "/mcp"


@click.command()
@click.option("--transport", type=click.Choice(["stdio", "http"]), default="stdio",
              show_default=True, help="stdio (the client starts forkd mcp) or streamable HTTP.")
@click.option("--controller", "mode", type=click.Choice(["auto", "daemon", "local"]),
              default="auto", show_default=True,
              help="auto: the daemon (forkd serve) if it answers on its socket, else the "
              "engine in this process; daemon or local: only that one.")
@click.option("--host", default="127.0.0.1", show_default=True, help="HTTP: address to bind.")
@click.option("--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True,
              help="HTTP: port.")
@click.option("--path", "http_path", default=DEFAULT_PATH, show_default=True,
              help="HTTP: the MCP endpoint's path.")
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path),
              help="HTTP: read the bearer token from this file, your own with mode 0600 "
              "(default: $FORKD_CONTROLLER_TOKEN, else $FORKD_RUN/controller.token, made once).")
@click.option("--sandbox", "sandboxes", multiple=True, metavar="ID",
              help="A sandbox made elsewhere (forkd fork, the SDK, REST) the tools may act on, "
              "besides the ones each client creates through them; repeatable.")
@click.option("--all-sandboxes", is_flag=True,
              help="The tools may act on every sandbox of the controller, other clients' and "
              "jobs' too (a prompt injection then reaches all of them).")
def mcp(transport: str, mode: str, host: str, port: int, http_path: str,
        token_file: Path | None, sandboxes: tuple[str, ...], all_sandboxes: bool) -> None:
    """Serve forkd's sandboxes as MCP tools: list snapshots, create sandboxes, run commands
    and code, read and write files, branch, fork from a branch, kill (docs/mcp.md)."""
    from forkd.controller import mcp as server
    from forkd.engine.lifecycle import ID_RE
    from forkd.errors import InvalidInput
    from forkd.names import shown

    if not http_path.startswith("/"):
        raise InvalidInput(f"--path {http_path!r} must start with /")
    for named in sandboxes:
        if not ID_RE.fullmatch(named):
            raise InvalidInput(f"--sandbox {shown(named)}: sandbox ids are 1-64 of a-z, 0-9 "
                               "and '-'; `forkd ls` lists them")
    scope = server.SandboxScope(sandboxes, everything=all_sandboxes)
    controller = server.choose_controller(cast(Literal["auto", "daemon", "local"], mode))
    where = "the daemon" if controller.remote else "the engine in this process"
    if transport == "stdio":
        click.echo(f"forkd mcp: stdio, sandboxes through {where}", err=True)
        server.serve_stdio(controller, scope)
        return
    from forkd.controller.server import load_token, token_path

    token = load_token(token_file)
    click.echo(f"forkd mcp: http://{host}:{port}{http_path}, sandboxes through {where} "
               f"(bearer token: {token_file or token_path()} or $FORKD_CONTROLLER_TOKEN)",
               err=True)
    server.serve_http(controller, host, port, http_path, token, scope)


def register(cli: click.Group) -> None:
    cli.add_command(mcp)
