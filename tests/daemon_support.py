"""The controller daemon for the tests that drive it: `forkd serve --listen` on a free
loopback port, or `forkd serve` on its unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
from net_support import free_port, running, wait_healthy, wait_until  # noqa: F401

from forkd.controller.backend import CALLER_STOP
from forkd.engine import children as ch
from forkd.engine.lifecycle import ChildInfo
from forkd.errors import ForkdError
from forkd.store.store import Store
from forkd.synthetic import write_base


@contextlib.contextmanager
def tcp_daemon(env: Mapping[str, str], log: Path, *args: str, timeout: float = 30) -> Iterator[str]:
    """Start the daemon with ``env`` over the environment, its output in ``log``; yield its
    URL once /healthz answers; stop it (SIGTERM, then wait) however the block ends."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen(["forkd", "serve", "--listen", f"127.0.0.1:{port}", *args],
                                env={**os.environ, **env}, stdout=out, stderr=out,
                                stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, "forkd serve", timeout)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def socket_daemon(
    env: Mapping[str, str], log: Path, timeout: float = 60
) -> subprocess.Popen[bytes]:
    """Start `forkd serve` on its unix socket ($FORKD_RUN/controller.sock) with exactly
    ``env``; return it once /healthz answers there (the caller stops it)."""
    sock = Path(env["FORKD_RUN"], "controller.sock")
    with log.open("ab") as out:
        proc = subprocess.Popen(["forkd", "serve"], env=dict(env), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=out)

    def up() -> bool:
        assert proc.poll() is None, f"forkd serve exited with {proc.returncode}; see {log}"
        if not sock.exists():
            return False
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                              base_url="http://forkd") as probe:
                return probe.get("/healthz").status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(f"forkd serve on {sock}", up, timeout)
    return proc


MCP_HELLO = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
    "protocolVersion": "2025-06-18", "capabilities": {},
    "clientInfo": {"name": "t", "version": "1"}}}


def mcp_auth(token: bytes) -> dict[str, str]:
    """The headers of an MCP streamable-HTTP request with bearer ``token``."""
    return {"Authorization": "Bearer " + token.decode(),
            "Accept": "application/json, text/event-stream"}


def slow_app(delay: float, path: str | None = None) -> Callable[..., Awaitable[None]]:
    """An ASGI app that answers 200 "done" to every request, ``delay`` seconds late (only
    to requests for ``path``, when given), never reading the body."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if path is None or scope["path"] == path:
            await asyncio.sleep(delay)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"done"})

    return app


class McpClient:
    """One MCP client over streamable HTTP (its own source address) with a session open."""

    def __init__(self, url: str, token: bytes, source: str = "127.0.0.1") -> None:
        self.http = httpx.Client(base_url=url, timeout=30,
                                 transport=httpx.HTTPTransport(local_address=source))
        auth = mcp_auth(token)
        r = self.http.post("/mcp", json=MCP_HELLO, headers=auth)
        assert r.status_code == 200, r.text
        self.session = {**auth, "mcp-session-id": r.headers["mcp-session-id"],
                        "mcp-protocol-version": "2025-06-18"}
        self.http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                       headers=self.session)

    def tool_text(self, tool: str, **arguments: Any) -> str:
        """The SSE text of a tools/call of ``tool``."""
        body = {"jsonrpc": "2.0", "id": 2, "method": "tools/call",
                "params": {"name": tool, "arguments": arguments}}
        return self.http.post("/mcp", json=body, headers=self.session).text


@contextlib.contextmanager
def as_client(address: str, session: str | None = None) -> Iterator[None]:
    """In-process calls made as the client at ``address`` in MCP session ``session``."""
    from forkd.controller import mcp
    from forkd.engine.agent_client import REQUEST_CLIENT

    client = REQUEST_CLIENT.set(address)
    mcp_session = mcp.MCP_SESSION.set(session)
    try:
        yield
    finally:
        mcp.MCP_SESSION.reset(mcp_session)
        REQUEST_CLIENT.reset(client)


class Asked(ForkdError):
    """A stand-in spawn was asked to fork (the tag got past the tool's checks)."""


def store_with_base(tmp_path: Path, seed: int) -> Store:
    """The store of the test's FORKD_HOME (its ``place`` fixture set), holding
    ``base:latest``: a 1 MiB random memory image."""
    store = Store.open()
    image = tmp_path / "base.img"
    write_base(image, 1 << 20, seed=seed, random_share=1.0)
    store.import_layer("base:latest", memory=image)
    return store


def branch_as_tag(store: Store, tag: str, force: bool = False) -> Any:
    """A stand-in for the engine's branch of a sandbox: ``tag`` names ``base:latest`` anew
    (the sandbox's state, as far as the store sees), and the BranchResult says so."""
    from forkd.engine.branch import BranchResult

    store.tag(tag, "base:latest", force=force)
    return BranchResult(ref=tag, digest=store.resolve(tag), parent="base:latest",
                        mode="live", pause_ms=0, pause_pages=0, copy_ms=0, rounds=1,
                        forced=False, scan_ms=0, read_ms=0, devstate_ms=0, diff_pages=0,
                        diff_bytes=0, stored_bytes=0, store_ms=0, depth=1, compacted=False)


def listed_refs(tools: Any) -> list[str]:
    """The snapshot refs an MCP ``Tools``' list_snapshots shows its calling client."""
    return [s["ref"] for s in tools.list_snapshots()["snapshots"]]


def mcp_sessions(http: httpx.Client, n: int, token: bytes) -> list[str]:
    """``n`` new MCP sessions opened through ``http`` (each an initialize): their ids."""
    ids = []
    for _ in range(n):
        r = http.post("/mcp", json=MCP_HELLO, headers=mcp_auth(token))
        assert r.status_code == 200, r.text
        ids.append(r.headers["mcp-session-id"])
    return ids


class FakeGuest:
    """A sandbox's agent that takes every request and never answers (a command that runs
    for ever), or answers each with ``answer``; it notes when the host closes a connection
    (``closed``; ``open`` counts those still open), which is what makes the relay cancel
    the request in a real guest (docs/agent-protocol.md, "The relay")."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.closed = threading.Event()
        self.answer: dict[str, Any] | None = None  # a result to answer with, if any
        self.open = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def agent(self, child_id: str, timeout: float) -> Iterator[Any]:
        """What children._agent gives: a client of this guest, on a connection of its own."""
        from forkd.engine.agent_client import AgentClient

        host, guest = socket.socketpair()
        with self._lock:
            self.open += 1
        threading.Thread(target=self._serve, args=(guest,), daemon=True).start()
        client = AgentClient(Path("/fake"), sock=host)
        try:
            yield client
        finally:
            client.close()

    def _serve(self, conn: socket.socket) -> None:
        got = b""
        while chunk := conn.recv(65536):
            got += chunk
            while b"\n" in got:
                line, got = got.split(b"\n", 1)
                self.requests.append(json.loads(line))
                if self.answer is not None:
                    reply = {"id": self.requests[-1]["id"], "ok": True, "result": self.answer}
                    conn.sendall(json.dumps(reply).encode() + b"\n")
        with self._lock:
            self.open -= 1
        self.closed.set()
        conn.close()


class FakeEngine:
    """Sandboxes that fork at once and run until ``end`` (the engine's fork and list, so
    the daemon's admission is what runs for real; no VM)."""

    def __init__(self) -> None:
        self.children: list[ChildInfo] = []
        self.forks = 0

    def fork(self, store: Store, ref: str, n: int, **_: Any) -> ch.ForkResult:
        made = []
        for _i in range(n):
            self.forks += 1
            made.append(ChildInfo(id=f"sb-{self.forks}", ref=ref, digest="sha256:" + "0" * 64,
                                  pid=os.getpid(), dir="/nonexistent", memory="", disk_backing="",
                                  memory_mib=64, created=time.time()))
        self.children.extend(made)
        return ch.ForkResult(children=made, assemble_ms=0.0, total_ms=0.0, errors=[])

    def list_children(self) -> list[ChildInfo]:
        return list(self.children)

    def end(self, sandbox_id: str) -> None:
        self.children = [c for c in self.children if c.id != sandbox_id]


class SlowEngine(FakeEngine):
    """Sandboxes whose fork ends only once the spawn's client has gone (the request's Stop
    set: app.CallerWatch), so the spawn ends after it; the engine's fork, list and kill (the
    daemon's handlers and admission run for real; no VM)."""

    def __init__(self) -> None:
        super().__init__()
        self.forking = threading.Event()
        self.forked = threading.Event()
        self.killed: list[str] = []

    def fork(self, store: Store, ref: str, n: int, **options: Any) -> ch.ForkResult:
        self.forking.set()
        stop = CALLER_STOP.get()
        assert stop is not None
        wait_until("the spawn's client to be gone", stop, 30)
        result = super().fork(store, ref, n, **options)
        self.forked.set()
        return result

    def kill(self, child_id: str, store: Store | None = None) -> ChildInfo:
        gone = next(c for c in self.children if c.id == child_id)
        self.end(child_id)
        self.killed.append(child_id)
        return gone
