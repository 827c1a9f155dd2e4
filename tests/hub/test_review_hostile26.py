"""Hostile review 26.

1. The UI's tokens page listed every robot its viewer manages, with every token of each,
   and checked each token's minter one by one (``authz.minter_stands``: three reads a
   token) after checking each robot (``authz.may_manage_robot``: three reads a robot).
   Any signed-in user makes 20 organisations of 100 robots with 100 tokens each, so one
   view of that user's page was hundreds of thousands of reads, at will; and a site
   admin manages every robot, so every user's robots were read on every view of the site
   admins' page. Now the page lists ``ROBOTS_PER_PAGE`` robots at a time (``robots_page``),
   which robots a viewer manages is one query (``authz.manageable_robots``, by the rule
   of ``may_manage_robot``), the page's tokens and minters are one query each, and each
   minter is checked once per robot. The robot form offered every organisation a
   site admin administers, i.e. every organisation of the hub (20 per user), as options
   of a list on every view: now the first 100 are suggestions and any name may be typed.
2. A robot that is a site admin (``POST /api/v1/users {"robot": true, "admin": true}``)
   was managed like any robot, by whoever administers every namespace it holds a place
   in: an organisation the operator made it a member of had its admins list its tokens
   (the operator's ``*:admin`` ones), revoke them and mint more. Its rights are on every
   namespace: now only site admins manage it, on every surface (``may_manage_robot``).
   And such a robot counted as a site admin for "never remove the last site admin", so
   the last person who could manage users through the API could be removed, leaving a
   robot that cannot (tokens only): now the guard counts site admins with a password.
3. A tag page drew every compaction link of its lineage: the repository's manifests
   annotated ``dev.forkd.compacted.from`` (up to 10,000 read), each a node with its own
   chain and a read of its tag names. Any pusher of the repository annotates manifests
   so, and every view of the page, signed out on a public pack, was then thousands of
   reads and a graph of as many nodes. Now a tag page reads the newest
   ``COMPACTION_NOTES_MAX`` (256) links, and the chains they bring in add at most
   ``MAX_CHAIN`` (256) manifests in all.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import httpx
from hub_support import (
    ADMIN,
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    artifact,
    browser,
    csrf_of,
    org_with_pusher,
    push_blob,
    sha,
    statements,
    unique_name,
)
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from forkd.hub import authz, chains
from forkd.hub.accounts import Principal
from forkd.hub.models import (
    Base,
    Manifest,
    Membership,
    Namespace,
    Repository,
    Team,
    TeamMember,
    User,
)
from forkd.hub.ui.account import ROBOTS_PER_PAGE
from forkd.pack import mediatypes as mt


def _robots_listed(page: httpx.Response) -> list[str]:
    """The robots a tokens page lists, in its order."""
    assert page.status_code == 200, page.text
    return re.findall(r"<h3>([^<]+)</h3>", page.text)


def test_the_tokens_page_lists_one_page_of_robots_in_bounded_reads(hub: HubServer) -> None:
    """Before: the tokens page listed every robot its viewer manages with all their tokens,
    about a dozen reads per robot (three per token), and the site admins' page every robot
    of the hub. Now it lists ``ROBOTS_PER_PAGE`` robots a page, by name, with links to the
    others, and reads their tokens in one query however many robots there are."""
    org, alice, _ = org_with_pusher(hub)
    names = [f"{org}+r{i:02d}" for i in range(ROBOTS_PER_PAGE + 3)]
    with browser(hub, *alice) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        for name in names:
            for _ in range(2):
                data = {"csrf": csrf, "namespace": org, "robot": name, "role": "push"}
                r = b.post("/-/settings/robots", data=data)
                assert r.status_code == 303, r.text
        with statements() as seen:
            first = b.get("/-/settings/tokens")
        assert _robots_listed(first) == names[:ROBOTS_PER_PAGE]
        assert 'href="/-/settings/tokens?robots_page=2"' in first.text
        token_reads = [s for s in seen if "from api_tokens" in s]
        assert len(token_reads) <= 2, token_reads  # the viewer's own, the page's robots'
        second = b.get("/-/settings/tokens", params={"robots_page": 2})
        assert _robots_listed(second) == names[ROBOTS_PER_PAGE:]
        assert 'href="/-/settings/tokens"' in second.text  # back to the first page
        assert second.text.count("Revoke</button>") >= 2 * 3  # every token of the page
        assert b.get("/-/settings/tokens", params={"robots_page": 3}).status_code == 404
        assert b.get("/-/settings/tokens", params={"robots_page": "0"}).status_code == 400
    with browser(hub, *ADMIN) as b, statements() as seen:
        page = b.get("/-/settings/tokens")
    assert len(_robots_listed(page)) == ROBOTS_PER_PAGE  # the hub has more: in pages
    assert len([s for s in seen if "from api_tokens" in s]) <= 2


def test_the_robot_form_of_a_site_admin_lists_a_bounded_number_of_organisations(
    hub: HubServer,
) -> None:
    """Before: a site admin's tokens page offered every organisation of the hub in the
    robot form's list, each view. Now it suggests the first 100 (``NAMESPACES_LISTED``)
    and takes any typed name: one past them still gets its robot."""
    prefix = unique_name("many")
    names = [f"{prefix}-{i:03d}" for i in range(101)]
    with sqlite3.connect(hub.data_dir / "hub.db") as db:  # through the API: minutes
        db.executemany(
            "INSERT INTO namespaces (name, kind, created_at) VALUES (?, 'org', ?)",
            [(name, "2026-12-07 00:00:00.000000") for name in names],
        )
    with browser(hub, *ADMIN) as b:
        page = b.get("/-/settings/tokens")
        assert page.status_code == 200, page.text
        offered = re.findall(r"<option>([^<]+)</option>", page.text)
        assert len([n for n in offered if n not in ("pull", "push", "admin")]) <= 100
        assert 'list="robot-namespaces"' in page.text
        data = {"csrf": csrf_of(page.text), "namespace": names[-1], "robot": "ci", "role": "pull"}
        r = b.post("/-/settings/robots", data=data)
        assert r.status_code == 303, r.text
    with hub.client(ADMIN) as c:
        members = c.get(f"/api/v1/orgs/{names[-1]}/members").json()
    assert {"user": f"{names[-1]}+ci", "role": "pull", "robot": True} in members

def test_a_tag_page_draws_a_bounded_number_of_compaction_links(hub: HubServer) -> None:
    """Before: 300 manifests a pusher annotated as compacted from ``v1`` were 300 nodes of
    ``v1``'s tag page, and a read of tag names each, on every view (up to 10,000). Now
    the page draws the newest 256 of them (``queries.COMPACTION_NOTES_MAX``) and reads no more."""
    org, alice, _ = org_with_pusher(hub)
    repo = f"{org}/app"
    links = 300  # more than a page draws (256)
    with hub.client(alice) as c:
        head, _ = artifact(c, repo, b"head layer", tag="v1")
        layer = push_blob(c, repo, b"flat layer")
        for i in range(links):
            manifest = {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "artifactType": "application/vnd.example.flat",
                "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
                "layers": [{"mediaType": "application/vnd.example", "digest": layer, "size": 10}],
                "annotations": {mt.ANNOTATION_COMPACTED_FROM: f"{repo}:v1@{head}", "n": str(i)},
            }
            body = json.dumps(manifest).encode()
            r = c.put(
                f"/v2/{repo}/manifests/{sha(body)}",
                content=body,
                headers={"Content-Type": OCI_MANIFEST},
            )
            assert r.status_code == 201, r.text
    with browser(hub, *alice) as b, statements() as seen:
        page = b.get(f"/{repo}/-/tags/v1")
    assert page.status_code == 200, page.text
    drawn = len(re.findall(r'class="node[^"]*compacted', page.text))
    assert drawn == 256, drawn
    assert "Compaction links: 256<" in page.text
    tag_reads = [s for s in seen if "from tags" in s]
    assert len(tag_reads) <= 256 + 8, len(tag_reads)


def test_the_chains_compaction_links_bring_in_are_bounded_in_all(tmp_path: Path) -> None:
    """Before: each compaction end a tag page drew came with its whole chain (256
    ancestors each), so 256 ends of distinct deep chains were 65,000 manifests read and
    drawn per view. Now the ends and their chains add at most ``MAX_CHAIN`` manifests in
    all, the nearest levels first."""
    engine = create_engine(f"sqlite:///{tmp_path / 'chains.db'}")
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        repo = Repository(name="acme/app", namespace_id=1)
        session.add(repo)
        session.flush()

        def manifest(digest: str, subject: str | None) -> Manifest:
            return Manifest(
                repository_id=repo.id,
                digest=digest,
                media_type=OCI_MANIFEST,
                subject_digest=subject,
                size=1,
            )

        session.add(manifest("sha256:head", None))
        ends = []
        for chain in range(10):
            parent = None
            for level in range(100):  # the end is the last one, 99 ancestors under it
                digest = f"sha256:c{chain:02d}-{level:03d}"
                session.add(manifest(digest, parent))
                parent = digest
            ends.append(parent)
        session.flush()
        fam = chains.family(session, repo.id, "sha256:head")
        assert fam is not None and len(fam.found) == 1
        chains.with_chains(session, repo.id, fam, [e for e in ends if e])
    assert len(fam.found) == 1 + chains.MAX_CHAIN, len(fam.found)
    assert all(e in fam.found for e in ends)  # the ends first, then their nearest parents


def _token_ids(hub: HubServer, user: str) -> list[int]:
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        rows = db.execute(
            "SELECT api_tokens.id FROM api_tokens JOIN users ON users.id = api_tokens.user_id "
            "WHERE users.name = ? ORDER BY api_tokens.id",
            (user,),
        )
        return [row[0] for row in rows]


def test_a_robot_that_is_a_site_admin_is_managed_by_site_admins_only(hub: HubServer) -> None:
    """Before: the operator's admin robot, made a member of alice's organisation, was on
    alice's tokens page with its ``*:admin`` token, which she could revoke (303), and she
    could mint it more tokens. Now its tokens are not listed to her, her revocation is
    404 and the token works on, her robot form and member form refuse it; a site admin
    still manages it."""
    org, alice, _ = org_with_pusher(hub)
    bot = unique_name("opsbot")
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json={"name": bot, "robot": True, "admin": True})
        assert r.status_code == 201, r.text
        r = c.put(f"/api/v1/orgs/{org}/members/{bot}", json={"role": "pull"})
        assert r.status_code == 204, r.text
    secret = hub.token(bot, "*:admin")
    (token_id,) = _token_ids(hub, bot)
    with browser(hub, *alice) as b:
        page = b.get("/-/settings/tokens")
        assert page.status_code == 200 and bot not in page.text
        csrf = csrf_of(page.text)
        r = b.post(f"/-/settings/tokens/{token_id}/revoke", data={"csrf": csrf})
        assert r.status_code == 404, r.text
        data = {"csrf": csrf, "namespace": org, "robot": bot, "role": "pull"}
        assert b.post("/-/settings/robots", data=data).status_code == 400
        data = {"csrf": csrf, "username": bot, "role": "push"}
        assert b.post(f"/-/members/{org}", data=data).status_code == 403
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bot}", json={"role": "push"})
        assert r.status_code == 403, r.text
    assert _token_ids(hub, bot) == [token_id]
    with hub.client((bot, secret)) as c:
        assert c.get("/v2/").status_code == 200
        assert c.get("/api/v1/users").status_code == 403  # tokens manage no users
    with browser(hub, *ADMIN) as b:  # the site admins' to manage
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        data = {"csrf": csrf, "namespace": org, "robot": bot, "role": "pull"}
        assert b.post("/-/settings/robots", data=data).status_code == 303


def test_an_admin_robot_does_not_stand_in_for_the_last_site_admin(fresh_hub: HubServer) -> None:
    """Before: with a robot that is a site admin, ``DELETE /api/v1/users/<the last
    person who is a site admin>`` was 204, and no one was left to manage users through
    the API (a robot signs in with tokens only, and managing users needs the password).
    Now it is 409; with another such person it is 204."""
    hub = fresh_hub
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json={"name": "opsbot", "robot": True, "admin": True})
        assert r.status_code == 201, r.text
        r = c.delete(f"/api/v1/users/{ADMIN[0]}")
        assert r.status_code == 409 and "last site admin" in r.text, r.text
        other = {"name": "root2", "password": "root2-password", "admin": True}
        assert c.post("/api/v1/users", json=other).status_code == 201
    with hub.client(("root2", "root2-password")) as c:
        assert c.delete(f"/api/v1/users/{ADMIN[0]}").status_code == 204


def test_the_one_query_of_manageable_robots_agrees_with_may_manage_robot(tmp_path: Path) -> None:
    """Before: the tokens page asked ``may_manage_robot`` robot by robot. Now which robots
    a viewer manages is one query (``authz.manageable_robots``): it lists exactly the
    robots with a place that ``may_manage_robot`` allows, for an organisation admin and a
    site admin (a robot with a place elsewhere, through a membership or a team, or that
    is a site admin, is not an organisation admin's)."""
    engine = create_engine(f"sqlite:///{tmp_path / 'robots.db'}")
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        a, b = Namespace(name="a", kind="org"), Namespace(name="b", kind="org")
        alice = User(name="alice")
        root = User(name="root", is_admin=True)
        robots = {
            name: User(name=name, is_robot=True, is_admin=name == "r-admin")
            for name in ("r-a", "r-a-team-b", "r-b", "r-admin", "r-team-a", "r-nowhere")
        }
        session.add_all([a, b, alice, root, *robots.values()])
        session.flush()
        team_a = Team(namespace_id=a.id, name="ta", role="pull")
        team_b = Team(namespace_id=b.id, name="tb", role="pull")
        session.add_all([team_a, team_b])
        session.flush()
        session.add_all(
            [
                Membership(namespace_id=a.id, user_id=alice.id, role="admin"),
                Membership(namespace_id=a.id, user_id=robots["r-a"].id, role="push"),
                Membership(namespace_id=a.id, user_id=robots["r-a-team-b"].id, role="push"),
                TeamMember(team_id=team_b.id, user_id=robots["r-a-team-b"].id),
                Membership(namespace_id=b.id, user_id=robots["r-b"].id, role="push"),
                Membership(namespace_id=a.id, user_id=robots["r-admin"].id, role="pull"),
                TeamMember(team_id=team_a.id, user_id=robots["r-team-a"].id),
            ]
        )
        session.flush()
        for user in (alice, root):
            who = Principal(user.id, user.name, user.is_admin)
            listed = [r.name for r in authz.manageable_robots(session, who)]
            placed = [r for r in robots.values() if authz.robot_namespaces(session, r.id)]
            allowed = sorted(r.name for r in placed if authz.may_manage_robot(session, who, r.id))
            assert listed == allowed, (user.name, listed, allowed)
        assert [r.name for r in authz.manageable_robots(session, Principal(alice.id, "alice"))] == [
            "r-a",
            "r-team-a",
        ]
