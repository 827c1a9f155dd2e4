"""A small QMP client with deadlines (QEMU Machine Protocol over a unix socket)."""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from forkd.engine.errors import VMMError
from forkd.engine.paths import unix_address


class _State(enum.Enum):
    IDLE = "idle"
    RUNNING = "running"
    CLOSED = "closed"


def connect_unix(path: Path, deadline: float, alive: Callable[[], bool] | None = None,
                 what: str = "socket") -> socket.socket:
    """Connect to a unix socket that a process is about to create, until the deadline."""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            with unix_address(path) as address:
                s.connect(address)
            return s
        except OSError as e:
            s.close()
            if alive is not None and not alive():
                raise VMMError(f"QEMU exited before its {what} at {path} accepted a "
                               "connection; see its log") from e
            if time.monotonic() > deadline:
                raise VMMError(f"timed out connecting to the {what} at {path}") from e
            time.sleep(0.002)


# The longest line a peer may send (without its newline): docs/agent-protocol.md bounds a
# line at 64 MiB in both directions (the guest agent refuses longer requests, MAX_LINE in
# engine/guest/agent.py); its largest legitimate reply, a ``get`` of a file at the
# agent's 32 MiB limit, is ~43 MiB of base64. QMP replies are far smaller.
MAX_LINE = 64 << 20
RECV_CHUNK = 1 << 16


class LineTooLong(ValueError):
    """A peer sent a line over the bound; the connection is closed (mid-line, unusable)."""


class LineSocket:
    """Newline-delimited reads with an absolute deadline and a bound on a line's length."""

    def __init__(self, sock: socket.socket, max_line: int = MAX_LINE) -> None:
        self.sock = sock
        self.max_line = max_line
        # told the size the receive buffer is about to reach, before it does: it may raise
        # (the agent client's process-wide reply budget), and the connection is then broken
        self.on_grow: Callable[[int], None] | None = None
        self._buf = bytearray()
        self._scanned = 0  # bytes at the start of _buf known to hold no newline

    def readline(self, deadline: float, what: str) -> bytes:
        """The next line (with its newline) from ``what``, the peer named in errors:
        TimeoutError at the deadline, EOFError when it closes, LineTooLong when the line
        passes ``max_line``. Each received byte is searched once."""
        while True:
            i = self._buf.find(b"\n", self._scanned)
            if i > self.max_line or (i < 0 and len(self._buf) > self.max_line):
                self._too_long(what)
            if i >= 0:
                line = bytes(self._buf[: i + 1])
                del self._buf[: i + 1]
                self._scanned = 0
                return line
            self._scanned = len(self._buf)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from {what} in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(RECV_CHUNK)
            except TimeoutError:
                raise TimeoutError(f"no reply from {what} in time") from None
            if not chunk:
                raise EOFError(f"{what} closed the connection")
            if self.on_grow is not None:
                self.on_grow(len(self._buf) + len(chunk))
            self._buf += chunk

    def read_exact(self, n: int, deadline: float, what: str) -> bytes:
        """The next n bytes (a binary payload after a frame's header line), with the same
        deadline and errors as readline."""
        while len(self._buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from {what} in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(max(RECV_CHUNK, min(n - len(self._buf), 1 << 20)))
            except TimeoutError:
                raise TimeoutError(f"no reply from {what} in time") from None
            if not chunk:
                raise EOFError(f"{what} closed the connection")
            if self.on_grow is not None:
                self.on_grow(len(self._buf) + len(chunk))
            self._buf += chunk
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self._scanned = 0
        return data

    def _too_long(self, what: str) -> NoReturn:
        self._buf = bytearray()
        self._scanned = 0
        self.close()
        raise LineTooLong(
            f"{what} sent a line longer than {self.max_line} bytes, past the protocol's "
            "bound (docs/agent-protocol.md); the connection was closed"
        )

    def send(self, data: bytes, fds: list[int] | None = None) -> None:
        self.sock.settimeout(10.0)
        if fds:
            socket.send_fds(self.sock, [data], fds)
        else:
            self.sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class QMP:
    """QMP session: connect → greeting → qmp_capabilities → commands."""

    def __init__(self, path: Path, *, timeout: float = 30.0,
                 alive: Callable[[], bool] | None = None) -> None:
        deadline = time.monotonic() + timeout
        self._ls = LineSocket(connect_unix(path, deadline, alive, "QMP socket"))
        self._state = _State.IDLE
        self.events: list[dict[str, Any]] = []
        try:
            greeting = json.loads(self._ls.readline(deadline, "QMP greeting"))
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            self.close()
            raise VMMError(f"QEMU sent no QMP greeting on {path}: {e}") from e
        if "QMP" not in greeting:
            self.close()
            raise VMMError(f"unexpected QMP greeting {greeting!r}")
        self.version: dict[str, Any] = greeting["QMP"].get("version", {})
        self.command("qmp_capabilities")

    def command(self, name: str, args: dict[str, Any] | None = None, *, timeout: float = 30.0,
                fds: list[int] | None = None) -> Any:
        if self._state is _State.CLOSED:
            raise VMMError(f"QMP command {name!r} on a closed connection")
        msg: dict[str, Any] = {"execute": name}
        if args:
            msg["arguments"] = args
        deadline = time.monotonic() + timeout
        self._state = _State.RUNNING
        try:
            self._ls.send(json.dumps(msg).encode() + b"\n", fds)
            while True:
                reply = json.loads(self._ls.readline(deadline, f"QMP {name}"))
                if "event" in reply:
                    self.events.append(reply)
                    continue
                if "error" in reply:
                    err = reply["error"]
                    raise VMMError(f"QMP {name} failed: {err.get('class')}: {err.get('desc')}")
                return reply.get("return")
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            self.close()
            raise VMMError(f"QMP {name}: {e}") from e
        finally:
            if self._state is _State.RUNNING:
                self._state = _State.IDLE

    def status(self) -> str:
        return str(self.command("query-status")["status"])

    def wait_status(self, wanted: set[str], *, timeout: float = 60.0,
                    transient: frozenset[str] = frozenset({"inmigrate", "prelaunch",
                                                           "restore-vm", "finish-migrate",
                                                           "postmigrate"})) -> str:
        deadline = time.monotonic() + timeout
        while True:
            st = self.status()
            if st in wanted:
                return st
            if st not in transient:
                raise VMMError(f"VM entered state {st!r} while waiting for {sorted(wanted)}")
            if time.monotonic() > deadline:
                raise VMMError(f"VM still {st!r} after {timeout:.0f} s (wanted {sorted(wanted)})")
            time.sleep(0.001)

    def close(self) -> None:
        self._state = _State.CLOSED
        self._ls.close()
