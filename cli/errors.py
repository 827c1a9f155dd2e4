"""One place that turns forkd errors into a message on stderr and the family's exit code.
The message is inert (names.inert): a guest's words in it cannot drive the terminal."""

from __future__ import annotations

import sys
from typing import Any

import click

from forkd.errors import ForkdError
from forkd.names import inert

MAX_ERROR_CHARS = 16_000  # of an error printed; guest text in it (names.inert) is shown, not obeyed


class ForkdGroup(click.Group):
    """A command group whose commands' ForkdErrors end as ``forkd: error: …`` + exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ForkdError as exc:
            click.echo(f"forkd: error: {inert(exc, MAX_ERROR_CHARS)}", err=True)
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("forkd: interrupted", err=True)
            sys.exit(130)
