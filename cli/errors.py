"""One place that turns forkd errors into a message on stderr and the family's exit code."""

from __future__ import annotations

import sys
from typing import Any

import click

from forkd.errors import ForkdError


class ForkdGroup(click.Group):
    """A command group whose commands' ForkdErrors end as ``forkd: error: …`` + exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ForkdError as exc:
            click.echo(f"forkd: error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("forkd: interrupted", err=True)
            sys.exit(130)
