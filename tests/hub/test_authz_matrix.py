"""One authorization model (issue 10, items 3 and 4): principals × repositories × actions,
and every surface (OCI routes, /token, the hub API, `_catalog`, the catalog UI) agrees
with the same table. Plus: a UI session opened with a pull-only token manages nothing,
and nobody adopts another organisation's robot."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from hub_support import ADMIN, TIMEOUT, HubServer, artifact

SIGNIN = "/-/signin"
REPOS = ("acme/app-one", "acme/secret", "acme/open", "bobco/tool")
PUBLIC = {"acme/open"}
ALL = frozenset({"pull", "push", "delete"})
PUSH = frozenset({"pull", "push"})
PULL = frozenset({"pull"})
NONE: frozenset[str] = frozenset()


def _acme(actions: frozenset[str]) -> dict[str, frozenset[str]]:
    return {r: actions for r in REPOS if r.startswith("acme/")}


# principal → repository → actions held (public pull added below), and whether the
# principal administers acme as a whole.
EXPECTED: dict[str, tuple[dict[str, frozenset[str]], bool]] = {
    "anonymous": ({}, False),
    "admin": ({r: ALL for r in REPOS}, True),
    "admin-acme-pull-token": (_acme(PULL), False),
    "alice": (_acme(ALL), True),
    "alice-pull-token": (_acme(PULL), False),
    "bob": (_acme(PULL), False),
    "carol": ({"acme/app-one": PUSH}, False),
    "carol-any-pull-token": ({"acme/app-one": PULL}, False),
    "dave": ({}, False),
    "ci-robot": (_acme(PUSH), False),
    "erin": ({"bobco/tool": ALL}, False),
    "tina": (_acme(ALL), True),  # admin through a team without a glob
}


def expected(principal: str, repo: str) -> frozenset[str]:
    held = EXPECTED[principal][0].get(repo, NONE)
    return held | PULL if repo in PUBLIC else held


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, dict]]:
    hub = HubServer(tmp_path_factory.mktemp("authz") / "hub").start()
    try:
        creds: dict[str, tuple[str, str] | None] = {"anonymous": None, "admin": ADMIN}
        for name in ("alice", "bob", "carol", "dave", "erin", "tina"):
            creds[name] = hub.add_user(name)
        hub.cli("org", "add", "acme", "--member", "alice=admin", "--member", "bob=pull")
        hub.cli("org", "add", "bobco", "--member", "erin=admin")
        hub.cli(
            "team", "add", "acme", "apps", "--role", "push",
            "--repositories", "acme/app-*", "--member", "carol",
        )  # fmt: skip
        hub.cli("team", "add", "acme", "owners", "--role", "admin", "--member", "tina")
        hub.cli("user", "add", "ci-robot", "--robot")
        hub.cli("org", "member", "acme", "ci-robot", "push")
        creds["ci-robot"] = ("ci-robot", hub.token("ci-robot", "acme:push"))
        creds["admin-acme-pull-token"] = ("admin", hub.token("admin", "acme:pull"))
        creds["alice-pull-token"] = ("alice", hub.token("alice", "acme:pull"))
        creds["carol-any-pull-token"] = ("carol", hub.token("carol", "*:pull"))
        digests = {}
        with hub.client(ADMIN) as c:
            for repo in REPOS:
                digests[repo] = artifact(c, repo, f"layer of {repo}".encode(), tag="v1")[0]
        hub.public("acme/open")
        yield hub, creds
    finally:
        hub.stop()


def _client(hub: HubServer, who: tuple[str, str] | None) -> httpx.Client:
    return hub.client(who)


def _oci_actions(hub: HubServer, who: tuple[str, str] | None, repo: str) -> frozenset[str]:
    held: set[str] = set()
    with _client(hub, who) as c:
        if c.get(f"/v2/{repo}/manifests/v1").status_code == 200:
            held.add("pull")
        if c.post(f"/v2/{repo}/blobs/uploads/").status_code == 202:
            held.add("push")
        # An allowed DELETE reaches the lookup: MANIFEST_UNKNOWN for a digest never pushed.
        r = c.delete(f"/v2/{repo}/manifests/sha256:{'0' * 64}")
        if r.status_code == 404 and r.json()["errors"][0]["code"] == "MANIFEST_UNKNOWN":
            held.add("delete")
    return frozenset(held)


def _token_actions(hub: HubServer, who: tuple[str, str] | None, repo: str) -> frozenset[str]:
    with _client(hub, who) as c:
        r = c.get("/token", params={"scope": f"repository:{repo}:pull,push,delete"})
    assert r.status_code == 200, r.text
    body = r.json()["token"].removeprefix("fkb.").split(".")[0]
    payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    granted = {a["name"]: frozenset(a["actions"]) for a in payload["access"]}
    return granted.get(repo, NONE)


def _api_visible(hub: HubServer, who: tuple[str, str] | None) -> set[str]:
    with _client(hub, who) as c:
        listed = c.get("/api/v1/repositories", params={"per_page": 100})
        assert listed.status_code == 200, listed.text
        names = {item["name"] for item in listed.json()["items"]}
        for repo in REPOS:
            detail = c.get(f"/api/v1/repositories/{repo}").status_code
            assert (detail == 200) == (repo in names), (repo, detail)
    return names


def _catalog(hub: HubServer, who: tuple[str, str] | None) -> set[str]:
    if who is None:
        return set(PUBLIC)  # anonymous: the catalog asks for credentials (checked below)
    with _client(hub, who) as c:
        r = c.get("/v2/_catalog")
    assert r.status_code == 200, r.text
    return set(r.json()["repositories"])


@contextmanager
def _browser(hub: HubServer, who: tuple[str, str] | None) -> Iterator[httpx.Client]:
    """A browser signed in to the UI as ``who`` (a password or an API token)."""
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as c:
        if who is not None:
            page = c.get(SIGNIN).text
            found = re.search(r'name="login_csrf" value="([^"]*)"', page)
            assert found
            data = {"login_csrf": found.group(1), "username": who[0], "password": who[1]}
            assert c.post(SIGNIN, data=data).status_code == 303
        yield c


def _csrf(c: httpx.Client) -> str:
    found = re.search(r'name="csrf" value="([^"]*)"', c.get("/").text)
    return found.group(1) if found else ""


def _ui_pull(c: httpx.Client, repo: str) -> bool:
    status = c.get(f"/{repo}").status_code
    assert status in (200, 404), status
    return status == 200


def _ui_administers(c: httpx.Client, namespace: str) -> bool:
    """The member form of ``namespace``: an admin reaches the user lookup (404 no such
    user); anyone else is refused (403)."""
    r = c.post(
        f"/-/members/{namespace}",
        data={"csrf": _csrf(c), "username": "nobody-at-all", "role": "pull"},
    )
    assert r.status_code in (403, 404), r.status_code
    return r.status_code == 404


def _api_administers(hub: HubServer, who: tuple[str, str] | None, namespace: str) -> bool:
    with _client(hub, who) as c:
        r = c.put(f"/api/v1/orgs/{namespace}/members/nobody-at-all", json={"role": "pull"})
    assert r.status_code in (400, 401, 403), (r.status_code, r.text)
    return r.status_code == 400


@pytest.mark.parametrize("principal", sorted(EXPECTED))
def test_every_surface_agrees(world: tuple[HubServer, dict], principal: str) -> None:
    hub, creds = world
    who = creds[principal]
    want = {repo: expected(principal, repo) for repo in REPOS}
    pullable = {repo for repo, actions in want.items() if "pull" in actions}
    assert {repo: _oci_actions(hub, who, repo) for repo in REPOS} == want
    assert {repo: _token_actions(hub, who, repo) for repo in REPOS} == want
    assert _api_visible(hub, who) & set(REPOS) == pullable
    assert _catalog(hub, who) & set(REPOS) == pullable
    administers = EXPECTED[principal][1]
    assert _api_administers(hub, who, "acme") == administers
    if principal in ("ci-robot",):
        return  # robots have no password to sign in to the UI with; tokens do
    with _browser(hub, who) as browser:
        assert {repo for repo in REPOS if _ui_pull(browser, repo)} == pullable
        if who is not None:
            assert _ui_administers(browser, "acme") == administers


def test_anonymous_catalog_asks_for_credentials(world: tuple[HubServer, dict]) -> None:
    hub, _ = world
    with hub.client() as c:
        assert c.get("/v2/_catalog").status_code == 401


def test_a_pull_only_token_session_cannot_revoke_robot_tokens(
    world: tuple[HubServer, dict],
) -> None:
    """The review's case: alice signs in to the UI with her acme:pull token; the robot
    of acme she administers with her password is not hers to manage through it."""
    hub, creds = world
    with _browser(hub, creds["alice-pull-token"]) as c:
        page = c.get("/-/settings/tokens").text
        assert "robot-tokens-ci-robot" not in page
        ids = [int(i) for i in re.findall(r"/-/settings/tokens/(\d+)/revoke", page)]
        robot_token = _robot_token_id(hub)
        assert robot_token not in ids
        r = c.post(f"/-/settings/tokens/{robot_token}/revoke", data={"csrf": _csrf(c)})
        assert r.status_code == 403  # a token's session manages no tokens at all
    with hub.client(creds["ci-robot"]) as c:
        assert c.get("/v2/acme/secret/manifests/v1").status_code == 200
    with _browser(hub, creds["alice"]) as c:  # with her password she does manage it
        assert "robot-tokens-ci-robot" in c.get("/-/settings/tokens").text


def _robot_token_id(hub: HubServer) -> int:
    out = hub.cli("token", "list", "--user", "ci-robot")
    found = re.search(r"^(\d+)\s", out, re.M)
    assert found, out
    return int(found.group(1))


def test_nobody_adopts_another_organisations_robot(world: tuple[HubServer, dict]) -> None:
    hub, creds = world
    with _browser(hub, creds["erin"]) as c:
        r = c.post(
            "/-/settings/robots",
            data={"csrf": _csrf(c), "namespace": "bobco", "robot": "ci-robot", "role": "push"},
        )
        assert r.status_code == 400 and "do not administer" in r.text
        page = c.get("/-/settings/tokens").text
        assert "robot-tokens-ci-robot" not in page
        robot_token = _robot_token_id(hub)
        r = c.post(f"/-/settings/tokens/{robot_token}/revoke", data={"csrf": _csrf(c)})
        assert r.status_code == 404
    with hub.client(creds["erin"]) as api:
        members = api.get("/api/v1/orgs/bobco/members").json()
    assert "ci-robot" not in {m["user"] for m in members}
    with hub.client(creds["ci-robot"]) as c:
        assert c.get("/v2/acme/secret/manifests/v1").status_code == 200
    # acme's own admin still mints tokens for it.
    with _browser(hub, creds["alice"]) as c:
        r = c.post(
            "/-/settings/robots",
            data={"csrf": _csrf(c), "namespace": "acme", "robot": "ci-robot", "role": "pull"},
        )
        assert r.status_code == 303, r.text

