"""A small QMP client with deadlines (QEMU Machine Protocol over a unix socket)."""

from __future__ import annotations

import contextlib
import enum
import json
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd.engine.errors import VMMError


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
            s.connect(str(path))
            return s
        except OSError as e:
            s.close()
            if alive is not None and not alive():
                raise VMMError(f"QEMU exited before its {what} at {path} accepted a "
                               "connection; see its log") from e
            if time.monotonic() > deadline:
                raise VMMError(f"timed out connecting to the {what} at {path}") from e
            time.sleep(0.002)


class LineSocket:
    """Newline-delimited reads with an absolute deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def readline(self, deadline: float, what: str) -> bytes:
        while True:
            i = self._buf.find(b"\n")
            if i >= 0:
                line = bytes(self._buf[: i + 1])
                del self._buf[: i + 1]
                return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no reply from {what} in time")
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 16)
            except TimeoutError:
                raise TimeoutError(f"no reply from {what} in time") from None
            if not chunk:
                raise EOFError(f"{what} closed the connection")
            self._buf += chunk

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
        except (TimeoutError, EOFError, ValueError) as e:
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
