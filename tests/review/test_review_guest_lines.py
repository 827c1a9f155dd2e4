"""Hostile review, round 2: what a sandbox's guest sends the host is bounded.

The daemon reads the guest agent's replies (exec output, ``GET /v1/sandboxes/ID/files``)
with ``engine.qmp.LineSocket.readline``, which buffers until a newline however long the
line: the guest is the untrusted party of a sandbox runtime, and one reply can grow the
daemon's memory by whatever it sends before the request's deadline. Writes into a guest
are capped (controller/app.py MAX_FILE_BYTES, 64 MiB); a reply to a read of such a file
is about 86 MiB of base64, so a line of 96 MiB is past any reply the host asked for.
The buffer is also searched from its start on every 64 KiB received: reading one such
line costs quadratic CPU (~35 s for 128 MiB here).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from forkd.engine.qmp import LineSocket

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


@pytest.mark.xfail(
    strict=True,
    reason="engine/qmp.py:LineSocket.readline has no line bound: a guest reply of any "
    "size is buffered in the daemon",
)
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
