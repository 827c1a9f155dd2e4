"""Shared printing helpers: JSON output, sizes, and progress bars."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any, TextIO

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

from forkd.names import InertStream
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


def is_terminal(stream: TextIO) -> bool:
    """``stream`` is a terminal (a pipe, a file, a closed stream: not)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


RAW_HELP = ("Write the guest's stdout and stderr exactly as they come, control characters "
            "included, even to a terminal (to a pipe or a file they always are).")


class GuestOutput:
    """A guest program's stdout and stderr, written to this process's own as they come.

    To a terminal each is written inert (names.InertStream): ESC (CSI, OSC 52 clipboard
    writes, title changes), a lone CR, BEL, C1 controls and bidi overrides appear as
    escapes (``\\x1b``), newlines and tabs stay. To a pipe or a file, or with ``raw``
    (``--raw``), the text is written exactly as the guest gave it: what a redirect saves
    is the program's output, byte for byte, and a terminal takes it only when asked.

    A line forkd writes itself (a status, an error, a rich result) starts on a line of its
    own: ``own_line`` ends an unfinished guest line first, on that stream and, when both
    are the same terminal's, on the other, so a guest that stops mid-line cannot make
    forkd's words the end of a line it began."""

    def __init__(self, raw: bool = False) -> None:
        self._streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        self._raw = {name: raw or not is_terminal(s) for name, s in self._streams.items()}
        self._inert = {name: InertStream() for name in self._streams}
        self._open = {name: False for name in self._streams}  # a line begun, not ended

    def write(self, which: str, text: str) -> None:
        """Write the guest's ``text`` to ``which`` ("stdout" or "stderr")."""
        if self._raw[which]:
            # exact, but what UTF-8 can hold: a lone surrogate (a guest's JSON may carry
            # one) would end the command in an UnicodeEncodeError; it is written as "?"
            shown = text if text.isascii() else text.encode("utf-8", "replace").decode()
        else:
            shown = self._inert[which].feed(text)
        if shown:
            stream = self._streams[which]
            stream.write(shown)
            stream.flush()
            self._open[which] = not shown.endswith("\n")

    def finish(self) -> None:
        """The guest's output has ended: what a terminal's stream still held (a CR at its
        very end, which no LF followed) is written, as its escape."""
        for which, stream in self._streams.items():
            held = "" if self._raw[which] else self._inert[which].end()
            if held:
                stream.write(held)
                stream.flush()
                self._open[which] = True

    def own_line(self, err: bool) -> None:
        """Before forkd writes a line of its own to stderr (err) or stdout."""
        which = "stderr" if err else "stdout"
        other = "stdout" if err else "stderr"
        self._end(which)
        if not self._raw[which] and not self._raw[other]:  # both go to a terminal
            self._end(other)

    def _end(self, which: str) -> None:
        stream = self._streams[which]
        held = "" if self._raw[which] else self._inert[which].end()
        if held or self._open[which]:
            stream.write(held + "\n")
            stream.flush()
            self._open[which] = False
