"""`forkd` commands of the engine (registered by forkd.cli.main)."""

import click


def register(cli: click.Group) -> None:
    """Add the engine's commands to the top-level group."""
