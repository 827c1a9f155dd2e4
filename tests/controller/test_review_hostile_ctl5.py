"""The controller against the seventh hostile review: what one client holds of the daemon's
guest requests, what guest replies hold until their answers are sent, an MCP cell through
the daemon at a revoked token, and a snapshot removal racing a pause. No VM: the real app,
protocols and clients on uvicorn, and a fake guest agent (daemon_support.FakeGuest)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from daemon_support import FakeGuest, running
from net_support import PATIENCE_S, free_port, wait_until

from forkd.audit import AuditLog
from forkd.controller import app, server
from forkd.controller.backend import LocalBackend
from forkd.engine import agent_client as ac
from forkd.engine import children as ch
from forkd.store.store import Store

MIB = 1 << 20
TOKEN = b"t" * 43


def _daemon_app(tmp_path: Path, token: app.Token | bytes | None) -> Any:
    return app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                          app.ControllerMetrics(), token)


def _post(where: Path | tuple[str, int], path: str, body: dict[str, Any],
          source: str | None = None, token: bytes | None = None) -> socket.socket:
    """A connection that sent ``POST path`` with ``body`` (and reads nothing yet)."""
    family = socket.AF_UNIX if isinstance(where, Path) else socket.AF_INET
    conn = socket.socket(family, socket.SOCK_STREAM)
    conn.settimeout(20)
    if source is not None:
        conn.bind((source, 0))
    conn.connect(str(where) if isinstance(where, Path) else where)
    data = json.dumps(body).encode()
    auth = b"Authorization: Bearer %s\r\n" % token if token else b""
    conn.sendall(b"POST %s HTTP/1.1\r\nHost: forkd\r\nContent-Type: application/json\r\n%s"
                 b"Content-Length: %d\r\n\r\n" % (path.encode(), auth, len(data)) + data)
    return conn


def _head_and_body(conn: socket.socket) -> tuple[bytes, bytes]:
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(65536)
        assert chunk, got
        got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = conn.recv(1 << 20)
        assert chunk
        body += chunk
    return head, body


EXEC = ("/v1/sandboxes/sb-1/exec", {"argv": ["sleep", "1000"]})


# -- one client's share of the daemon's guest requests ------------------------------------
@pytest.fixture
def tcp(place: Path, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The daemon's TCP app (token TOKEN, watched) and protocol, with its default limits."""
    port = free_port()
    token = app.Token(TOKEN)
    watched = app.TokenWatch(_daemon_app(tmp_path, token), token)
    config = server.bounded_config(watched, server.BoundedProtocol, host="127.0.0.1", port=port)
    with running(uvicorn.Server(config)):
        yield ("127.0.0.1", port)


def test_one_client_holds_at_most_its_share_of_guest_requests(
        tcp: tuple[str, int], guest: FakeGuest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon runs at most MAX_REQUESTS guest requests at once, and one client could
    take all of them (32 commands that never end): every other client's exec, eval, file
    read was Busy until they ended. Now a client (an address on TCP, a uid on the Unix
    socket: who the listener counts connections by) holds at most MAX_REQUESTS_PER_CLIENT
    of them; past it a 429 says whose share it is and what to do, and others get theirs."""
    monkeypatch.setattr(ch, "MAX_REQUESTS", 4)
    monkeypatch.setattr(ch, "MAX_REQUESTS_PER_CLIENT", 2)
    monkeypatch.setattr(ch, "MAX_CHILD_REQUESTS_PER_CLIENT", 2)
    mine = [_post(tcp, *EXEC, token=TOKEN) for _ in range(2)]
    wait_until("both commands run", lambda: len(guest.requests) == 2, PATIENCE_S)
    refused = _post(tcp, *EXEC, token=TOKEN)
    head, body = _head_and_body(refused)
    assert head.startswith(b"HTTP/1.1 429"), head
    assert b"retry-after: 1" in head.lower()
    error = json.loads(body)["error"]
    assert error["type"] == "TooManyRequests", error
    assert "this client (127.0.0.1) has 2 requests to sandboxes in flight" in error["message"]
    assert "wait for one of yours to end" in error["message"]
    theirs = [_post(tcp, *EXEC, source="127.0.0.2", token=TOKEN) for _ in range(2)]
    wait_until("the other client's commands run", lambda: len(guest.requests) == 4, PATIENCE_S)
    for conn in mine + theirs:
        conn.close()
    wait_until("every guest request freed", lambda: not ch._in_flight and not ch._per_client,
               PATIENCE_S)
    assert guest.open == 0


def test_one_client_holds_at_most_half_of_one_sandboxs_requests(
        tcp: tuple[str, int], guest: FakeGuest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Within its share of the daemon, one client could still hold all 16 requests one
    sandbox may have (MAX_REQUESTS_PER_CHILD): every other client's exec in that sandbox
    was Busy. Now it holds at most half of them; another sandbox's are its own."""
    monkeypatch.setattr(ch, "MAX_REQUESTS_PER_CHILD", 4)
    monkeypatch.setattr(ch, "MAX_CHILD_REQUESTS_PER_CLIENT", 2)
    mine = [_post(tcp, *EXEC, token=TOKEN) for _ in range(2)]
    wait_until("both commands run", lambda: len(guest.requests) == 2, PATIENCE_S)
    head, body = _head_and_body(_post(tcp, *EXEC, token=TOKEN))
    assert head.startswith(b"HTTP/1.1 429"), head
    assert "has 2 requests to sb-1 in flight" in json.loads(body)["error"]["message"]
    elsewhere = _post(tcp, "/v1/sandboxes/sb-2/exec", EXEC[1], token=TOKEN)
    theirs = _post(tcp, *EXEC, source="127.0.0.2", token=TOKEN)
    wait_until("the other commands run", lambda: len(guest.requests) == 4, PATIENCE_S)
    for conn in [*mine, elsewhere, theirs]:
        conn.close()
    wait_until("every guest request freed", lambda: not ch._in_flight and not ch._per_client
               and not ch._per_client_child, 5)


def test_a_streamed_request_counts_for_its_client_too(
        place: Path, tmp_path: Path, guest: FakeGuest, monkeypatch: pytest.MonkeyPatch) -> None:
    """A streamed exec's guest request runs in a thread of its own: it counts against its
    client's share as the same request unstreamed does (its context goes with it)."""
    monkeypatch.setattr(ch, "MAX_CHILD_REQUESTS_PER_CLIENT", 1)
    sock = place / "ctl.sock"
    config = server.bounded_config(_daemon_app(tmp_path, None), server.UnixPeerProtocol,
                                   uds=str(sock))
    with running(uvicorn.Server(config)):
        streamed = _post(sock, "/v1/sandboxes/sb-1/exec/stream", EXEC[1])
        wait_until("the streamed command runs", lambda: len(guest.requests) == 1, PATIENCE_S)
        head, _ = _head_and_body(_post(sock, *EXEC))
        assert head.startswith(b"HTTP/1.1 429"), head
        streamed.close()
        wait_until("the guest request freed", lambda: not ch._per_client, PATIENCE_S)


def test_in_process_callers_have_no_share_to_keep() -> None:
    """The SDK without a daemon is one caller: only the process's bounds hold."""
    assert ch.REQUEST_CLIENT.get() is None
    with ch._admitted("a-1"), ch._admitted("a-2"):
        assert ch._per_client == {}


# -- what guest replies hold until their answers are sent ---------------------------------
@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[ac.ReplyBudget]:
    """A budget of 8 MiB past 1 MiB per reply, 4 per client (the real one: 256 MiB past 8
    MiB)."""
    small = ac.ReplyBudget(8 * MIB)
    monkeypatch.setattr(ac, "BUDGET", small)
    monkeypatch.setattr(ac, "REPLY_FREE", 1 * MIB)
    yield small
    assert small.held == 0  # every reply gave back what it took


def test_a_reply_stays_counted_until_its_answer_is_read(
        place: Path, tmp_path: Path, guest: FakeGuest, budget: ac.ReplyBudget) -> None:
    """A reply's budget was given back once it was parsed, before its answer was sent: 32
    parsed replies of 64 MiB each could wait in the daemon for clients that read them
    slowly (or never, until the stall timeout), past the budget meant to bound them. Now
    a reply stays counted until its answer is out."""
    guest.answer = {"stdout": "x" * (3 * MIB)}
    sock = place / "ctl.sock"
    limits = server.Limits(stall_timeout_s=30)
    config = server.bounded_config(_daemon_app(tmp_path, None), server.UnixPeerProtocol,
                                   limits, uds=str(sock))
    with running(uvicorn.Server(config)):
        slow = _post(sock, "/v1/sandboxes/sb-1/eval", {"code": "1", "timeout": 10})
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        wait_until("the guest answered", lambda: budget.held >= 2 * MIB - 64, PATIENCE_S)
        time.sleep(1.0)  # the daemon is writing the answer, which nobody reads
        assert budget.held >= 2 * MIB - 64, budget.held
        head, body = _head_and_body(slow)
        assert head.startswith(b"HTTP/1.1 200") and len(json.loads(body)["stdout"]) == 3 * MIB
        wait_until("the budget given back", lambda: budget.held == 0, PATIENCE_S)
        slow.close()


def test_a_reply_parsed_after_its_request_ended_is_given_back() -> None:
    """A stream's producer may parse its last reply after the server request ended: kept
    then, it would hold its budget for ever."""
    budget = ac.ReplyBudget(10 * MIB)
    kept = ac.KeptReplies()
    early, late = ac._ReplyHold(budget, "a"), ac._ReplyHold(budget, "b")
    early.grow(ac.REPLY_FREE + MIB)
    assert kept.keep(early) and budget.held == MIB
    kept.release()
    assert budget.held == 0
    late.grow(ac.REPLY_FREE + MIB)
    assert not kept.keep(late)  # the caller gives it back itself
    late.release()
    assert budget.held == 0


def test_one_client_holds_at_most_half_of_the_reply_budget() -> None:
    """Replies stay counted until their answers are read: one client reading its answers
    slowly could keep the whole budget, every other client's large reply refused. Now one
    client's replies hold at most half of it, the refusal saying whose they are."""
    budget = ac.ReplyBudget(4 * MIB)
    reset = ac.REQUEST_CLIENT.set("127.0.0.1")
    try:
        slow = ac._ReplyHold(budget, "guest agent (eval)")
        slow.grow(ac.REPLY_FREE + 2 * MIB)
        more = ac._ReplyHold(budget, "guest agent (eval)")
        with pytest.raises(ac.AgentError, match=r"this client's \(127\.0\.0\.1\) other "
                           r"replies held 2\.0 MiB .*at most 2 MiB, half"):
            more.grow(ac.REPLY_FREE + MIB)
    finally:
        ac.REQUEST_CLIENT.reset(reset)
    reset = ac.REQUEST_CLIENT.set("127.0.0.2")
    try:
        other = ac._ReplyHold(budget, "guest agent (eval)")
        other.grow(ac.REPLY_FREE + 2 * MIB)  # another client's reply still fits
    finally:
        ac.REQUEST_CLIENT.reset(reset)
    assert budget.held == 4 * MIB
    for hold in (slow, more, other):
        hold.release()
    assert budget.held == 0 and not budget.by_client


# -- an MCP cell through the daemon at a revoked token ------------------------------------
def test_a_revoked_token_stops_an_mcp_cell_run_through_the_daemon(
        place: Path, tmp_path: Path, guest: FakeGuest) -> None:
    """`forkd mcp --transport http` in front of a daemon: at a revocation the tool gave up
    on a run_code's result, but its request to the daemon went on (this process, the
    daemon's client, was still there), so the cell ran in the sandbox to its own timeout.
    Now the request's connection is shut down: the daemon sees its client go and stops
    the cell in the guest."""
    from daemon_support import MCP_HELLO, mcp_auth
    from test_daemon_security import _private_token_file, _replace_private_file

    from forkd.controller.mcp import SandboxScope, http_server
    from forkd.controller.sdk import Controller

    sock = place / "ctl.sock"
    daemon = server.bounded_config(_daemon_app(tmp_path, None), server.UnixPeerProtocol,
                                   uds=str(sock))
    old, new = "o" * 43, "n" * 43
    token = server.load_token(_private_token_file(place / "token", old))
    port = free_port()
    with running(uvicorn.Server(daemon)):
        web = http_server(Controller(socket=sock, local=False), "127.0.0.1", port, "/mcp",
                          token, scope=SandboxScope(["sb-1"]))
        call = {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
            "name": "run_code", "arguments": {"sandbox_id": "sb-1", "code": "import time",
                                              "timeout_s": 1000}}}
        with running(web), httpx.Client(base_url=f"http://127.0.0.1:{port}",
                                        timeout=30) as http:
            auth = mcp_auth(old.encode())
            r = http.post("/mcp", json=MCP_HELLO, headers=auth)
            session = {**auth, "mcp-session-id": r.headers["mcp-session-id"],
                       "mcp-protocol-version": "2025-06-18"}
            http.post("/mcp", json={"jsonrpc": "2.0", "method": "notifications/initialized"},
                      headers=session)

            def run() -> None:
                with contextlib.suppress(httpx.HTTPError):  # cut at the revocation
                    http.post("/mcp", json=call, headers=session)

            threading.Thread(target=run, daemon=True).start()
            wait_until("the guest has the cell", lambda: len(guest.requests) == 1, PATIENCE_S)
            assert guest.requests[0]["op"] == "run_code"
            _replace_private_file(place / "token", new)
            assert guest.closed.wait(PATIENCE_S), "the cell outlived the revoked token"
            wait_until("the guest request freed", lambda: not ch._in_flight, PATIENCE_S)


# -- a snapshot removal racing a pause ----------------------------------------------------
def test_a_cascade_never_removes_a_saved_state_set_while_it_runs(
        store: Store, images: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """DELETE /v1/snapshots/T?cascade=true checked that no tag built on T was a sandbox's
    saved state, then removed them: a sandbox that paused onto T between the two had its
    saved state removed by the cascade, its resume then had nothing to start from. Now the
    check runs under the tags' lock with the removal, which a pause's save takes too: the
    pause's tag is either seen (409) or set after the removal (kept)."""
    from forkd.errors import Conflict
    from forkd.store import tagging

    store.import_layer("base", memory=images[0])
    store.import_layer("d1", memory=images[1], parent="base")
    saved = "forkd-paused/sb-1:a"  # what pause names a sandbox's saved state
    monkeypatch.setattr(ch, "child_exists", lambda child_id: child_id == "sb-1")
    pause = threading.Thread(target=store.tag, args=(saved, "d1"))
    real = tagging.dependents

    def dependents(*args: Any, **kwargs: Any) -> list[str]:
        if not pause.is_alive() and pause.ident is None:  # the first look: a pause now
            pause.start()
            pause.join(1.0)  # done unless the look holds the lock that pause's save takes
        return real(*args, **kwargs)

    monkeypatch.setattr(tagging, "dependents", dependents)
    backend = LocalBackend(store)
    try:
        removed = backend.delete_snapshot("base", cascade=True).removed
    except Conflict as exc:  # it saw the saved state: nothing removed
        assert "saved state of sandbox sb-1" in str(exc)
        removed = []
    pause.join(10)
    assert saved not in removed
    assert saved in store.tags.read(), "the cascade removed a paused sandbox's saved state"


def test_a_tag_removed_meanwhile_is_not_found(store: Store, images: list[Path]) -> None:
    store.import_layer("base", memory=images[0])
    from forkd.errors import NotFound
    from forkd.store import tagging

    real = store.tags.update

    def gone_first(change: Any) -> Any:
        real(lambda tags: tags.pop("base:latest"))
        return real(change)

    store.tags.update = gone_first  # type: ignore[method-assign]
    with pytest.raises(NotFound, match="removed meanwhile"):
        tagging.remove(store, "base")


# -- a cell whose client went away ----------------------------------------------------------
def _cell_in_thread(req: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    from forkd.engine.guest import agent

    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(agent.op_eval(req)), daemon=True)
    thread.start()
    return thread, out


def test_a_cancelled_cell_is_interrupted_in_the_guest() -> None:
    """When a client of eval or run_code went away (or its token was revoked), the relay
    sent ``cancel`` but the agent only knew how to cancel an exec: the cell ran on to its
    own timeout (for ever without one), holding the interpreter, so every later cell of
    the sandbox waited behind it. Now ``cancel`` interrupts it (KeyboardInterrupt)."""
    from forkd.engine.guest import agent

    thread, out = _cell_in_thread({"id": "cell-1", "code": "while True:\n    pass"})
    wait_until("the cell runs", lambda: "cell-1" in agent.CELLS
               and agent.CELLS["cell-1"].deadline is not None, 5)
    assert agent.op_cancel({"target": "cell-1"}) == {"cancelled": True}
    thread.join(PATIENCE_S)
    assert not thread.is_alive(), "the cell outlived its cancel"
    assert out["error"]["cancelled"] is True and "client went away" in out["error"]["message"]
    assert "cell-1" not in agent.CELLS
    assert agent.op_eval({"id": "cell-2", "code": "1 + 1"})["value"] == 2  # the next runs


def test_a_cell_cancelled_before_its_turn_never_runs() -> None:
    from forkd.engine.guest import agent

    with agent.NS_LOCK:  # another cell runs
        thread, out = _cell_in_thread({"id": "cell-3", "code": "ran_after_cancel = True"})
        wait_until("the cell waits", lambda: "cell-3" in agent.CELLS, PATIENCE_S)
        assert agent.op_cancel({"target": "cell-3"}) == {"cancelled": True}
    thread.join(PATIENCE_S)
    assert out["error"]["cancelled"] is True
    assert "ran_after_cancel" not in agent.NS
    assert agent.op_cancel({"target": ["not", "an", "id"]}) == {"cancelled": False}


def test_forkd_rmi_never_removes_a_sandboxs_saved_state(
        store: Store, images: list[Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """`forkd rmi --cascade` removed a paused sandbox's saved state with the tag it was
    built on (the daemon refused that; the CLI did not check at all)."""
    from click.testing import CliRunner

    from forkd.cli.store_cmds import rmi

    store.import_layer("base", memory=images[0])
    store.import_layer("d1", memory=images[1], parent="base")
    saved = "forkd-paused/sb-1:a"
    store.tag(saved, "d1")
    monkeypatch.setattr(ch, "child_exists", lambda child_id: child_id == "sb-1")
    result = CliRunner().invoke(rmi, ["--cascade", "base"])
    assert "saved state of sandbox sb-1" in str(result.exception), result.output
    assert {"base:latest", "d1:latest", saved} <= set(store.tags.read())
