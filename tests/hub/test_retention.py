"""Retention rules: keep the last N tags and/or tags pulled within D days; never a tag a
kept tag depends on through subject; deletions audited; blobs then go through GC."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from pathlib import Path

from hub_support import ADMIN, HubServer, artifact, sha

from forkd.hub.settings import RetentionRule
from forkd.store.blobs import FsBlobStore

OCI = "application/vnd.oci.image.manifest.v1+json"


def _subject(digest: str, body: bytes) -> dict[str, object]:
    return {"mediaType": OCI, "digest": digest, "size": len(body)}


def _tags(hub: HubServer, repo: str) -> list[str]:
    with hub.client(ADMIN) as c:
        return list(c.get(f"/v2/{repo}/tags/list").json()["tags"] or [])


def _audit(hub: HubServer, action: str) -> list[dict[str, object]]:
    lines = (hub.data_dir / "audit.log").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["action"] == action]


def _config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "hub.toml"
    path.write_text(text)
    return str(path)


def test_keep_last_never_deletes_a_parent_of_a_kept_tag(tmp_path: Path) -> None:
    hub = HubServer(tmp_path / "hub").start()
    try:
        repo = "acme/app"
        with hub.client(ADMIN) as c:
            base = artifact(c, repo, b"base" * 100, tag="base")
            mid = artifact(c, repo, b"mid" * 100, tag="mid", subject=_subject(*base))
            other = artifact(c, repo, b"other" * 100, tag="other")
            artifact(c, repo, b"child" * 100, tag="child", subject=_subject(*mid))
            artifact(c, "keepall/app", b"untouched", tag="v1")  # no rule matches
        config = _config(
            tmp_path,
            '[[retention]]\nrepositories = "acme/*"\nkeep_last = 1\n',
        )
        out = hub.cli("gc", "--retention", "--dry-run", "--config", config)
        assert "would delete 1 tags (acme/app:other)" in out
        assert _tags(hub, repo) == ["base", "child", "mid", "other"]

        out = hub.cli("gc", "--retention", "--config", config, "--grace-minutes", "0")
        assert "deleted 1 tags (acme/app:other)" in out
        assert "2 tags kept as parents" in out
        # child is the newest; mid and base are its ancestors through subject.
        assert _tags(hub, repo) == ["base", "child", "mid"]
        assert _tags(hub, "keepall/app") == ["v1"]
        deleted = _audit(hub, "tag.delete")
        assert [(e["actor"], e["target"]) for e in deleted] == [("(retention)", f"{repo}:other")]
        with hub.client(ADMIN) as c:
            assert c.get(f"/v2/{repo}/manifests/{other[0]}").status_code == 404
        # The untagged manifest went, and GC removed its layer.
        store = FsBlobStore(hub.data_dir / "blobs")
        assert not store.has(sha(b"other" * 100))
        assert store.has(sha(b"base" * 100))

        # A new head: the old chain is no longer kept by anyone and goes, child first.
        with hub.client(ADMIN) as c:
            artifact(c, repo, b"new" * 100, tag="new")
        out = hub.cli("gc", "--retention", "--config", config, "--grace-minutes", "0")
        assert _tags(hub, repo) == ["new"]
        with hub.client(ADMIN) as c:
            for digest, _ in (base, mid):
                assert c.get(f"/v2/{repo}/manifests/{digest}").status_code == 404
        assert not store.has(sha(b"base" * 100)) and not store.has(sha(b"mid" * 100))
        assert len(_audit(hub, "tag.delete")) == 4
    finally:
        hub.stop()


def test_pulled_within_days_background_sweep(tmp_path: Path) -> None:
    hub = HubServer(
        tmp_path / "hub",
        {
            "retention": (RetentionRule("team/*", pulled_within_days=7),),
            "retention_interval": 0.3,
        },
    ).start()
    try:
        repo = "team/svc"
        with hub.client(ADMIN) as c:
            base = artifact(c, repo, os.urandom(100), tag="base")
            artifact(c, repo, os.urandom(100), tag="used", subject=_subject(*base))
            artifact(c, repo, os.urandom(100), tag="stale")
            artifact(c, repo, os.urandom(100), tag="fresh")
            assert c.get(f"/v2/{repo}/manifests/used").status_code == 200
            # The catalog flushes the batched pull counts (and last_pulled_at).
            tags = {t["name"]: t for t in c.get(f"/api/v1/repositories/{repo}").json()["tags"]}
            assert tags["used"]["pulls"] == 1
        time.sleep(1)
        assert _tags(hub, repo) == ["base", "fresh", "stale", "used"]  # all pushed just now
        # Push times 30 days ago for all but "fresh"; only "used" was pulled since.
        with sqlite3.connect(hub.data_dir / "hub.db") as db:
            db.execute(
                "UPDATE tags SET updated_at = '2020-01-01 00:00:00.000000' WHERE name != 'fresh'"
            )
            row = db.execute("SELECT last_pulled_at FROM tags WHERE name = 'used'").fetchone()
            assert row[0] is not None
        deadline = time.monotonic() + 30
        while "stale" in _tags(hub, repo) and time.monotonic() < deadline:
            time.sleep(0.2)
        # "base" was not pulled and is old, but "used" (kept) depends on it.
        assert _tags(hub, repo) == ["base", "fresh", "used"]
        assert [e["target"] for e in _audit(hub, "tag.delete")] == [f"{repo}:stale"]
    finally:
        hub.stop()


def test_retention_config_is_checked(tmp_path: Path) -> None:
    from forkd.errors import InvalidInput
    from forkd.hub.settings import load_config

    bad = [
        '[[retention]]\nrepositories = "a/*"\n',
        '[[retention]]\nrepositories = "a/*"\nkeep_last = 0\n',
        '[[retention]]\nrepositories = "a/*"\nkeep_for = 3\n',
        'retention = "a/*"\n',
    ]
    for text in bad:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        try:
            load_config(path)
        except InvalidInput:
            continue
        raise AssertionError(f"accepted {text!r}")
    path = tmp_path / "ok.toml"
    path.write_text(
        '[[retention]]\nrepositories = "a/*"\nkeep_last = 3\npulled_within_days = 1.5\n'
    )
    assert load_config(path)["retention"] == (RetentionRule("a/*", 3, 1.5),)


def test_teams_quotas_retention_on_both_backends(backend_hub: HubServer, tmp_path: Path) -> None:
    """The new queries on SQLite and PostgreSQL: team rights, quota accounting, a sweep."""
    hub = backend_hub
    dev = hub.add_user("dev")
    hub.cli("org", "add", "acme")
    hub.cli("team", "add", "acme", "devs", "--role", "push", "--member", dev[0])
    hub.cli("quota", "set", "acme", "2500")
    repo = "acme/app"
    with hub.client(dev) as c:
        base = artifact(c, repo, b"b" * 300, tag="base")
        _, child = artifact(c, repo, b"c" * 300, tag="child", subject=_subject(*base))
        big = b"x" * 3000
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(big)}, content=big)
        assert r.status_code == 403, r.text
        used = 602 + len(base[1]) + len(child)  # blobs and manifest bodies
        assert c.get("/api/v1/namespaces/acme/quota").json()["used_bytes"] == used
    config = _config(tmp_path, '[[retention]]\nrepositories = "acme/*"\nkeep_last = 1\n')
    out = hub.cli("gc", "--retention", "--config", config, "--grace-minutes", "0")
    assert "deleted 0 tags" in out and "1 tags kept as parents" in out
    assert _tags(hub, repo) == ["base", "child"]
