"""The real guest agent (engine/guest/agent.py) run on the host, its port a pseudo-terminal
in raw mode, behind a unix socket that behaves like QEMU's agent chardev (one client at a
time). Protocol and relay tests run against it in seconds; tests/engine/test_agent_v2_vm.py
runs the same protocol in real VMs."""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import subprocess
import sys
import threading
import tty
from collections.abc import Iterator
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "engine" / "guest" / "agent.py"


class FakeChardev:
    """Accepts one client at a time on path and shuttles bytes to and from the pty master."""

    def __init__(self, path: Path, master: int) -> None:
        self.path = path
        self.master = master
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            self.listener.settimeout(0.2)
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self._shuttle(conn)

    def _shuttle(self, conn: socket.socket) -> None:
        sel = selectors.DefaultSelector()
        sel.register(conn, selectors.EVENT_READ, "conn")
        sel.register(self.master, selectors.EVENT_READ, "pty")
        try:
            while not self.stop.is_set():
                for key, _ in sel.select(0.2):
                    if key.data == "conn":
                        data = conn.recv(1 << 20)
                        if not data:
                            return
                        view = memoryview(data)
                        while view:
                            n = os.write(self.master, view)
                            view = view[n:]
                    else:
                        try:
                            data = os.read(self.master, 1 << 20)
                        except OSError:
                            return
                        conn.sendall(data)
        except OSError:
            return
        finally:
            sel.close()
            conn.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.listener.close()


@contextlib.contextmanager
def host_agent(d: Path) -> Iterator[subprocess.Popen[bytes]]:
    """d/agent.sock served by a host-run agent; yields its process."""
    master, slave = os.openpty()
    tty.setraw(slave)
    tty.setraw(master)
    port = os.ttyname(slave)
    with open(d / "agent.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, str(AGENT), port], stdout=subprocess.DEVNULL,
                                stderr=log, start_new_session=True)
    # the hello line is written at once; read it off so clients start clean
    buf = b""
    while b"\n" not in buf:
        buf += os.read(master, 4096)
    chardev = FakeChardev(d / "agent.sock", master)
    try:
        yield proc
    finally:
        chardev.close()
        proc.kill()
        proc.wait()
        os.close(master)
        os.close(slave)
