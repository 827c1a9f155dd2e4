"""The process-wide budget for guest agent replies (engine/agent_client.py ``REPLY_BUDGET``).

Before: each request's reply line could reach MAX_LINE (64 MiB), and a controller may have
MAX_REQUESTS (32) in flight: a hostile guest answering all of them at once with the
largest lines made the host process hold 2 GiB of receive buffers, more once parsed. Now
what the replies being read hold past ``REPLY_FREE`` each is counted against one budget;
the reply that would pass it fails, naming the budget, and only that request.

The guest here is a stand-in on a socket pair (what a hostile guest would send: a real
agent never sends a reply that large); the client is the real AgentClient.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from forkd.engine import agent_client as ac
from forkd.engine.errors import AgentError

MIB = 1 << 20


class HostileGuest:
    """Answers each request on its socket with a reply whose ``result.out`` is ``size``
    bytes; with ``hold``, sends all of it but the end and waits for ``hold`` first."""

    def __init__(self, size: int, hold: threading.Event | None = None) -> None:
        self.host, self.guest = socket.socketpair()
        self.size, self.hold = size, hold
        self.sent_most = threading.Event()
        self.dropped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self._answer()
        except OSError:  # the host closed the connection while the reply went out
            self.dropped.set()

    def _answer(self) -> None:
        f = self.guest.makefile("rb")
        while line := f.readline():
            request = json.loads(line)
            reply = json.dumps({"id": request["id"], "ok": True,
                                "result": {"out": "x" * self.size}}).encode() + b"\n"
            if self.hold is not None:
                self.guest.sendall(reply[:-64])
                self.sent_most.set()
                self.hold.wait(30)
                self.guest.sendall(reply[-64:])
            else:
                self.guest.sendall(reply)

    def client(self) -> ac.AgentClient:
        return ac.AgentClient(Path("stand-in"), sock=self.host)

    def close(self) -> None:
        for s in (self.host, self.guest):
            s.close()


@pytest.fixture
def budget(monkeypatch: pytest.MonkeyPatch) -> Iterator[ac.ReplyBudget]:
    """A budget of 4 MiB past 1 MiB per reply (the real one: 256 MiB past 8 MiB)."""
    small = ac.ReplyBudget(4 * MIB)
    monkeypatch.setattr(ac, "BUDGET", small)
    monkeypatch.setattr(ac, "REPLY_FREE", 1 * MIB)
    yield small
    assert small.held == 0  # every request gave back what it took


def test_a_reply_past_the_budget_fails_alone_and_the_budget_comes_back(
        budget: ac.ReplyBudget) -> None:
    release = threading.Event()
    slow = HostileGuest(3 * MIB, hold=release)  # holds 2 MiB of the budget while it waits
    big = HostileGuest(4 * MIB)  # would take 3 MiB more: past the 4
    try:
        results: dict[str, object] = {}

        def first() -> None:
            results["slow"] = slow.client().request("get", {"path": "/x"})

        t = threading.Thread(target=first)
        t.start()
        assert slow.sent_most.wait(30)
        deadline = time.monotonic() + 30
        while budget.held < 2 * MIB - 64 and time.monotonic() < deadline:  # read it all
            time.sleep(0.01)
        assert budget.held >= 2 * MIB - 64, budget.held
        with pytest.raises(AgentError, match=r"held 2\.0 MiB past theirs \(at most 4 MiB"):
            big.client().request("get", {"path": "/y"})
        assert big.dropped.wait(30)  # not read on: the connection was closed
        release.set()
        t.join(30)
        out = results["slow"]
        assert isinstance(out, dict) and len(out["out"]) == 3 * MIB  # untouched by the other
        assert budget.held == 0
        again = HostileGuest(4 * MIB)
        try:  # the same reply, once nothing else holds the budget
            assert len(again.client().request("get", {"path": "/y"})["out"]) == 4 * MIB
        finally:
            again.close()
    finally:
        release.set()
        slow.close()
        big.close()


def test_a_reply_under_the_free_bytes_never_waits_on_the_budget(
        budget: ac.ReplyBudget) -> None:
    budget.held = budget.limit  # all of it taken elsewhere
    guest = HostileGuest(MIB // 2)
    try:
        assert len(guest.client().request("get", {"path": "/x"})["out"]) == MIB // 2
    finally:
        guest.close()
        budget.held = 0
