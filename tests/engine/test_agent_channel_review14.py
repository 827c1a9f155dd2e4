"""The guest agent channel against the fourteenth hostile review: what one client leaving
in the middle of a guest's frame does to the child's relay and its other clients, what a
line without end costs the relay, and what a reply costs the host once parsed. No VM: the
real relay (agent_client.Relay) serves a unix socket that stands in for QEMU's agent
chardev, or the real client reads a socket pair, written to by the test as a guest
would."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from forkd.engine import agent_client as ac
from forkd.engine.agent_client import CLIENT_BUFFER, LONG_LINE, Relay, connect_child
from forkd.engine.errors import AgentError

MIB = 1 << 20


@dataclass
class Guest:
    """The guest's end of the agent channel (what QEMU's chardev would give the relay),
    and the relay serving it on a thread of this process."""

    conn: socket.socket
    relay: Relay
    died: list[BaseException]
    path: Path
    pending: bytes = b""

    def request(self) -> dict[str, object]:
        """The next request the relay passed to the guest (the relay's own cancels, of a
        client that left, are left out)."""
        self.conn.settimeout(10)
        while True:
            while b"\n" not in self.pending:
                data = self.conn.recv(1 << 16)
                assert data, "the relay closed the agent channel"
                self.pending += data
            line, self.pending = self.pending.split(b"\n", 1)
            request: dict[str, object] = json.loads(line)
            if request.get("op") != "cancel":
                return request

    def send(self, data: bytes) -> None:
        self.conn.settimeout(10)
        self.conn.sendall(data)


@pytest.fixture
def guest(tmp_path: Path) -> Iterator[Guest]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)
    made: list[Relay] = []
    died: list[BaseException] = []
    ready = threading.Event()

    def run() -> None:
        try:
            relay = Relay(tmp_path)
            made.append(relay)
            ready.set()
            relay.run()
        except BaseException as exc:  # what the guest sent killed the relay
            died.append(exc)
        finally:
            ready.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    listener.settimeout(10)
    conn, _ = listener.accept()
    assert ready.wait(10) and made, f"the relay did not start: {died}"
    try:
        yield Guest(conn, made[0], died, tmp_path)
    finally:
        conn.close()  # as QEMU's end going away: the relay ends
        listener.close()
        thread.join(10)
        assert not thread.is_alive(), "the relay outlived its agent socket"


def _until(what: str, check: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_client_leaving_in_the_middle_of_its_event_leaves_the_relay_serving_the_others(
    guest: Guest,
) -> None:
    """A client that goes away while the guest is sending it an event's payload (a
    streamed command whose reader left or timed out in the middle of 1 MiB of output):
    the rest of that payload was queued for the closed socket, the relay died of it
    (ValueError: Invalid file descriptor: -1), and every other client of the child lost
    its connection and its request, a command left running in the guest with nobody to
    cancel it. A guest can do it at will (announce 2 MiB, send part, wait for the
    reader's deadline). Now the rest is skipped and the others are served."""
    leaving = connect_child(guest.path)
    staying = connect_child(guest.path)
    failed: list[BaseException] = []

    def leave() -> None:
        try:
            leaving.request("exec", {"argv": ["yes"], "stream": True}, timeout=1.0,
                            on_event=lambda ev, data: None)
        except AgentError as exc:
            failed.append(exc)

    thread = threading.Thread(target=leave)
    thread.start()
    rid = guest.request()["id"]
    guest.send(json.dumps({"id": rid, "ev": "stdout", "size": 2 * MIB}).encode() + b"\n"
               + b"y" * 1000)
    thread.join(20)
    assert failed, "the leaving client's request did not end at its deadline"
    _until("the relay did not notice the client leaving",
           lambda: len(guest.relay.clients) == 1)

    answer: list[dict[str, object]] = []
    waiter = threading.Thread(target=lambda: answer.append(staying.request("ping")))
    waiter.start()
    other = guest.request()["id"]
    guest.send(b"y" * (2 * MIB - 1000))  # the rest of the payload nobody reads now
    guest.send(json.dumps({"id": other, "ok": True, "result": {"pong": True}}).encode()
               + b"\n")
    waiter.join(20)
    assert not guest.died, f"the relay died: {guest.died[0]!r}"
    assert answer == [{"pong": True}]
    staying.close()
    leaving.close()


def _held(relay: Relay) -> int:
    """Bytes of the guest's the relay holds: its input buffer and its clients' queues."""
    return len(relay.agent_in) + sum(len(c.outbuf) for c in list(relay.clients.values()))


def test_a_line_without_end_costs_the_relay_little(guest: Guest) -> None:
    """A guest that writes a line and never ends it: the relay held all of it, up to 128
    MiB (then dropped it and went on), per child and outside the child's memory limit; a
    reply of 64 MiB it held three times. Now a line past agent_client.LONG_LINE is passed
    on as it arrives (here to nobody: its head names no request), and the relay holds
    what one read brings; the lines after it are served."""
    client = connect_child(guest.path)
    most = 0
    piece = b"x" * MIB
    guest.send(b'{"id": "nobody", "ok": true, "result": {"v": "')
    for _ in range(96):
        guest.send(piece)
        most = max(most, _held(guest.relay))
    _until("the relay did not read what the guest sent",
           lambda: _held(guest.relay) <= LONG_LINE + MIB)
    assert most <= 2 * MIB + LONG_LINE, f"the relay held {most / MIB:.0f} MiB"  # 95 before
    answer: list[dict[str, object]] = []
    waiter = threading.Thread(target=lambda: answer.append(client.request("ping")))
    waiter.start()
    rid = guest.request()["id"]
    guest.send(b'"}}\n' + json.dumps({"id": rid, "ok": True, "result": {"pong": 1}}).encode()
               + b"\n")
    waiter.join(20)
    assert answer == [{"pong": 1}]
    client.close()


def test_a_long_reply_reaches_its_client_whole(guest: Guest) -> None:
    """What the relay passes on as it arrives is the line whole, to the client whose
    request it answers (its route ends with it), and the relay's own share stays small
    while the client reads it."""
    client = connect_child(guest.path)
    answer: list[dict[str, object]] = []
    waiter = threading.Thread(
        target=lambda: answer.append(client.request("eval", {"code": "v"}, timeout=60)))
    waiter.start()
    rid = guest.request()["id"]
    value = "".join(chr(ord("a") + i % 26) for i in range(24 * MIB))
    reply = json.dumps({"id": rid, "ok": True, "result": {"value": value}}).encode() + b"\n"
    most = 0
    for at in range(0, len(reply), MIB):
        guest.send(reply[at:at + MIB])
        most = max(most, _held(guest.relay))
    waiter.join(60)
    assert answer and answer[0]["value"] == value
    assert not guest.relay.routes
    assert most <= CLIENT_BUFFER + 2 * MIB + LONG_LINE, f"the relay held {most / MIB:.0f} MiB"
    client.close()


class Answering:
    """A guest on a socket pair that answers each request with ``result``'s text (the JSON
    of the reply's ``result``, given as bytes so that it may be any shape)."""

    def __init__(self, result: bytes) -> None:
        self.host, self.guest = socket.socketpair()
        self.result = result
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the host closed it while the reply went out
            f = self.guest.makefile("rb")
            while line := f.readline():
                rid = json.loads(line)["id"]
                self.guest.sendall(b'{"id": %s, "ok": true, "result": %s}\n'
                                   % (json.dumps(rid).encode(), self.result))

    def client(self) -> ac.AgentClient:
        return ac.AgentClient(Path("stand-in"), sock=self.host)

    def close(self) -> None:
        for s in (self.host, self.guest):
            s.close()


def _answered(result: bytes) -> tuple[dict[str, object] | AgentError, int]:
    """What a client makes of a reply carrying ``result``, and the most memory the reading
    and parsing took (tracemalloc)."""
    guest = Answering(result)
    tracemalloc.start()
    try:
        try:
            out: dict[str, object] | AgentError = guest.client().request(
                "eval", {"code": "v"}, timeout=60)
        except AgentError as exc:
            out = exc
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        guest.close()


def test_a_reply_is_counted_as_what_parsing_it_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply budget counted a reply's bytes past 8 MiB: a guest answering with just
    under 8 MiB of ``{},`` (counted as nothing) made 193 MiB of Python objects, and 60 MiB
    of short strings (under the 8 MiB of structure a frame may have, counted as 52 MiB)
    331 MiB, 889 at the parse's peak; 16 requests to one guest, 32 in the process, at
    once. Now a long line is counted, before it is parsed, as its bytes and what parsing
    makes of each of its values (agent_client.parsed_size):
    with 64 MiB of the budget left, the first is refused unparsed, a reply as long made
    of one string (the common shape: output, a file) is taken as before, and the first
    is taken when the budget has room for it."""
    budget = ac.ReplyBudget(ac.REPLY_BUDGET)
    monkeypatch.setattr(ac, "BUDGET", budget)
    values = b'{"v": [' + b"{}," * ((8 * MIB - 64) // 3 - 1) + b"{}]}"
    text = b'{"v": "' + b"x" * (8 * MIB - 64) + b'"}'
    budget.held = budget.limit - 64 * MIB  # the other replies of the process hold the rest
    refused, most = _answered(values)
    assert isinstance(refused, AgentError), "a reply of 2.8 million values was parsed"
    assert "as read and as parsed" in str(refused)
    assert most < 48 * MIB, f"reading it took {most / MIB:.0f} MiB"
    taken, _ = _answered(text)
    assert isinstance(taken, dict) and len(str(taken["v"])) == 8 * MIB - 64
    assert budget.held == budget.limit - 64 * MIB  # each gave back what it took
    budget.held = 0
    parsed, _ = _answered(values)
    assert isinstance(parsed, dict) and len(parsed["v"]) == (8 * MIB - 64) // 3  # type: ignore[arg-type]
    assert budget.held == 0
