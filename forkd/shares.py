"""A budget of bytes (or any unit) held at once, bounded in all and for each client: the
daemon's request bodies (controller.app.BodyBudget, MCP's too) and guest replies
(engine.agent_client.ReplyBudget). One client holds at most half, so one that sends or
reads slowly can take at most half of what every client shares."""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class Refusal:
    """Why ``take`` refused: the client's share (``bound`` "client"), or the total
    ("total"); ``held``: what that bound held already (the client's, or everyone's)."""

    bound: str
    held: int


class Shares:
    """At most ``total`` held in all, ``total // parts`` of it by one client (None: a
    caller in process, counted in the total only). Two parts (half) where clients are
    few (the daemon's); more where anyone may connect (the hub's), so that a couple of
    clients cannot hold all of it."""

    def __init__(self, total: int, parts: int = 2) -> None:
        self.total = total
        self.parts = parts
        self.held = 0
        self.by_client: dict[str, int] = {}  # what each client holds (entries > 0)
        self._lock = threading.Lock()

    @property
    def share(self) -> int:
        return self.total // self.parts

    def take_or_refuse(self, n: int, client: str | None) -> Refusal | None:
        """Count ``n`` more for ``client``, or the Refusal (nothing counted)."""
        with self._lock:
            theirs = self.by_client.get(client, 0) if client is not None else 0
            if client is not None and theirs + n > self.share:
                return Refusal("client", theirs)
            if self.held + n > self.total:
                return Refusal("total", self.held)
            self.held += n
            if client is not None:
                self.by_client[client] = theirs + n
            return None

    def give(self, n: int, client: str | None = None) -> None:
        """Give back ``n`` that ``client`` took."""
        with self._lock:
            self.held -= n
            if client is not None and n:
                left = self.by_client.get(client, 0) - n
                if left > 0:
                    self.by_client[client] = left
                else:
                    self.by_client.pop(client, None)
