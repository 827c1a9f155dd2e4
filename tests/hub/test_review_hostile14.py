"""Hostile review 14: what one account could make the hub do for it, and for others.

- Glob teams. A listing (``/api/v1/repositories``, ``_catalog``, the catalog UI, and a
  repository page's visibility check) for a member of a team with a repository glob
  read the name of EVERY repository of the team's organisation and matched the glob in
  Python, per request: a user in glob teams of large organisations made each of their
  listings cost in proportion to the organisation. A glob is now one SQL ``LIKE`` (its
  grammar is ``*``, ``?`` and name characters, checked when the team is made), so the
  database filters and pages; ``_`` is a name character, not LIKE's wildcard.
- The retention rule's compaction queue was one FIFO any account could fill: now fair
  between namespaces, bounded per namespace, one place per tag.
- Audit records any caller provokes at will (refusals, anonymous registry tokens) were
  unbounded: an anonymous loop filled the disk. Now bounded per minute, refused logins,
  anonymous callers and accounts apart (``Hub.provoked``).
- Tags cost no quota, and a repository could hold any number: now ``tags_max``.
"""

from __future__ import annotations

import json
import re
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from hub_server import HubServer
from hub_support import ADMIN, OCI_MANIFEST, artifact, error_code, statements, unique_name

from forkd.hub import compaction
from forkd.hub.compaction import Retention
from forkd.hub.services import Hub
from forkd.hub.settings import HubSettings
from forkd.pack import mediatypes as mt


def _reads_every_name(statement: str) -> bool:
    """A SELECT of repository names, neither paged nor counted, nor about one name."""
    s = " ".join(statement.lower().split())
    return (
        s.startswith("select repositories.name")
        and "limit" not in s
        and "count(" not in s
        and "repositories.name = " not in s
    )


def test_a_glob_team_listing_is_filtered_by_the_database(backend_hub: HubServer) -> None:
    hub = backend_hub
    org = unique_name("globs")
    member = hub.add_user(unique_name("globber"))
    hub.cli("org", "add", org)
    granted = [f"{org}/app_{i}" for i in range(3)]
    # '-' where the glob has '_': LIKE's '_' would take it, the glob does not.
    refused = [f"{org}/app-{i}" for i in range(3)] + [f"{org}/other"]
    with hub.client(ADMIN) as c:
        for repo in granted + refused:
            artifact(c, repo, repo.encode(), tag="v1")
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "apps", "role": "pull", "repositories": f"{org}/app_?",
                  "members": [member[0]]},
        )  # fmt: skip
        assert r.status_code == 201, r.text
    with hub.client(member) as c, statements() as seen:
        listed = c.get("/api/v1/repositories", params={"namespace": org, "limit": 100})
        catalog = c.get("/v2/_catalog", params={"n": 1000})
        page = c.get(f"/api/v1/repositories/{granted[0]}")
    assert listed.status_code == 200, listed.text
    assert sorted(i["name"] for i in listed.json()["items"]) == granted
    assert [n for n in catalog.json()["repositories"] if n.startswith(f"{org}/")] == granted
    assert page.status_code == 200
    assert not [s for s in seen if _reads_every_name(s)], seen
    # The routes agree with the listing, repository by repository.
    with hub.client(member) as c:
        for repo in granted:
            assert c.get(f"/v2/{repo}/manifests/v1").status_code == 200, repo
        for repo in refused:
            assert c.get(f"/v2/{repo}/manifests/v1").status_code == 404, repo


def test_a_team_glob_outside_the_grammar_is_refused(hub: HubServer) -> None:
    """``[...]`` classes (and anything but name characters, ``*`` and ``?``) cannot be one
    LIKE: refused when the team is made, with what the glob may use."""
    org = unique_name("badglob")
    hub.cli("org", "add", org)
    with hub.client(ADMIN) as c:
        for glob in (f"{org}/[ab]*", f"{org}/App*", f"{org}/a%", f"{org}/a\\*", f"{org}/ä*"):
            r = c.post(
                f"/api/v1/orgs/{org}/teams",
                json={"name": "t", "role": "pull", "repositories": glob},
            )
            assert r.status_code == 400, r.text
            assert re.search(r"'\*' \(any characters\)", r.text), r.text
        assert c.get(f"/api/v1/orgs/{org}/teams").json() == []


def test_one_namespace_cannot_crowd_out_the_retention_rules_queue(tmp_path: Path) -> None:
    """Before: one FIFO of 1000 jobs. One account pushing 1000 deep-chain tags filled it;
    every other account's pushes were dropped ("queue full") and, had they fitted, waited
    behind all of its compactions. Now the worker takes one job per namespace in turn, a
    namespace has at most QUEUE_PER_NAMESPACE waiting, and a tag pushed again replaces its
    waiting job instead of queueing a second one."""
    hub = Hub.build(HubSettings(tmp_path / "hub", compact_deeper_than=1).validated())
    retention = Retention(hub, 1)
    doc = {"artifactType": mt.ARTIFACT_TYPE, "subject": {"digest": "sha256:" + "0" * 64}}
    digest = "sha256:" + "1" * 64

    def done() -> list[str]:
        path = hub.settings.audit_path
        records = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
        return [r["target"] for r in records if r["action"] == "manifest.compact"]

    async def main() -> list[str]:
        await hub.db.migrate()
        async with anyio.create_task_group() as tg:
            await tg.start(retention.run)
            for i in range(1100):  # none of these repositories exist: each job fails fast
                retention.submit(f"mallory{i % 2}/x", f"t{i // 2}", digest, doc)
            for _ in range(100):
                retention.submit("mallory0/x", "t0", digest, doc)  # one place, not 100
            retention.submit("alice/app", "v1", digest, doc)
            # The queue empties when the worker takes its last job, before that job's
            # audit record is written: wait for every record the bounds allow.
            expected = 2 * compaction.QUEUE_PER_NAMESPACE + 1
            with anyio.fail_after(60):
                while len(done()) < expected or retention.queue:
                    await anyio.sleep(0.05)
            tg.cancel_scope.cancel()
        await hub.close()
        return done()

    order = anyio.run(main)
    per = compaction.QUEUE_PER_NAMESPACE
    assert order.index("alice/app@v1-flat") == 2, order[:5]  # after one of each mallory
    assert sum(t.startswith("mallory0/") for t in order) == per
    assert sum(t.startswith("mallory1/") for t in order) == per
    assert order.count("mallory0/x@t0-flat") == 1


def test_what_callers_provoke_at_will_is_bounded_in_the_audit_log(tmp_path: Path) -> None:
    """Before: every refused request was one audit record (a 255-character repository
    name in it), and so was every anonymous registry token (each naming up to 64
    repositories) and every wrong password: an anonymous client looping on
    ``GET /v2/ANY/manifests/x``, ``/token`` or a wrong password appended to ``audit.log``
    without end (hundreds of bytes to kilobytes a request) until the disk was full. Now
    those records are at most ``audit_provoked_per_minute`` a minute per kind (refused
    logins, other anonymous records, accounts' records), the rest counted in one
    ``audit.suppressed`` record; so a flood hides no record of another kind, and writes
    are never suppressed."""
    per_minute = HubSettings(tmp_path).audit_provoked_per_minute
    server = HubServer(tmp_path / "hub", {"audit_provoked_per_minute": per_minute}).start()
    try:
        name = server.add_user(unique_name("flooded"))[0]
        user = (name, server.token(name, f"{name}:push"))
        private = "x" * 200 + "/secret"
        scopes = [f"repository:pub{i}/app:pull" for i in range(64)]
        before = len(audit_lines(server))
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(3 * per_minute):
                assert c.get(f"/v2/{private}/manifests/v{i}").status_code == 401
                assert c.get("/token", params={"scope": scopes}).status_code == 200
            # Refused logins have a budget of their own: the flood above hides none.
            r = c.get("/v2/", auth=("guesser", "wrong-password-1"))
            assert r.status_code == 401
            for i in range(3 * per_minute):  # then rate-limited, and as many again
                r = c.get("/v2/", auth=(f"nobody{i}", "wrong-password-1"))
                assert r.status_code in (401, 429)
        added = audit_lines(server)[before:]
        # Within two minutes' budgets of each kind whatever the clock did (plus counts).
        assert len(added) <= 2 * (2 * per_minute + 1), len(added)
        assert any(e["action"] == "login" and e["actor"] == "guesser" for e in added)
        # An account's refusal after the flood is still recorded, and so is a write.
        with server.client(user) as c:
            assert c.get(f"/v2/{private}/manifests/v1").status_code == 404
            artifact(c, f"{name}/app", b"kept", tag="v1")
        after = audit_lines(server)
        assert any(e["actor"] == name and e["result"] == "denied" for e in after)
        assert any(e["actor"] == name and e["action"] == "manifest.push" for e in after)
    finally:
        server.stop()


def audit_lines(server: HubServer) -> list[dict[str, Any]]:
    path = server.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_tags_per_repository_are_bounded(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    """Before: a tag costs no quota (any number of tags can name one manifest), so one
    push member could PUT the same small manifest under new tags without end: rows in
    the database, entries in every tag listing, and a storage quota that bounded none of
    it. Now a repository holds at most ``tags_max`` tags; a new one past it is 403
    DENIED saying what to do, new tags racing for the last place do not pass together,
    and moving an existing tag, pushing by digest and tagging again after a deletion
    still work."""
    settings: dict[str, Any] = {"tags_max": 3}
    if backend == "postgresql":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    server = HubServer(tmp_path / "hub", settings).start()
    try:
        repo = f"{ADMIN[0]}/many"
        with server.client(ADMIN) as c:
            digest, body = artifact(c, repo, b"one", tag="t0")
            put = {"content": body, "headers": {"Content-Type": OCI_MANIFEST}}
            assert c.put(f"/v2/{repo}/manifests/t1", **put).status_code == 201

        def tag(name: str) -> int:
            with server.client(ADMIN) as c:
                return c.put(f"/v2/{repo}/manifests/{name}", **put).status_code

        with ThreadPoolExecutor(4) as pool:  # four new tags race for the last place
            assert sorted(pool.map(tag, ["r0", "r1", "r2", "r3"])) == [201, 403, 403, 403]
        with server.client(ADMIN) as c:
            r = c.put(f"/v2/{repo}/manifests/t3", **put)
            assert r.status_code == 403 and error_code(r) == "DENIED", r.text
            assert "tags_max" in r.text
            assert c.put(f"/v2/{repo}/manifests/t1", **put).status_code == 201  # a move
            assert c.put(f"/v2/{repo}/manifests/{digest}", **put).status_code == 201
            artifact(c, repo, b"two")  # by digest: no tag
            tags = c.get(f"/v2/{repo}/tags/list").json()["tags"]
            assert len(tags) == 3 and tags[1:] == ["t0", "t1"], tags  # and one r*
            assert c.delete(f"/v2/{repo}/manifests/t1").status_code == 202
            assert c.put(f"/v2/{repo}/manifests/t3", **put).status_code == 201
    finally:
        server.stop()


def test_namespaces_one_account_fills_leave_places_for_the_others() -> None:
    """An account administers up to 20 organisations: at 50 jobs each it could fill the
    1000 places alone, and everyone else's pushes were "queue full". A full queue now
    gives a newcomer's namespace the place of the newest job of the namespace with the
    most waiting."""
    queue = compaction.FairQueue(total=10, per_namespace=5)
    job = compaction.RetentionJob
    digest = "sha256:" + "1" * 64
    for ns in ("org1", "org2"):
        for i in range(5):
            assert queue.put(job(f"{ns}/x", f"t{i}", digest)) is None
    assert queue.put(job("victim/app", "v1", digest)) is None  # org1's t4 made room
    assert queue.put(job("victim/app", "v2", digest)) is None  # org2's t4
    assert len(queue) == 10
    assert queue.put(job("org3/x", "t0", digest)) is None  # org1 (4) gives t3 up
    # victim (2) is not the fullest: a third victim job takes org2's t3, not org3's t0.
    assert queue.put(job("victim/app", "v3", digest)) is None

    async def drain() -> list[str]:
        return [f"{j.name}:{j.tag}" for j in [await queue.get() for _ in range(len(queue))]]

    taken = anyio.run(drain)
    assert taken[:3] == ["org1/x:t0", "org2/x:t0", "victim/app:v1"], taken
    assert sorted(taken) == sorted(
        [f"org{n}/x:t{i}" for n in (1, 2) for i in range(3)]
        + ["victim/app:v1", "victim/app:v2", "victim/app:v3", "org3/x:t0"]
    )


def test_a_stored_glob_outside_the_grammar_grants_nothing(hub: HubServer) -> None:
    """A team glob stored before the grammar was enforced (``[...]`` classes could not be
    one LIKE) grants nowhere, on the routes and in listings alike, rather than on
    the routes only (fnmatch) and not in listings (SQL): the two can never disagree."""
    org = unique_name("legacy")
    member = hub.add_user(unique_name("legacyuser"))
    hub.cli("org", "add", org)
    with hub.client(ADMIN) as c:
        artifact(c, f"{org}/a1", b"a1", tag="v1")
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "old", "role": "pull", "repositories": f"{org}/a*",
                  "members": [member[0]]},
        )  # fmt: skip
        assert r.status_code == 201, r.text
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute("UPDATE teams SET repositories = ? WHERE name = 'old'", (f"{org}/[a]*",))
    with hub.client(member) as c:
        assert c.get(f"/v2/{org}/a1/manifests/v1").status_code == 404
        listed = c.get("/api/v1/repositories", params={"namespace": org}).json()["items"]
        assert listed == []
