"""Shared printing helpers: JSON output, sizes, and progress bars."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from forkd.units import human_bytes

console = Console(stderr=True)


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


def human(n: int | float | None) -> str:
    return human_bytes(n)


@contextlib.contextmanager
def progress_bar(description: str, total: int | None) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (silent when stderr is not a terminal)."""
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    ) as bar:
        task = bar.add_task(description, total=total)
        lock_free_advance = bar.advance

        def advance(n: int) -> None:
            lock_free_advance(task, n)

        yield advance
