"""The audit log (forkd/audit.py): its bounded records (BoundedAudit: what a caller can
provoke at will is written at most N times a minute, the rest counted in one record), and
the file opened per record (a rotator's rename starts a new file; no descriptor held)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from forkd import audit as audit_module
from forkd.audit import MAX_TARGET, AuditLog, BoundedAudit
from forkd.names import cut_note, shortened


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_past_the_budget_records_are_counted_then_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    now = [1000.0]
    monkeypatch.setattr(audit_module.time, "monotonic", lambda: now[0])
    log = AuditLog(tmp_path / "audit.log")
    bounded = BoundedAudit(log, 3, "auth.suppressed", where="tcp")
    written = [bounded.record("-", "1.2.3.4:5", "auth", "/x" * 400, "denied") for _ in range(7)]
    assert written == [True] * 3 + [False] * 4
    now[0] += 61  # the next minute: the count first, then the record
    assert bounded.record("-", "1.2.3.4:5", "auth", "/y", "denied")
    log.close()
    entries = _lines(tmp_path / "audit.log")
    assert [e["action"] for e in entries] == ["auth"] * 3 + ["auth.suppressed", "auth"]
    assert entries[3]["count"] == 4 and entries[3]["where"] == "tcp"
    assert all(len(str(e["target"])) <= MAX_TARGET for e in entries)
    # a cut target says how much was left out, within the same bound
    target = str(entries[0]["target"])
    kept = target.index("…")
    assert target == ("/x" * 400)[:kept] + "… " + cut_note(kept, 800)
    assert all(e["where"] == "tcp" for e in entries)


def test_a_shortened_text_keeps_its_bound_and_says_what_was_cut() -> None:
    assert shortened("abc", 3) == "abc"
    for size in (301, 1000, 10**6):
        text = shortened("z" * size, 300)
        assert len(text) <= 300, size
        kept = text.index("…")
        assert text == "z" * kept + "… " + cut_note(kept, size)
        assert text.endswith(f"(its first {kept} of {size} characters)")


def _open_descriptors_of(path: Path) -> int:
    fds = Path("/proc/self/fd")
    count = 0
    for fd in fds.iterdir():
        try:
            count += os.readlink(fd) == str(path)
        except OSError:
            continue
    return count


def test_a_renamed_log_is_followed_by_a_new_file_and_nothing_is_held(tmp_path: Path) -> None:
    """Before: an AuditLog held its file open from its creation, so a log rotator's rename
    left the daemon writing into the rotated file (until a restart), and every AuditLog
    not closed kept a descriptor. Now each record opens the path: after a rename the next
    record starts a new file there, and no descriptor of the log stays open."""
    path = tmp_path / "audit.log"
    log = AuditLog(path)
    assert path.exists() and _open_descriptors_of(path) == 0
    log.record("alice", "1.2.3.4", "manifest.push", "ns/app:v1", "ok")
    path.rename(tmp_path / "audit.log.1")
    log.record("bob", "1.2.3.5", "manifest.delete", "ns/app:v1", "ok")
    assert [e["actor"] for e in _lines(tmp_path / "audit.log.1")] == ["alice"]
    assert [e["actor"] for e in _lines(path)] == ["bob"]
    assert _open_descriptors_of(path) == 0
    assert (path.stat().st_mode & 0o777) == 0o600


def test_an_unwritable_log_fails_at_start(tmp_path: Path) -> None:
    """The path is opened once when the log is made, so a daemon whose audit log cannot
    be written fails at start, not at its first write."""
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        AuditLog(tmp_path / "dir")
