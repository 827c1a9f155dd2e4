"""Hostile review 25: one rule where there were two.

1. Searches and name filters gave one answer on SQLite and another on PostgreSQL: SQL
   ``LIKE`` ignores the case of A-Z on SQLite and not on PostgreSQL, and the search
   (``/api/v1/repositories?q=``, the UI's ``/-/search`` over names and descriptions) and
   the namespace filters (``?namespace=``) were plain ``LIKE``s. The UI's search for
   ``debian`` found the pack described "Debian Base Image" on SQLite and nothing on
   PostgreSQL; the API's ``q=ACME`` and ``namespace=ACME`` listed ``acme``'s
   repositories on SQLite only. Now LIKE is case-sensitive on both
   (SQLite's connections set ``case_sensitive_like``: every LIKE, present or future), and
   a search that ignores case says so (``db.contains_folded``: A-Z as a-z, other letters
   as they are, on both backends).
2. Names: users, robots and namespaces share one pool (a user's name is its namespace's),
   but each path that made one checked its own subset of the rules. The UI's robot form,
   open to any organisation's admin, i.e. any signed-in user (20 organisations x 100
   robots), took any free user name, the names of people the operator had yet to create
   among them: ``forkd hub user add carol`` was then refused for good (409). An
   organisation could take the name of an operator's robot (a robot has no namespace to
   collide with), the operator's robots took reserved names (``api``), and a site admin's
   push made a namespace of a robot's name. Now every path (``POST /api/v1/users``,
   ``/api/v1/orgs``, the robot form, ``forkd hub user add``/``org create``, a push that
   creates a namespace) claims its name through ``accounts.claim_name``: a name is free
   only when no account and no namespace has it, and a robot an organisation's admin
   makes is named ``ORG+NAME`` (typing ``ci`` in ``acme`` makes ``acme+ci``): ``+`` is in
   no person's or namespace's name, so such robots take no name from the pool. A test
   reads the hub's source: only functions that call ``claim_name`` construct a ``User``
   or a ``Namespace`` row.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_support import ADMIN, HubServer, artifact, browser, csrf_of, org_with_pusher, unique_name


def _search_ui(c: httpx.Client, q: str) -> set[str]:
    """The pack names the UI's search page lists for ``q``."""
    r = c.get("/-/search", params={"q": q})
    assert r.status_code == 200, r.text
    return set(re.findall(r'href="/([a-z0-9._-]+/[a-z0-9._/-]+)"', r.text))


def test_search_ignores_the_case_of_a_to_z_on_both_backends(backend_hub: HubServer) -> None:
    """Before: on SQLite the UI's search for ``debian`` found a pack described "Debian
    Base Image", and the API's ``q=ACME`` and ``namespace=ACME`` listed acme's packs; on
    PostgreSQL none did. Now the searches ignore the case of A-Z on both backends (names
    and descriptions); the namespace filter is the exact name on both."""
    hub = backend_hub
    org = unique_name("acme")
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        artifact(c, f"{org}/base", b"layer", tag="v1")
        artifact(c, f"{org}/cafe", b"layer 2", tag="v1")
        r = c.put(f"/api/v1/readme/{org}/base", json={"description": "Debian Base Image"})
        assert r.status_code == 200, r.text
        r = c.put(f"/api/v1/readme/{org}/cafe", json={"description": "Le CAFÉ"})
        assert r.status_code == 200, r.text

        def api(**params: str) -> set[str]:
            r = c.get("/api/v1/repositories", params=params)
            assert r.status_code == 200, r.text
            return {item["name"] for item in r.json()["items"]}

        assert api(q=org.upper()) == {f"{org}/base", f"{org}/cafe"}
        assert api(q="BASE") >= {f"{org}/base"}
        assert api(namespace=org) == {f"{org}/base", f"{org}/cafe"}
        assert api(namespace=org.upper()) == set()  # a namespace is its exact name
    with browser(hub, *ADMIN) as b:
        assert f"{org}/base" in _search_ui(b, "debian")
        assert f"{org}/base" in _search_ui(b, "DEBIAN BASE")
        assert f"{org}/cafe" in _search_ui(b, "le caf")


def _robot_form(hub: HubServer, admin: tuple[str, str], org: str, robot: str) -> httpx.Response:
    """The UI's robot form of ``admin``: a push token for ``robot`` in ``org``."""
    with browser(hub, *admin) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        data = {"csrf": csrf, "namespace": org, "robot": robot, "role": "push"}
        return b.post("/-/settings/robots", data=data, follow_redirects=True)


def test_a_robot_made_in_the_ui_takes_no_name_a_person_could_have(hub: HubServer) -> None:
    """Before: any user's organisation made a robot ``carol`` in the robot form, and the
    operator's ``forkd hub user add carol`` was refused (the name was taken). Now the
    robot is ``ORG+carol``: the operator still makes the user carol, and the robot
    signs in to the registry with its name and token (Basic, and the token endpoint)."""
    org, alice, _ = org_with_pusher(hub)
    person = unique_name("carol")
    r = _robot_form(hub, alice, org, person)
    assert r.status_code == 200, r.text
    robot = f"{org}+{person}"
    assert robot in r.text  # the page names the robot the token is for
    secret = re.search(r"fkd_[A-Za-z0-9_-]{30,}", r.text)
    assert secret, r.text
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json={"name": person, "password": "carol-password-1"})
        assert r.status_code == 201, r.text
        names = {u["name"]: u["robot"] for u in c.get("/api/v1/users").json()}
        assert names[person] is False and names[robot] is True
        members = c.get(f"/api/v1/orgs/{org}/members").json()
        assert {"user": robot, "role": "push", "robot": True} in members
    with hub.client((robot, secret.group(0))) as c:  # docker login -u ORG+NAME
        artifact(c, f"{org}/app", b"robot layer", tag="by-robot")
        r = c.get("/token", params={"service": "forkd-hub", "scope": f"repository:{org}/app:push"})
        assert r.status_code == 200, r.text
    # The short name again: the same robot, a new token (no second account).
    r = _robot_form(hub, alice, org, person)
    assert r.status_code == 200 and robot in r.text, r.text
    # Its full name works in the form too, and in the member form.
    assert _robot_form(hub, alice, org, robot).status_code == 200
    with browser(hub, *alice) as b:
        page = b.get(f"/{org}")
        data = {"csrf": csrf_of(page.text), "username": robot, "role": "pull"}
        r = b.post(f"/-/members/{org}", data=data)
        assert r.status_code == 303, r.text
    with hub.client(alice) as c:  # and in the API's member routes (a "+" in the path)
        r = c.put(f"/api/v1/orgs/{org}/members/{robot}", json={"role": "push"})
        assert r.status_code == 204, r.text
        team = {"name": "bots", "role": "pull", "members": [robot]}
        assert c.post(f"/api/v1/orgs/{org}/teams", json=team).status_code == 201


def test_a_robot_named_after_another_namespace_is_refused(hub: HubServer) -> None:
    """A robot form's full name must be named after the organisation it is made for: an
    admin of one organisation makes no ``other+NAME`` (400, saying how robots are named),
    nor a name past 64 characters."""
    org, alice, _ = org_with_pusher(hub)
    other, _, _ = org_with_pusher(hub)
    r = _robot_form(hub, alice, org, f"{other}+ci")
    assert r.status_code == 400 and f"{org}+NAME" in r.text, r.text
    r = _robot_form(hub, alice, org, "x" * 64)
    assert r.status_code == 400 and "64" in r.text, r.text
    with hub.client(ADMIN) as c:
        assert f"{other}+ci" not in {u["name"] for u in c.get("/api/v1/users").json()}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_every_path_claims_a_name_by_one_rule(
    request: pytest.FixtureRequest, backend: str, tmp_path: Path
) -> None:
    """Before: an organisation took an operator's robot's name (201), the operator's robot
    took a reserved name (``api``: 201), and a site admin's push made the namespace of a
    robot's name. Now each is refused as a user of that name would be (409 or 400 on the
    API, DENIED on the registry, a failed ``forkd hub`` command), on both backends."""
    settings: dict[str, Any] = {}
    if backend == "postgresql":
        settings["database_url"] = request.getfixturevalue("postgres_url")
    hub = HubServer(tmp_path / "hub", settings).start()
    try:
        alice = hub.add_user("alice")
        with hub.client(ADMIN) as c:
            r = c.post("/api/v1/users", json={"name": "deploybot", "robot": True})
            assert r.status_code == 201, r.text
            r = c.post("/api/v1/users", json={"name": "api", "robot": True})
            assert r.status_code == 400 and "reserved" in r.text, r.text
            # An operator's robot named after a namespace that exists: allowed, and not
            # twice; after one that does not: refused.
            r = c.post("/api/v1/users", json={"name": "alice+ci", "robot": True})
            assert r.status_code == 201, r.text
            r = c.post("/api/v1/users", json={"name": "alice+ci", "robot": True})
            assert r.status_code == 409, r.text
            r = c.post("/api/v1/users", json={"name": "nobody+ci", "robot": True})
            assert r.status_code == 400 and "create it first" in r.text, r.text
            # No person or organisation takes a robot's form.
            r = c.post("/api/v1/users", json={"name": "alice+ci2", "password": "password-12"})
            assert r.status_code == 400, r.text
            # A site admin's push into a new namespace of a robot's name.
            r = c.post("/v2/deploybot/app/blobs/uploads/", params={"digest": "sha256:" + "0" * 64})
            assert r.status_code == 403, r.text
            assert "deploybot" in r.text and "robot" in r.text, r.text
        with hub.client(alice) as c:
            r = c.post("/api/v1/orgs", json={"name": "deploybot"})
            assert r.status_code == 409 and "robot" in r.text, r.text
            r = c.post("/api/v1/orgs", json={"name": "alice+x"})
            assert r.status_code == 400, r.text
        with pytest.raises(AssertionError, match="robot 'deploybot' already exists"):
            hub.cli("org", "add", "deploybot")
        with pytest.raises(AssertionError, match="robot 'deploybot' already exists"):
            hub.add_user("deploybot")
        hub.cli("user", "add", "ci-bot", "--robot")  # the operator's plain names still work
    finally:
        hub.stop()


def test_every_account_and_namespace_row_is_made_after_claim_name() -> None:
    """The class, not the cases: the only places that construct a ``User`` or a
    ``Namespace`` row are the functions of hub/accounts.py that claim the name first
    (``claim_name``). A new path that makes one without it fails here."""
    import ast

    root = Path(__file__).resolve().parents[2]
    makers: set[tuple[str, str]] = set()
    for path in [*(root / "hub").rglob("*.py"), *(root / "cli").rglob("*.py")]:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            made = {
                c.func.id
                for c in calls
                if isinstance(c.func, ast.Name) and c.func.id in ("User", "Namespace")
            }
            if not made:
                continue
            makers.add((path.relative_to(root).as_posix(), fn.name))
            claims = any(
                isinstance(c.func, ast.Name | ast.Attribute)
                and (c.func.id if isinstance(c.func, ast.Name) else c.func.attr) == "claim_name"
                for c in calls
            )
            assert claims, f"{path.name}:{fn.name} makes a {made} row without claim_name"
    assert makers == {
        ("hub/accounts.py", "create_user"),
        ("hub/accounts.py", "create_org"),
        ("hub/accounts.py", "create_repository"),
    }, makers
