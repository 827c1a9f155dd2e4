"""`forkd` commands of the hub (registered by forkd.cli.main)."""

import click


def register(cli: click.Group) -> None:
    """Add the hub's commands to the top-level group."""
