"""The append-only JSON audit log shared by the hub and the controller daemon."""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from forkd.names import shortened


class Account(Protocol):
    """An actor that is an account: its name, and its id (never reused), or None when
    anonymous."""

    @property
    def name(self) -> str: ...

    @property
    def user_id(self) -> int | None: ...


Actor = str | Account


class AuditLog:
    """One JSON object per line, appended (O_APPEND) and flushed per record.

    Fields: ``time`` (UTC ISO 8601), ``actor`` (user name or ``-`` for anonymous),
    ``actor_id`` (when the actor is an account: its id, which no later account gets, so a
    removed user and a new one given the same name are told apart), ``ip``, ``action``,
    ``target``, ``result`` (``ok`` / ``denied`` / ``failed``) and any extra detail.

    The file is opened for each record, not held: a log rotator that renames it (logrotate
    without ``copytruncate``) has the next record start a new file at ``path``, with no
    signal to send, and an AuditLog that is never closed holds no descriptor.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        os.close(self._open())  # a path that cannot be written fails here, at start
        self._lock = threading.Lock()

    def _open(self) -> int:
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                       0o600)

    def record(
        self, actor: Actor, ip: str, action: str, target: str, result: str, **detail: Any
    ) -> None:
        name, account = (actor, None) if isinstance(actor, str) else (actor.name, actor.user_id)
        entry: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "actor": name or "-",
            **({"actor_id": account} if account is not None else {}),
            "ip": ip,
            "action": action,
            "target": target,
            "result": result,
            **detail,
        }
        line = (json.dumps(entry, separators=(",", ":"), sort_keys=False) + "\n").encode()
        with self._lock:
            fd = self._open()
            try:
                os.write(fd, line)  # one write per line: O_APPEND keeps lines whole
            finally:
                os.close(fd)

    def close(self) -> None:
        """Nothing to release (each record opens and closes the file); kept so owners
        can end an AuditLog as they end their other resources."""


MAX_TARGET = 300  # characters of a caller-given target kept in a record


SUPPRESSED_CLIENTS = 16  # clients a ``suppressed`` record names with their counts, at most


class BoundedAudit:
    """Records of one kind that a caller can provoke at will (refused requests), at most
    ``per_minute`` a minute, each target shortened to MAX_TARGET: past the budget, records
    are counted, and the first record of the next minute is preceded by one ``suppressed``
    record with the count. A flood of refused requests cannot fill the disk, and the log
    still says it happened. With ``share``, one client (``record``'s ``client``) gets at
    most that many of a minute's records: one client's flood no longer spends the whole
    budget, so another's requests are still recorded with their address (the suppressed
    record then names the clients whose records were dropped, with their counts)."""

    def __init__(self, audit: AuditLog, per_minute: int, suppressed: str, actor: str = "-",
                 share: int | None = None, **constant: Any) -> None:
        self.audit, self.per_minute, self.suppressed = audit, per_minute, suppressed
        self.actor, self.share, self.constant = actor, share, constant
        self._lock = threading.Lock()
        self._window = (float("-inf"), 0, 0)  # (minute start, records written, dropped)
        self._written_by: dict[str, int] = {}  # this minute's records per client (<= budget)
        self._dropped_by: dict[str, int] = {}  # and dropped, SUPPRESSED_CLIENTS at most

    def record(self, actor: Actor, ip: str, action: str, target: str, result: str,
               client: str | None = None, **detail: Any) -> bool:
        """Write the record unless the minute's budget, or ``client``'s share of it, is
        spent; True if written."""
        now = time.monotonic()
        with self._lock:
            start, written, dropped = self._window
            if now - start >= 60:
                if dropped:
                    named = ({"clients": dict(self._dropped_by)} if self._dropped_by else {})
                    self.audit.record(self.actor, "-", self.suppressed, "-", "denied",
                                      count=dropped, **named, **self.constant)
                start, written, dropped = now, 0, 0
                self._written_by, self._dropped_by = {}, {}
            mine = self._written_by.get(client, 0) if client is not None else 0
            if written >= self.per_minute or (
                    self.share is not None and client is not None and mine >= self.share):
                self._window = (start, written, dropped + 1)
                if client is not None and (client in self._dropped_by
                                           or len(self._dropped_by) < SUPPRESSED_CLIENTS):
                    self._dropped_by[client] = self._dropped_by.get(client, 0) + 1
                return False
            self._window = (start, written + 1, dropped)
            if client is not None:
                self._written_by[client] = mine + 1
        self.audit.record(actor, ip, action, shortened(target, MAX_TARGET), result,
                          **self.constant, **detail)
        return True
