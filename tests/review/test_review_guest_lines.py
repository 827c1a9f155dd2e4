"""Hostile review, round 2: what a sandbox's guest sends the host is bounded.

The daemon reads the guest agent's replies (exec output, ``GET /v1/sandboxes/ID/files``)
with ``engine.qmp.LineSocket.readline``, which buffers until a newline however long the
line: the guest is the untrusted party of a sandbox runtime, and one reply can grow the
daemon's memory by whatever it sends before the request's deadline. Writes into a guest
were capped at 64 MiB (controller/app.py MAX_FILE_BYTES; now 32 MiB, the agent's MAX_FILE); a
reply to a read of such a file is about 86 MiB of base64, so a line of 96 MiB is past any
reply the host asked for.
The buffer is also searched from its start on every 64 KiB received: reading one such
line costs quadratic CPU (~35 s for 128 MiB here).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from forkd.engine.agent_client import AgentClient
from forkd.engine.errors import AgentError
from forkd.engine.qmp import MAX_LINE, LineSocket, LineTooLong

SENT = 96 << 20
CHUNK = 1 << 20


def _guest(sock: socket.socket) -> None:
    """A hostile guest: one 96 MiB line, then a newline."""
    block = b"A" * CHUNK
    with contextlib.suppress(OSError):
        for _ in range(SENT // CHUNK):
            sock.sendall(block)
        sock.sendall(b"\n")
    sock.close()


def test_a_guest_cannot_send_the_host_an_unbounded_line() -> None:
    host, guest = socket.socketpair()
    sender = threading.Thread(target=_guest, args=(guest,), daemon=True)
    sender.start()
    reader = LineSocket(host)
    line = b""
    try:
        line = reader.readline(time.monotonic() + 60, "guest agent")
    except TimeoutError:
        pytest.fail("no answer within 60 s: neither the line nor a refusal")
    except Exception:  # refused with an error: what a fix should do
        line = b""
    finally:
        host.close()
        sender.join(60)
    assert len(line) < SENT, f"buffered and returned a {len(line) >> 20} MiB line"


def test_the_refusal_names_the_peer_and_closes_the_connection() -> None:
    host, guest = socket.socketpair()
    reader = LineSocket(host, max_line=1000)
    guest.sendall(b"x" * 1001)
    with pytest.raises(LineTooLong, match="guest agent \\(get\\) sent a line longer than 1000"):
        reader.readline(time.monotonic() + 10, "guest agent (get)")
    assert host.fileno() == -1  # closed: the rest of the line is never read
    guest.close()


@pytest.mark.parametrize("newline_in_chunk", [False, True])
def test_a_line_at_the_bound_is_read_one_past_it_is_refused(newline_in_chunk: bool) -> None:
    """The bound counts the line without its newline, also when the newline arrives in
    the same chunk as the excess (a check only on bytes without a newline misses it)."""
    host, guest = socket.socketpair()
    reader = LineSocket(host, max_line=1000)
    guest.sendall(b"a" * 1000 + b"\n" + b"b" * 1001 + (b"\n" if newline_in_chunk else b""))
    assert reader.readline(time.monotonic() + 10, "peer") == b"a" * 1000 + b"\n"
    with pytest.raises(LineTooLong):
        reader.readline(time.monotonic() + 10, "peer")
    guest.close()


def test_lines_queued_in_one_chunk_come_one_by_one() -> None:
    host, guest = socket.socketpair()
    reader = LineSocket(host)
    guest.sendall(b'{"a": 1}\n{"b": 2}\n{"c"')
    deadline = time.monotonic() + 10
    assert reader.readline(deadline, "peer") == b'{"a": 1}\n'
    assert reader.readline(deadline, "peer") == b'{"b": 2}\n'
    guest.sendall(b": 3}\n")
    assert reader.readline(deadline, "peer") == b'{"c": 3}\n'
    host.close()
    guest.close()


class _Trickle:
    """A peer that delivers one long line in small pieces (socket interface the reader
    uses: ``settimeout``, ``recv``)."""

    def __init__(self, size: int, piece: int) -> None:
        self.left, self.piece = size, piece

    def settimeout(self, _: float) -> None:
        pass

    def recv(self, _: int) -> bytes:
        if self.left == 0:
            return b"\n"
        n = min(self.piece, self.left)
        self.left -= n
        return b"A" * n

    def close(self) -> None:
        pass


class _CountedBuffer(bytearray):
    """The reader's receive buffer, counting the bytes its newline searches go over."""

    searched = 0

    def find(self, sub: Any, start: Any = 0, *rest: Any) -> int:
        self.searched += len(self) - (start or 0)
        return super().find(sub, start, *rest)


def test_a_line_in_small_pieces_is_read_in_linear_time() -> None:
    """16 MiB in 1 KiB pieces: searching the whole buffer on every piece scans ~128 GB
    (many seconds); searching only the new bytes scans 16 MiB. Counted, not timed (it
    was < 3 s, a speed goal a loaded machine can miss)."""
    reader = LineSocket(_Trickle(16 << 20, 1024))  # type: ignore[arg-type]
    reader._buf = buf = _CountedBuffer()
    line = reader.readline(time.monotonic() + 60, "peer")
    assert len(line) == (16 << 20) + 1
    assert buf.searched <= 2 * (16 << 20), f"{buf.searched / (16 << 20):.0f} times the line"


def test_the_bound_is_the_protocols_and_fits_the_largest_reply() -> None:
    """docs/agent-protocol.md: a line is at most 64 MiB; a ``get`` of a file at the
    agent's limit (engine/guest/agent.py MAX_FILE) is its base64 plus a little JSON."""
    from forkd.engine.guest import agent

    assert MAX_LINE == agent.MAX_LINE
    assert (agent.MAX_FILE + 2) // 3 * 4 + 4096 < MAX_LINE


def test_the_agent_client_turns_a_long_reply_into_an_agent_error(tmp_path: Path) -> None:
    """The daemon's caller sees an AgentError naming the request, not a raw exception."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def guest() -> None:
        conn, _ = server.accept()
        with conn, contextlib.suppress(OSError):
            conn.recv(1 << 16)  # the request
            block = b"A" * CHUNK
            for _ in range((MAX_LINE // CHUNK) + 2):
                conn.sendall(block)

    sender = threading.Thread(target=guest, daemon=True)
    sender.start()
    client = AgentClient(path, timeout=10)
    try:
        with pytest.raises(AgentError, match=r"guest agent \(get\) sent a line longer"):
            client.request("get", {"path": "/etc/hostname"}, timeout=60)
    finally:
        client.close()
        sender.join(60)
        server.close()
