"""Hostile review 15: what one client could take from every other client.

- The audit budget of provoked records (refusals, anonymous registry tokens, refused
  logins) was one per kind for the whole hub: one account looping on refused requests,
  or one address looping anonymously or on wrong passwords, spent the minute's budget
  of its kind, and every other client's refusals of that minute went unrecorded (a
  flood to hide a probe behind). Now one client (an account; for anonymous callers and
  logins, an address) has a share of its kind's budget (``Hub.provoked``). And an
  account's registry tokens (up to 64 repositories named in each record) were recorded
  as often as it asked: now a budget per account. An IPv6 address is counted by its /64.
- A listing (``/api/v1/repositories``, a repository's page, the catalog UI) wrote the
  batched pull counts first whenever any were pending: a read that is a write
  transaction, waiting for the write lock. An anonymous client alternating a pull and a
  listing made every listing a write. Now a listing writes them at most once a second.
- A retention sweep deleting the manifests it untagged re-read every tag of the
  repository once per manifest deleted, under the write lock: quadratic in a pusher's
  tags (up to ``tags_max``, 100,000), the whole hub's writes waiting meanwhile. Now
  worked out in memory from one read, linear in the repository's rows.
- A sweep took the repositories in name order, each in one transaction: a namespace of
  many repositories or tags held the write lock as long as it liked, and every later
  namespace's deletions waited for all of its own. Now ``SWEEP_CHUNK`` tags a
  transaction, namespaces taking turns.
- A team's stored glob naming another organisation (by hand, or from before the
  checks) listed that organisation's private repositories to the team's members, and a
  stored glob that grants nothing was listed as if it granted. A glob now grants in its
  team's organisation only, and team listings say why one grants nothing.
- The UI cut each form field to its limit without a word (a README or description
  stored cut short, as if saved); a README the text check refused was a 404. Now a
  field past its limit, or text the check refuses, is a 400 that says which and why.
- A blob ``Range`` of another unit (``items=``), of several ranges, or with the unit in
  capitals was a 416: RFC 9110 says ignore the first two (the whole blob) and the unit
  is case-insensitive.
"""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
from hub_server import HubServer
from hub_support import ADMIN, artifact, statements, unique_name

from forkd.audit import AuditLog, BoundedAudit
from forkd.hub.pulls import FLUSH_INTERVAL_S, READ_FLUSH_S
from forkd.hub.retention import SWEEP_CHUNK
from forkd.hub.services import PROVOKED_SHARES, SUPPRESSED

PER_MINUTE = 40


def audit_lines(server: HubServer) -> list[dict[str, Any]]:
    path = server.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_one_client_cannot_spend_every_clients_audit_budget(tmp_path: Path) -> None:
    """Before: account ``flooder`` made ``PER_MINUTE`` refused requests and the refusal
    of ``prober`` that followed in the same minute was not recorded; so were an
    anonymous address's and a login guesser's floods to everyone else of their kind."""
    server = HubServer(
        tmp_path / "hub",
        {"audit_provoked_per_minute": PER_MINUTE, "trusted_proxies": "127.0.0.1"},
    ).start()
    flood, other = {"X-Forwarded-For": "10.9.0.1"}, {"X-Forwarded-For": "10.9.0.2"}
    try:
        share = PER_MINUTE // PROVOKED_SHARES
        flooder = server.add_user(unique_name("flooder"))
        prober = server.add_user(unique_name("prober"))
        secret = "victim/secret"
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(PER_MINUTE + 5):
                r = c.get(f"/v2/{secret}/manifests/v{i}", auth=flooder)
                assert r.status_code == 404
                r = c.get(f"/v2/{secret}/manifests/v{i}", headers=flood)
                assert r.status_code == 401
                r = c.get("/v2/", auth=(f"guess{i}", "wrong"), headers=flood)
                assert r.status_code in (401, 429)
            assert c.get("/v2/victim/probe/manifests/v1", auth=prober).status_code == 404
            r = c.get("/v2/victim/anon/manifests/v1", headers=other)
            assert r.status_code == 401
            r = c.get("/v2/", auth=("other-guess", "wrong"), headers=other)
            assert r.status_code == 401
        lines = audit_lines(server)
        refused = [e for e in lines if e["result"] in ("denied", "rate-limited")]
        # Each flood wrote its client's share, no more (plus a minute's turn, at most).
        assert len([e for e in refused if e["actor"] == flooder[0]]) <= 2 * share
        from_flood = [e for e in refused if e["ip"] == "10.9.0.1"]
        assert len([e for e in from_flood if e["action"] == "login"]) <= 2 * share
        assert len([e for e in from_flood if e["action"] != "login"]) <= 2 * share
        # And every other client's refusal is still in the log.
        assert any(e["actor"] == prober[0] and e["target"] == "victim/probe" for e in refused)
        assert any(e["ip"] == "10.9.0.2" and e["target"] == "victim/anon" for e in refused)
        assert any(e["ip"] == "10.9.0.2" and e["actor"] == "other-guess" for e in refused)
    finally:
        server.stop()


def test_listings_between_pulls_do_not_each_write(hub: HubServer) -> None:
    """Before: each of the 40 listings below, every one after a pull, was a write
    transaction (``UPDATE repositories SET pull_count``): 40 writes."""
    org = unique_name("pulled")
    hub.cli("org", "add", org)
    repo = f"{org}/app"
    with hub.client(ADMIN) as c:
        artifact(c, repo, b"pulled", tag="v1")
    hub.public(repo)
    rounds = 40
    with hub.client() as c, statements() as seen:
        start = time.monotonic()
        for i in range(rounds):
            assert c.get(f"/v2/{repo}/manifests/v1").status_code == 200
            path = "/api/v1/repositories" if i % 2 else f"/api/v1/repositories/{repo}"
            assert c.get(path).status_code == 200
        elapsed = time.monotonic() - start
    writes = [s for s in seen if s.startswith("update repositories set pull_count")]
    bound = elapsed / READ_FLUSH_S + elapsed / FLUSH_INTERVAL_S + 2
    assert len(writes) <= bound < rounds, (len(writes), elapsed)
    # The counts still arrive: a listing a second later shows every pull.
    time.sleep(READ_FLUSH_S)
    with hub.client() as c:
        assert c.get(f"/api/v1/repositories/{repo}").json()["pulls"] == rounds


def _old_tags(hub: HubServer, repo: str, rows: int) -> tuple[list[str], int]:
    """``rows`` tags pushed long ago, each on a manifest of its own, written straight to
    the database (pushing them through the API would take minutes)."""
    old = "2026-01-01 00:00:00.000000+00:00"
    digests = [f"sha256:{hashlib.sha256(f'{repo} {i}'.encode()).hexdigest()}" for i in range(rows)]
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        found = db.execute("SELECT id FROM repositories WHERE name = ?", (repo,))
        (repo_id,) = found.fetchone()
        db.executemany(
            "INSERT INTO blobs (digest, size, created_at) VALUES (?, 100, ?)",
            [(d, old) for d in digests],
        )
        db.executemany(
            "INSERT INTO manifests (repository_id, digest, media_type, size, created_at)"
            " VALUES (?, ?, 'application/vnd.oci.image.manifest.v1+json', 100, ?)",
            [(repo_id, d, old) for d in digests],
        )
        db.executemany(
            "INSERT INTO tags (repository_id, name, manifest_digest, updated_at, pull_count)"
            " VALUES (?, ?, ?, ?, 0)",
            [(repo_id, f"old{i:04d}", d, old) for i, d in enumerate(digests)],
        )
    return digests, repo_id


def test_a_retention_sweep_reads_a_repositorys_tags_once(tmp_path: Path) -> None:
    """Before: 300 untagged manifests were 300 reads of every tag of the repository."""
    hub = HubServer(tmp_path / "hub").start()
    try:
        repo, rows = "swept/app", 300
        with hub.client(ADMIN) as c:
            kept, _ = artifact(c, repo, b"newest", tag="newest")
        digests, repo_id = _old_tags(hub, repo, rows)
        config = tmp_path / "hub.toml"
        config.write_text('[[retention]]\nrepositories = "swept/*"\nkeep_last = 1\n')
        with statements() as seen:
            out = hub.cli("gc", "--retention", "--config", str(config), "--grace-minutes", "60")
        assert f"deleted {rows} tags" in out, out
        tag_reads = [s for s in seen if s.startswith("select") and " from tags" in s]
        assert len(tag_reads) <= 3, len(tag_reads)
        with hub.client(ADMIN) as c:
            assert c.get(f"/v2/{repo}/tags/list").json()["tags"] == ["newest"]
            assert c.get(f"/v2/{repo}/manifests/{kept}").status_code == 200
            assert c.get(f"/v2/{repo}/manifests/{digests[0]}").status_code == 404
        with sqlite3.connect(hub.data_dir / "hub.db") as db:
            (left,) = db.execute(
                "SELECT count(*) FROM manifests WHERE repository_id = ?", (repo_id,)
            ).fetchone()
        assert left == 1
    finally:
        hub.stop()


def test_a_retention_sweep_takes_namespaces_in_turns(tmp_path: Path) -> None:
    """Before: namespace ``aaa``'s 1,200 deletions were one transaction, and ``zzz``'s one
    deletion came after all of them."""
    hub = HubServer(tmp_path / "hub").start()
    try:
        big, small, rows = "aaa/app", "zzz/app", 2 * SWEEP_CHUNK + 200
        with hub.client(ADMIN) as c:
            artifact(c, big, b"big newest", tag="newest")
            artifact(c, small, b"small old", tag="old")
            artifact(c, small, b"small newest", tag="newest")
        _old_tags(hub, big, rows)
        config = tmp_path / "hub.toml"
        config.write_text('[[retention]]\nrepositories = "*"\nkeep_last = 1\n')
        out = hub.cli("gc", "--retention", "--config", str(config), "--grace-minutes", "60")
        assert f"deleted {rows + 1} tags" in out, out
        deleted = [e["target"] for e in audit_lines(hub) if e["action"] == "tag.delete"]
        assert len(deleted) == rows + 1
        assert deleted.index(f"{small}:old") <= SWEEP_CHUNK, deleted.index(f"{small}:old")
        with hub.client(ADMIN) as c:
            assert c.get(f"/v2/{big}/tags/list").json()["tags"] == ["newest"]
            assert c.get(f"/v2/{small}/tags/list").json()["tags"] == ["newest"]
    finally:
        hub.stop()


def test_a_stored_team_glob_grants_only_in_its_organisation_and_says_so(hub: HubServer) -> None:
    """Before: a glob stored in a team of ``org`` naming another organisation
    (``other/*``: made by hand, or before the checks) listed that organisation's private
    repositories to the team's members; and a stored glob that grants nothing (this one,
    or one with ``[...]``) was listed as if it granted, with nothing to say why."""
    org, other = unique_name("home"), unique_name("elsewhere")
    member = hub.add_user(unique_name("teamed"))
    hub.cli("org", "add", org)
    hub.cli("org", "add", other)
    with hub.client(ADMIN) as c:
        artifact(c, f"{other}/secret", b"elsewhere", tag="v1")
        for team in ("wide", "classy"):
            r = c.post(
                f"/api/v1/orgs/{org}/teams",
                json={"name": team, "role": "pull", "repositories": f"{org}/*",
                      "members": [member[0]]},
            )  # fmt: skip
            assert r.status_code == 201, r.text
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute("UPDATE teams SET repositories = ? WHERE name = 'wide'", (f"{other}/*",))
        db.execute("UPDATE teams SET repositories = ? WHERE name = 'classy'", (f"{org}/[a]*",))
    with hub.client(member) as c:
        listed = c.get("/api/v1/repositories", params={"namespace": other}).json()["items"]
        assert listed == []
        assert c.get(f"/v2/{other}/secret/manifests/v1").status_code == 404
    with hub.client(ADMIN) as c:
        teams = {t["name"]: t for t in c.get(f"/api/v1/orgs/{org}/teams").json()}
        for team in ("wide", "classy"):
            assert "grants nothing" in teams[team]["problem"], teams[team]
            assert f"must start with '{org}/'" in teams[team]["problem"]
    out = hub.cli("team", "list", org)
    assert out.count("grants nothing") == 2, out


def test_an_accounts_registry_tokens_are_bounded_in_the_audit_log(tmp_path: Path) -> None:
    """Before: every registry token an account asked for was one audit record naming up
    to 64 repositories (about 17 KB with long names), as often as it liked: one account
    looping on ``/token`` filled the disk. Now ``audit_provoked_per_minute`` a minute per
    account; another account's tokens are still recorded."""
    server = HubServer(tmp_path / "hub", {"audit_provoked_per_minute": PER_MINUTE}).start()
    try:
        looper = server.add_user(unique_name("looper"))
        other = server.add_user(unique_name("other"))
        scopes = [f"repository:{looper[0]}/{'r' * 200}{i}:pull" for i in range(64)]
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for _ in range(3 * PER_MINUTE):
                assert c.get("/token", params={"scope": scopes}, auth=looper).status_code == 200
            r = c.get("/token", params={"scope": f"repository:{other[0]}/app:pull"}, auth=other)
            assert r.status_code == 200
        tokens = [e for e in audit_lines(server) if e["action"] == "token"]
        assert len([e for e in tokens if e["actor"] == looper[0]]) <= 2 * PER_MINUTE
        assert any(e["actor"] == other[0] for e in tokens)
    finally:
        server.stop()


def test_addresses_of_one_ipv6_subscriber_share_one_audit_share(tmp_path: Path) -> None:
    """An IPv6 subscriber has a /64 of addresses: each of them is not a client of its own
    in the provoked-record budget (else 8 of them spend everyone's)."""
    server = HubServer(
        tmp_path / "hub",
        {"audit_provoked_per_minute": PER_MINUTE, "trusted_proxies": "127.0.0.1"},
    ).start()
    try:
        share = PER_MINUTE // PROVOKED_SHARES
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(PER_MINUTE + 5):
                flood = {"X-Forwarded-For": f"2001:db8:1:2::{i + 1:x}"}
                assert c.get(f"/v2/victim/x/manifests/v{i}", headers=flood).status_code == 401
            other = {"X-Forwarded-For": "2001:db8:1:3::1"}
            assert c.get("/v2/victim/other/manifests/v1", headers=other).status_code == 401
        refused = [e for e in audit_lines(server) if e["result"] == "denied"]
        assert len([e for e in refused if e["ip"].startswith("2001:db8:1:2:")]) <= 2 * share
        assert any(e["ip"] == "2001:db8:1:3::1" for e in refused)
    finally:
        server.stop()


def test_a_budgets_next_minute_says_how_much_and_how_many_clients_were_cut(
    tmp_path: Path,
) -> None:
    """What a share cut is not lost without a trace: the next minute's first record is
    preceded by ``audit.suppressed`` with the count and how many clients went past their
    share."""
    audit = AuditLog(tmp_path / "audit.log")
    share = PER_MINUTE // PROVOKED_SHARES
    budget = BoundedAudit(audit, PER_MINUTE, SUPPRESSED, "(accounts)", share)
    for client in ("a", "b"):
        for i in range(share + 3):
            budget.record(client, "10.0.0.1", "pull", f"x/{i}", "denied", client=client)
    budget.record("c", "10.0.0.1", "pull", "x/c", "denied", client="c")
    start, written, dropped = budget._window  # the minute is over (white box: no
    budget._window = (start - 61, written, dropped)  # minute-long test)
    assert budget.record("a", "10.0.0.1", "pull", "x/next", "denied", client="a")
    audit.close()
    lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    assert [e["actor"] for e in lines].count("a") == share + 1
    assert any(e["actor"] == "c" for e in lines)
    suppressed = [e for e in lines if e["action"] == "audit.suppressed"]
    assert len(suppressed) == 1 and suppressed[0]["actor"] == "(accounts)"
    assert suppressed[0]["count"] == 6 and suppressed[0]["clients"] == {"a": 3, "b": 3}
    assert lines[-1]["target"] == "x/next" and lines[-2] == suppressed[0]


def _ui_signed_in(c: httpx.Client, who: tuple[str, str]) -> str:
    """Sign ``c`` in through the UI's form; the CSRF field of its session's forms."""
    token = re.search(r'name="login_csrf" value="([^"]*)"', c.get("/-/signin").text)
    assert token
    data = {"login_csrf": token.group(1), "username": who[0], "password": who[1]}
    assert c.post("/-/signin", data=data).status_code == 303
    csrf = re.search(r'name="csrf" value="([^"]*)"', c.get("/-/settings/tokens").text)
    assert csrf
    return csrf.group(1)


def test_a_form_field_past_its_limit_is_refused_not_cut(hub: HubServer) -> None:
    """Before: the UI cut each form field to its limit without a word: a README of more
    than 256 Ki characters was stored cut short (303, as if saved), a description of
    more than 300 too; and a README of multi-byte characters over 256 KiB was a 404
    ("no repository") for a repository the caller may edit."""
    owner = hub.add_user(unique_name("writer"))
    repo = f"{owner[0]}/docs"
    with hub.client(owner) as c:
        artifact(c, repo, b"docs", tag="v1")
    with hub.client() as c:
        csrf = _ui_signed_in(c, owner)
        for readme, description, why in [
            ("x" * (256 * 1024 + 10), "short", "readme is 262154 characters, the limit is 262144"),
            ("short", "d" * 301, "description is 301 characters, the limit is 300"),
            ("\u00e9" * 140_000, "short", "README is over 256 KiB"),  # 280,000 bytes
        ]:
            # multipart: a URL-encoded \u00e9 is 6 bytes, past the form's bound
            fields = {"csrf": csrf, "readme": readme, "description": description}
            r = c.post(f"/-/edit/{repo}", files={k: (None, v) for k, v in fields.items()})
            assert r.status_code == 400, (r.status_code, r.text[-500:])
            assert why in r.text, r.text[-500:]
        r = c.post(f"/-/edit/{repo}", data={"csrf": csrf, "readme": "kept", "description": "one"})
        assert r.status_code == 303
    with hub.client(owner) as c:
        text = c.get(f"/api/v1/readme/{repo}").json()
    assert text["readme"] == "kept" and text["description"] == "one"


def test_a_range_of_another_unit_or_of_several_ranges_is_ignored(hub: HubServer) -> None:
    """RFC 9110 14.2: a range unit the server does not know MUST be ignored (the whole
    blob, 200); the unit is case-insensitive; several ranges (no multipart answers here)
    may be ignored. Before: 416 for all three, and so a client that asked for the whole
    of a blob it may read, in a form the spec allows, got nothing."""
    owner = hub.add_user(unique_name("ranger"))
    repo = f"{owner[0]}/ranged"
    with hub.client(owner) as c:
        artifact(c, repo, b"0123456789", tag="v1")
        layer = c.get(f"/v2/{repo}/manifests/v1").json()["layers"][0]["digest"]
        url = f"/v2/{repo}/blobs/{layer}"
        for header in ("items=0-1", "bytes=0-0,2-3", "bytes=0-1, 4-5"):
            r = c.get(url, headers={"Range": header})
            assert r.status_code == 200 and r.content == b"0123456789", (header, r.status_code)
            assert "content-range" not in r.headers
        r = c.get(url, headers={"Range": "Bytes=2-4"})
        assert r.status_code == 206 and r.content == b"234"
        assert r.headers["content-range"] == "bytes 2-4/10"
        # A byte range that cannot be served is still 416, saying the size.
        r = c.get(url, headers={"Range": "bytes=10-"})
        assert r.status_code == 416 and r.headers["content-range"] == "bytes */10"
