"""The append-only JSON audit log shared by the hub and the controller daemon."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


class AuditLog:
    """One JSON object per line, appended (O_APPEND) and flushed per record.

    Fields: ``time`` (UTC ISO 8601), ``actor`` (user name or ``-`` for anonymous),
    ``ip``, ``action``, ``target``, ``result`` (``ok`` / ``denied`` / ``failed``) and
    any extra detail.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._lock = threading.Lock()

    def record(
        self, actor: str, ip: str, action: str, target: str, result: str, **detail: Any
    ) -> None:
        entry = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "actor": actor or "-",
            "ip": ip,
            "action": action,
            "target": target,
            "result": result,
            **detail,
        }
        line = (json.dumps(entry, separators=(",", ":"), sort_keys=False) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)  # one write per line: O_APPEND keeps lines whole

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
