"""Hostile review, round 3: ``GET /v1/sandboxes/ID/files`` held the whole file in the daemon.

The engine reads a guest file in 1 MiB chunks up to 4 GiB, and a size the guest decides:
a file the sandbox's code made huge, or ``path=/dev/zero`` (the agent reads a character
device until the 4 GiB bound). The daemon joined every chunk into one ``bytes`` before it
answered, so one request could take 8 GiB of the host's memory, and a few at once more.
Now the route streams: the daemon holds at most FILE_QUEUE chunks for a slow reader, and a
reader that goes away ends the transfer.

The real app and uvicorn on a Unix socket with a backend whose file never ends (the
daemon's streaming, not a guest's, is under test; the guest side is the engine's
``get_chunks``, tested against a protocol-speaking peer below). No VM is started.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from forkd.audit import AuditLog
from forkd.controller import app, client
from forkd.controller.backend import FILE_QUEUE, Handoff, ReaderGone, produced
from forkd.controller.sdk import Sandbox
from forkd.engine.agent_client import AgentClient
from forkd.errors import InvalidInput, NotFound

CHUNK = 1 << 20


class EndlessFile:
    """A backend whose file ``/dev/zero`` never ends, made by the daemon's own producer
    (backend.produced), as LocalBackend.read_file makes it from the guest's chunks."""

    def __init__(self) -> None:
        self.produced = 0
        self.stopped = threading.Event()

    def read_file(self, sandbox_id: str, path: str) -> Iterator[bytes]:
        if path != "/dev/zero":
            raise NotFound(f"no file {path} in the guest")

        def run(chunks: Handoff) -> None:
            try:
                while True:
                    if not chunks.put(b"\0" * CHUNK):
                        raise ReaderGone("gone")
                    self.produced += 1
            finally:
                self.stopped.set()

        return produced("endless", run, FILE_QUEUE)


@pytest.fixture
def endless(tmp_path: Path) -> Iterator[tuple[EndlessFile, Path]]:
    backend = EndlessFile()
    sock = tmp_path / "files.sock"
    the_app = app.create_app(backend, AuditLog(tmp_path / "audit.log"), app.ControllerMetrics(),
                             None)
    server = uvicorn.Server(uvicorn.Config(the_app, uds=str(sock), log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield backend, sock
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_file_is_streamed_with_bounded_memory_and_ends_with_its_reader(
    endless: tuple[EndlessFile, Path],
) -> None:
    backend, sock = endless
    remote = client.RemoteBackend(socket=sock)
    chunks = remote.read_file("f-1", "/dev/zero")
    got = 0
    for chunk in chunks:
        got += len(chunk)
        if got >= 3 * CHUNK:
            break
    time.sleep(1.5)  # a reader that does not read: the daemon waits, it does not buffer
    ahead = backend.produced - got // CHUNK
    bound = FILE_QUEUE + app.FILE_CHUNKS + 8  # the two queues, and the sockets' buffers
    assert ahead <= bound, f"{ahead} MiB produced ahead of a reader that stopped"
    chunks.close()
    remote.close()
    assert backend.stopped.wait(30), "the transfer went on after its reader left"
    with client.RemoteBackend(socket=sock).http as http:
        assert http.get("/healthz").status_code == 200


def test_a_missing_file_is_a_404_before_the_answer_starts(
    endless: tuple[EndlessFile, Path],
) -> None:
    _backend, sock = endless
    remote = client.RemoteBackend(socket=sock)
    try:
        with pytest.raises(NotFound, match="no file /nope"):
            b"".join(remote.read_file("f-1", "/nope"))
    finally:
        remote.close()


def _hostile_guest(server: socket.socket, chunks: int) -> None:
    """A guest agent that answers a get with ``chunks`` chunk events and no reply."""
    conn, _ = server.accept()
    with conn, contextlib.suppress(OSError):
        request = json.loads(conn.makefile("rb").readline())
        header = json.dumps({"id": request["id"], "ev": "chunk", "size": CHUNK}).encode()
        for _ in range(chunks):
            conn.sendall(header + b"\n" + b"\0" * CHUNK)


def test_the_engine_passes_chunks_on_and_stops_when_told(tmp_path: Path) -> None:
    """AgentClient.get_chunks keeps none of what it passes on, and an exception from the
    receiver ends the transfer (what the daemon does when its reader left)."""
    path = tmp_path / "agent.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    guest = threading.Thread(target=_hostile_guest, args=(server, 64), daemon=True)
    guest.start()
    agent = AgentClient(path, timeout=10)
    seen: list[int] = []

    def receive(data: bytes) -> None:
        seen.append(len(data))
        if len(seen) == 5:
            raise ReaderGone("enough")

    try:
        with pytest.raises(ReaderGone):
            agent.get_chunks("/dev/zero", receive, timeout=30)
    finally:
        agent.close()
        guest.join(30)
        server.close()
    assert seen == [CHUNK] * 5


def test_sdk_and_mcp_reads_through_the_daemon(endless: tuple[EndlessFile, Path]) -> None:
    """The MCP tool reads a file only as far as its bound, then ends the transfer."""
    mcp = pytest.importorskip("forkd.controller.mcp")
    from forkd import Controller

    backend, sock = endless
    tools = mcp.Tools(Controller(socket=sock), scope=mcp.SandboxScope(["f-1"]))
    with pytest.raises(InvalidInput, match=f"over the {mcp.MAX_FILE_BYTES} bytes"):
        tools.read_file("f-1", "/dev/zero")
    assert backend.stopped.wait(30), "the MCP read went on past its bound"
    assert backend.produced <= mcp.MAX_FILE_BYTES // CHUNK + FILE_QUEUE + app.FILE_CHUNKS + 8
    with pytest.raises(NotFound):
        Sandbox(controller=Controller(socket=sock), sandbox_id="f-1").files.read("/nope")
