"""The `forkd` command: parse, call the core/engine/hub, print. Errors → messages + exit codes."""

from __future__ import annotations

import click

from forkd import __version__
from forkd.cli import (
    controller_cmds,
    demo_cmds,
    engine_cmds,
    hub_cmds,
    mcp_cmds,
    quickstart_cmds,
    remote_cmds,
    secret_cmds,
    store_cmds,
)
from forkd.cli.errors import ForkdGroup


@click.group(cls=ForkdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="forkd")
def cli() -> None:
    """forkd: fork copy-on-write microVMs from warm snapshots; share them as packs.

    The local store lives in $FORKD_HOME (default ~/.local/share/forkd).
    """


store_cmds.register(cli)
demo_cmds.register(cli)
remote_cmds.register(cli)
engine_cmds.register(cli)
hub_cmds.register(cli)
mcp_cmds.register(cli)
controller_cmds.register(cli)
quickstart_cmds.register(cli)
secret_cmds.register(cli)


def main() -> None:
    cli(prog_name="forkd")
