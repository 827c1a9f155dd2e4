"""Hostile review 8: a right withdrawn while a request runs is withdrawn from what it
stores, every route refuses outsiders alike, and what one account may make is bounded.

* in-flight writes: an upload (monolithic or the closing ``PUT``), a manifest body or a
  cross-repository mount whose request began while the caller could push, and whose
  user was removed, token revoked or membership taken away before its bytes were all
  in, stores nothing: the write transaction checks the caller again
  (``auth.still_permitted``);
* the route table: every route Litestar serves, filled in for a private repository and
  its organisation, refuses an anonymous caller and an outsider without naming what
  exists; a new route that forgets its check fails this test;
* team membership is a way into an organisation: it obeys the rules a direct
  membership obeys (robots only through who manages them) and is bounded per request;
  ``/api/v1`` bodies are bounded in bytes on every route;
* per-account counts: API tokens per user and organisations per creator are bounded,
  also when requests race;
* manifests with duplicate keys are ambiguous (a first-wins parser reads another
  document) and refused.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hub_support import (
    ADMIN,
    EMPTY_CONFIG,
    OCI_MANIFEST,
    HubServer,
    artifact,
    authorized,
    error_code,
    org_with_pusher,
    sha,
    unique_name,
)

TIMEOUT = 60


class _SlowBody:
    """A request body sent in two halves; the second waits until ``release``."""

    def __init__(self, first: bytes, second: bytes) -> None:
        self.first, self.second = first, second
        self.sent_first = threading.Event()
        self.go_on = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        yield self.first
        self.sent_first.set()
        assert self.go_on.wait(TIMEOUT)
        yield self.second


def _open_sessions(hub: HubServer) -> int:
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        return int(db.execute("SELECT count(*) FROM uploads").fetchone()[0])


def _while_sending(
    hub: HubServer, send: Any, body: _SlowBody, withdraw: Any, *, session_row: bool
) -> httpx.Response:
    """Send a request with ``body`` in a thread, run ``withdraw`` once the hub is reading
    its body (it has opened its upload session row, or authorized the request: was "or
    had a second to", and a loaded machine's hub could authorize after the withdrawal,
    refusing the request as it began instead of while it ran), then let the rest of the
    body go."""
    with authorized() as allowed, ThreadPoolExecutor(1) as pool:
        before = _open_sessions(hub)
        pending = pool.submit(send)
        assert body.sent_first.wait(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        if session_row:
            while _open_sessions(hub) <= before:
                assert time.monotonic() < deadline, "the upload never began"
                time.sleep(0.02)
        else:
            assert allowed.wait(TIMEOUT), "the hub never authorized the request"
        withdraw()
        body.go_on.set()
        return pending.result(TIMEOUT)


def _remove_member(hub: HubServer, admin: tuple[str, str], org: str, user: str) -> None:
    with hub.client(admin) as c:
        assert c.delete(f"/api/v1/orgs/{org}/members/{user}").status_code == 204


def _blob_linked(hub: HubServer, repo: str, digest: str) -> bool:
    with hub.client(ADMIN) as c:
        return c.head(f"/v2/{repo}/blobs/{digest}").status_code == 200


# -- 1. a right withdrawn mid-request -------------------------------------------------
def test_an_upload_whose_pusher_was_removed_meanwhile_stores_nothing(hub: HubServer) -> None:
    """Bob began a monolithic upload into the organisation's private repository; alice
    removed him from the organisation while his bytes were arriving. The upload was
    authorised only when it began, so it was linked (201) and counted against the
    organisation. Now the link's transaction checks again: 403 DENIED (he was told the
    repository exists when the upload began: withdrawn, not unknown) and the blob is not
    in it."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    body = _SlowBody(b"bob's first half ", b"and the second")
    digest = sha(body.first + body.second)
    with hub.client(bob) as c:
        r = _while_sending(
            hub,
            lambda: c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": digest}, content=body),
            body,
            lambda: _remove_member(hub, alice, org, bob[0]),
            session_row=True,
        )
    assert r.status_code == 403, r.text
    assert error_code(r) == "DENIED"
    assert "withdrawn while this request ran" in r.text
    assert not _blob_linked(hub, repo, digest)


def test_an_upload_with_a_token_revoked_meanwhile_stores_nothing(hub: HubServer) -> None:
    """The closing PUT of a chunked upload, sent with an API token that its owner revoked
    while the last chunk was arriving: 401, nothing linked."""
    org, _alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    token = hub.token(bob[0], f"{org}:push")
    with hub.client(bob) as c:
        token_id = c.get("/api/v1/tokens").json()[-1]["id"]
    body = _SlowBody(b"the last ", b"chunk")
    digest = sha(b"first chunk, " + body.first + body.second)

    def revoke() -> None:
        with hub.client(bob) as c:
            assert c.delete(f"/api/v1/tokens/{token_id}").status_code == 204

    with hub.client((bob[0], token)) as c:
        where = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
        assert c.patch(where, content=b"first chunk, ").status_code == 202
        r = _while_sending(
            hub,
            lambda: c.put(where, params={"digest": digest}, content=body),
            body,
            revoke,
            session_row=False,
        )
    assert r.status_code == 401, r.text
    assert not _blob_linked(hub, repo, digest)


def test_a_manifest_whose_pusher_lost_push_meanwhile_is_not_recorded(hub: HubServer) -> None:
    """A manifest body arrives slowly; the pusher is demoted to pull before it is all
    in. It used to be recorded and tagged (the check ran before the body was read); now
    403 DENIED, and the tag does not exist."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(bob) as c:
        layer = b"bob's layer"
        c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(EMPTY_CONFIG)}, content=b"{}")
        c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(layer)}, content=layer)
        doc = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.empty.v1+json",
                    "digest": sha(EMPTY_CONFIG),
                    "size": 2,
                },
                "layers": [
                    {"mediaType": "application/octet-stream", "digest": sha(layer), "size": 11}
                ],
            }
        ).encode()
        body = _SlowBody(doc[:20], doc[20:])

        def demote() -> None:
            with hub.client(alice) as a:
                r = a.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "pull"})
                assert r.status_code == 204, r.text

        r = _while_sending(
            hub,
            lambda: c.put(
                f"/v2/{repo}/manifests/late",
                content=body,
                headers={"Content-Type": OCI_MANIFEST},
            ),
            body,
            demote,
            session_row=False,
        )
        assert r.status_code == 403, r.text
        assert error_code(r) == "DENIED"
        assert "withdrawn while this request ran" in r.text
        assert c.get(f"/v2/{repo}/manifests/late").status_code == 404


# -- 2. every route refuses outsiders, alike for what exists and what does not -------
def _route_table(hub: HubServer) -> list[tuple[str, str]]:
    """(method, path template) of every route the app serves, from Litestar's own table
    (so a route added later is in it), the OCI catch-all expanded into its resources."""
    assert hub._server is not None
    app = hub._server.config.app
    oci = [
        "{name}/manifests/v1",
        "{name}/manifests/{manifest}",
        "{name}/blobs/{blob}",
        "{name}/blobs/uploads/",
        "{name}/blobs/uploads/{upload}",
        "{name}/tags/list",
        "{name}/referrers/{manifest}",
    ]
    found: set[tuple[str, str]] = set()
    for route in app.routes:
        for method in getattr(route, "methods", ()):
            if method == "OPTIONS":
                continue
            template = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            if template == "/v2/{path}":
                found.update((method, f"/v2/{resource}") for resource in oci)
            else:
                found.add((method, template))
    return sorted(found)


# Routes anyone may call, whoever they are, and what they answer is no one's secret.
OPEN = {
    "/",
    "/healthz",
    "/token",
    "/v2",
    "/-/search",
    "/-/signin",
    "/-/signout",
    "/-/static/{file_path}",
    "/-/{path}",
    "/api/v1/repositories",
}
# A signed-in caller's own (their tokens, a new organisation of theirs): refused to
# anonymous callers only.
OWN = {("GET", "/api/v1/tokens"), ("POST", "/api/v1/tokens"), ("POST", "/api/v1/orgs")}


def _answers(
    c: httpx.Client, routes: list[tuple[str, str]], names: dict[str, str]
) -> dict[tuple[str, str], tuple[int, str]]:
    out = {}
    for method, template in routes:
        if template in OPEN or template.startswith("/api/schema"):
            continue
        if c.auth is not None and (method, template) in OWN:
            continue
        path = template.format(**names)
        kwargs: dict[str, Any] = {}
        if method in ("POST", "PUT", "PATCH"):
            if template.startswith("/api/"):
                kwargs["json"] = {"role": "admin", "name": "x", "members": [], "quota_bytes": 1}
            elif not template.startswith("/v2/"):
                kwargs["data"] = {"username": "x", "role": "admin", "readme": "x"}
        r = c.request(method, path, params={"tag": "v1"}, **kwargs)
        code = ""
        if r.headers.get("content-type", "").startswith("application/json") and r.content:
            body = r.json()
            code = body["errors"][0]["code"] if isinstance(body, dict) and "errors" in body else ""
        if r.status_code == 303:
            code = r.headers["Location"]  # a redirect to sign in refuses too
        out[(method, template)] = (r.status_code, code)
    return out


def test_every_route_refuses_outsiders_and_tells_nothing_of_what_exists(hub: HubServer) -> None:
    """For each route of the app's table, filled in once with a private repository, its
    organisation, a member, a team, a token id and an upload session that exist, and once
    with names that exist nowhere: an anonymous caller and a signed-in outsider are
    refused (never 2xx/3xx on a private resource), and get the same answer for both
    fillings, so no route tells an outsider which private names exist."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/secret"
    with hub.client(alice) as c:
        manifest, _ = artifact(c, repo, b"secret layer", tag="v1")
        upload = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"].rsplit("/", 1)[1]
        assert c.post(f"/api/v1/orgs/{org}/teams", json={"name": "t", "role": "pull"}).status_code
        token_id = c.post("/api/v1/tokens", json={"name": "t", "scopes": [f"{org}:pull"]}).json()[
            "id"
        ]
    existing = {
        "name": repo,
        "org": org,
        "namespace": org,
        "username": bob[0],
        "team": "t",
        "token_id": str(token_id),
        "path": repo,
        "manifest": manifest,
        "blob": sha(b"secret layer"),
        "upload": upload,
        "file_path": "x",
    }
    nowhere = {
        **existing,
        "name": f"{org}x/none",
        "org": f"{org}x",
        "namespace": f"{org}x",
        "username": f"{bob[0]}x",
        "team": "none",
        "token_id": "999999",
        "path": f"{org}x/none",
        "upload": "0" * 32,
    }
    routes = _route_table(hub)
    assert len(routes) > 40, routes  # the table was read, not an empty list
    outsider = hub.add_user(unique_name("outsider"))
    for who in (None, outsider):
        with hub.client(who) as c:
            seen = _answers(c, routes, existing)
            unseen = _answers(c, routes, nowhere)
        for route, (status, code) in seen.items():
            assert status >= 400 or code.startswith("/-/signin"), (who, route, status, code)
            assert (status, code) == unseen[route], (who, route, seen[route], unseen[route])


# -- 3. teams are memberships; bodies and lists are bounded -----------------------------
def _robot_of(hub: HubServer, org: str) -> str:
    """A robot that is a member of ``org`` only (its admins manage it)."""
    robot = unique_name("ci")
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/users", json={"name": robot, "robot": True}).status_code == 201
        r = c.put(f"/api/v1/orgs/{org}/members/{robot}", json={"role": "push"})
        assert r.status_code == 204, r.text
    return robot


def test_a_robot_joins_a_team_only_through_who_manages_it(hub: HubServer) -> None:
    """Direct membership refuses an organisation admin who names another
    organisation's robot; a team gave that robot a role just the same (a team member
    holds the team's role in the organisation). Now the team routes apply the member
    rule: 403, and the robot is in no team. The robot's own admins still may."""
    org, alice, _bob = org_with_pusher(hub)
    robot = _robot_of(hub, org)
    eve, evil = hub.add_user(unique_name("eve")), unique_name("evil")
    with hub.client(eve) as c:
        assert c.post("/api/v1/orgs", json={"name": evil}).status_code == 201
        r = c.post(f"/api/v1/orgs/{evil}/teams", json={"name": "t", "role": "admin"})
        assert r.status_code == 201, r.text
        r = c.put(f"/api/v1/orgs/{evil}/teams/t/members/{robot}")
        assert r.status_code == 403, r.text
        r = c.post(
            f"/api/v1/orgs/{evil}/teams", json={"name": "u", "role": "push", "members": [robot]}
        )
        assert r.status_code == 403, r.text
        teams = c.get(f"/api/v1/orgs/{evil}/teams").json()
        assert [t["name"] for t in teams] == ["t"] and teams[0]["members"] == []
    with hub.client(alice) as c:  # the robot's owner
        r = c.post(
            f"/api/v1/orgs/{org}/teams", json={"name": "ci", "role": "push", "members": [robot]}
        )
        assert r.status_code == 201, r.text


def test_a_team_change_checks_the_admin_again_when_it_writes(
    fresh_hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An organisation admin demoted after the route's check but before its write still
    added a member to an admin team (the write trusted the earlier check). The write
    transaction now asks again: 403, and the team is unchanged."""
    import anyio

    from forkd.hub import orgs_api

    hub = fresh_hub
    alice, carol = hub.add_user("alice"), hub.add_user("carol")
    hub.add_user("mallory")
    with hub.client(alice) as c:
        assert c.post("/api/v1/orgs", json={"name": "acme"}).status_code == 201
        assert c.put("/api/v1/orgs/acme/members/carol", json={"role": "admin"}).status_code == 204
        assert c.post("/api/v1/orgs/acme/teams", json={"name": "ops", "role": "admin"}).status_code
    real = orgs_api._require_principal

    async def then_demoted(hub_: Any, request: Any, namespace: str, role: str) -> Any:
        answer = await real(hub_, request, namespace, role)
        await anyio.to_thread.run_sync(lambda: hub.cli("org", "member", "acme", "carol", "pull"))
        return answer

    monkeypatch.setattr(orgs_api, "_require_principal", then_demoted)
    with hub.client(carol) as c:
        r = c.put("/api/v1/orgs/acme/teams/ops/members/mallory")
    assert r.status_code == 403, r.text
    monkeypatch.setattr(orgs_api, "_require_principal", real)
    with hub.client(alice) as c:
        assert c.get("/api/v1/orgs/acme/teams").json()[0]["members"] == []


def test_a_new_team_names_a_bounded_list_of_members(hub: HubServer) -> None:
    """``members`` was any length: one request naming an existing user a million times
    ran four statements per name in one write transaction, holding SQLite's single write
    lock for minutes (any signed-in user can create an organisation to do it in). Now
    at most 100 names, 400 beyond."""
    org, alice, bob = org_with_pusher(hub)
    with hub.client(alice) as c:
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "many", "role": "pull", "members": [bob[0]] * 101},
        )
        assert r.status_code == 400, r.text
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "some", "role": "pull", "members": [bob[0]] * 100},
        )
        assert r.status_code == 201, r.text
        assert r.json()["members"] == [bob[0]]


def _body_routes(hub: HubServer) -> list[tuple[str, str]]:
    """(method, path template) of the routes whose handler takes a body (``data``)."""
    import inspect

    assert hub._server is not None
    found = set()
    for route in hub._server.config.app.routes:
        for method, handler in getattr(route, "route_handler_map", {}).items():
            handler = handler[0] if isinstance(handler, tuple) else handler
            if "data" in inspect.signature(handler.fn).parameters:
                found.add((method, re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)))
    return sorted(found)


def test_api_bodies_are_bounded_on_every_route(hub: HubServer) -> None:
    """Every ``/api/v1`` route that takes a body read up to Litestar's default of 10 MB
    and decoded it (a token's scope list, a team's members) before any check. Each now
    refuses past 64 KiB (the README route past its own 512 KiB) with 413, whoever asks."""
    padding = "x" * (100 * 1024)
    big = {"name": padding, "role": padding, "scopes": [padding], "members": [padding]}
    names = {
        "name": "a/b",
        "org": "a",
        "namespace": "a",
        "username": "u",
        "team": "t",
        "token_id": "1",
    }
    checked = 0
    with hub.client(ADMIN) as c:
        for method, template in _body_routes(hub):
            if not template.startswith("/api/v1/"):
                continue
            body = big
            if template == "/api/v1/readme/{name}":
                body = {"readme": "x" * (600 * 1024)}
            r = c.request(method, template.format(**names), json=body)
            assert r.status_code == 413, (method, template, r.status_code, r.text[:200])
            checked += 1
    assert checked >= 7, checked


# -- 4. what one account may make is bounded, also when requests race ------------------
def test_tokens_per_user_are_bounded_also_when_racing(backend_hub: HubServer) -> None:
    """A user could mint API tokens without end (each a row read by their token pages and
    counted nowhere). Now at most 100 per user (409 beyond, saying to revoke some), and
    requests racing for the last places do not pass it together (the user's row is held
    while counting, on PostgreSQL too)."""
    from forkd.hub.accounts import MAX_TOKENS_PER_USER

    hub = backend_hub
    who = hub.add_user("minter")
    with hub.client(who) as c:
        for i in range(MAX_TOKENS_PER_USER - 2):
            r = c.post("/api/v1/tokens", json={"name": f"t{i}", "scopes": ["minter:pull"]})
            assert r.status_code == 201, r.text

    def mint(i: int) -> int:
        with hub.client(who) as c:
            r = c.post("/api/v1/tokens", json={"name": f"race{i}", "scopes": ["minter:pull"]})
            return r.status_code

    with ThreadPoolExecutor(6) as pool:
        answers = sorted(pool.map(mint, range(6)))
    assert answers == [201, 201, 409, 409, 409, 409], answers
    with hub.client(who) as c:
        assert len(c.get("/api/v1/tokens").json()) == MAX_TOKENS_PER_USER
        r = c.post("/api/v1/tokens", json={"name": "more", "scopes": ["minter:pull"]})
        assert r.status_code == 409 and "revoke some" in r.text, r.text


def test_organisations_per_creator_are_bounded_also_when_racing(backend_hub: HubServer) -> None:
    """Any signed-in user creates organisations: one account could add namespaces
    without end. Now a user may be the direct admin of at most 20 (409 beyond); racing
    creations do not pass it together. Site admins are not limited."""
    from forkd.hub.accounts import MAX_ORGS_PER_USER

    hub = backend_hub
    who = hub.add_user("founder")
    with hub.client(who) as c:
        for i in range(MAX_ORGS_PER_USER - 1):
            assert c.post("/api/v1/orgs", json={"name": f"founded{i}"}).status_code == 201

    def found(i: int) -> int:
        with hub.client(who) as c:
            return c.post("/api/v1/orgs", json={"name": f"race{i}"}).status_code

    with ThreadPoolExecutor(4) as pool:
        answers = sorted(pool.map(found, range(4)))
    assert answers == [201, 409, 409, 409], answers
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/orgs", json={"name": "siteadmins-own"}).status_code == 201


# -- 5. one document, one reading ----------------------------------------------------
@pytest.mark.parametrize("twice", ["mediaType", "layers", "subject"])
def test_a_manifest_naming_a_key_twice_is_refused(hub: HubServer, twice: str) -> None:
    """JSON leaves a repeated key to each parser: Python and Go keep the last, others
    the first. The hub checked the last ``mediaType`` (an image manifest, as the
    Content-Type said), ``layers`` (blobs the repository holds) or ``subject``, while a
    first-key parser read an index, other layers or another subject. Refused: 400
    MANIFEST_INVALID, nothing recorded."""
    who = hub.add_user(unique_name("dup"))
    repo = f"{who[0]}/app"
    with hub.client(who) as c:
        _, body = artifact(c, repo, b"the checked layer")
        doc = json.loads(body)
        first = {
            "mediaType": '"application/vnd.oci.image.index.v1+json"',
            "layers": json.dumps([{**doc["layers"][0], "digest": sha(b"another")}]),
            "subject": json.dumps({**doc["config"], "digest": sha(b"a subject")}),
        }[twice]
        text = body.decode()
        hostile = text[:1] + f'"{twice}": {first}, ' + text[1:]
        if twice == "subject":
            hostile = hostile[:-1] + f', "subject": {json.dumps(doc["config"])}' + "}"
        r = c.put(
            f"/v2/{repo}/manifests/dup",
            content=hostile.encode(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert r.status_code == 400, r.text
        assert error_code(r) == "MANIFEST_INVALID"
        assert "appears twice" in r.text
        assert c.get(f"/v2/{repo}/manifests/dup").status_code == 404


def test_documents_from_peers_are_json_without_nan() -> None:
    """Python's parser reads ``NaN`` and ``Infinity`` as floats; they are not JSON, and a
    size or an offset of NaN compares false with every bound. Every document forkd
    reads from a peer (``forkd.jsondoc.loads``) refuses them."""
    from forkd import jsondoc
    from forkd.errors import InvalidInput

    for text in ('{"size": NaN}', '{"size": Infinity}', "[-Infinity]"):
        with pytest.raises(InvalidInput, match="not a JSON number"):
            jsondoc.loads(text, "a document")
    assert jsondoc.loads('{"size": 1.5, "n": [1, {"a": null}]}', "a document")["size"] == 1.5


# -- 6. repositories per namespace ---------------------------------------------------
@pytest.fixture(params=["sqlite", "postgresql"])
def few_repositories_hub(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[HubServer]:
    overrides: dict[str, Any] = {"repositories_max": 3}
    if request.param == "postgresql":
        overrides["database_url"] = request.getfixturevalue("postgres_url")
    server = HubServer(tmp_path / "hub", overrides).start()
    try:
        yield server
    finally:
        server.stop()


def test_repositories_per_namespace_are_bounded_also_when_racing(
    few_repositories_hub: HubServer,
) -> None:
    """Starting an upload to a new name creates the repository, and it stays however the
    upload ends (cancelled, refused by a session limit): a push member could add
    repositories without end, each a row every listing filters. Now a namespace holds
    at most ``repositories_max``; a new name past it is 403 DENIED and creates nothing,
    racing creations included, while existing repositories take pushes as before."""
    hub = few_repositories_hub
    who = hub.add_user("many")
    with hub.client(who) as c:
        r = c.post("/v2/many/r0/blobs/uploads/")
        assert r.status_code == 202, r.text
        assert c.delete(r.headers["Location"]).status_code == 204  # the repository stays

        def start(i: int) -> int:
            with hub.client(who) as c2:
                return c2.post(f"/v2/many/race{i}/blobs/uploads/").status_code

        with ThreadPoolExecutor(4) as pool:
            answers = sorted(pool.map(start, range(4)))
        assert answers == [202, 202, 403, 403], answers
        r = c.post("/v2/many/late/blobs/uploads/", params={"digest": sha(b"x")}, content=b"x")
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
        assert "repositories_max" in r.text
        names = c.get("/v2/_catalog").json()["repositories"]
        assert len(names) == 3 and "many/late" not in names, names
        artifact(c, "many/r0", b"still pushes")  # an existing repository takes pushes
