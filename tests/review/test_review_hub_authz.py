"""Hostile review of the hub, round 2: authorization disagreements between surfaces.

Each test states what the security model (docs/hub.md, "Security model") promises and is
marked xfail(strict) while the hub breaks it: when a fix lands, the test passes and the
strict marker turns the suite red until the marker is removed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from hub_server import ADMIN, TIMEOUT, HubServer

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
SIGNIN = "/-/signin"


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _push(client: httpx.Client, repo: str, payload: bytes, tag: str) -> None:
    """A one-layer OCI artifact tagged ``tag`` in ``repo``."""
    for data in (b"{}", payload):
        r = client.post(f"/v2/{repo}/blobs/uploads/", params={"digest": _sha(data)}, content=data)
        assert r.status_code == 201, r.text
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": _sha(b"{}"),
            "size": 2,
        },
        "layers": [
            {"mediaType": "application/octet-stream", "digest": _sha(payload), "size": len(payload)}
        ],
    }
    r = client.put(
        f"/v2/{repo}/manifests/{tag}",
        content=json.dumps(manifest).encode(),
        headers={"Content-Type": OCI_MANIFEST},
    )
    assert r.status_code == 201, r.text


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[HubServer, dict]]:
    """alice administers acme (repos acme/app, acme/secret) and owns alice/app; erin
    administers bobco; ci-robot is acme's robot."""
    hub = HubServer(Path(tmp_path_factory.mktemp("review-authz")) / "hub").start()
    try:
        creds = {name: hub.add_user(name) for name in ("alice", "erin")}
        hub.cli("org", "add", "acme", "--member", "alice=admin")
        hub.cli("org", "add", "bobco", "--member", "erin=admin")
        hub.cli("user", "add", "ci-robot", "--robot")
        hub.cli("org", "member", "acme", "ci-robot", "push")
        creds["ci-robot"] = ("ci-robot", hub.token("ci-robot", "acme:push"))
        with hub.client(creds["alice"]) as c:
            for repo in ("acme/app", "acme/secret", "alice/app"):
                _push(c, repo, f"layer of {repo}".encode(), "v1")
        yield hub, creds
    finally:
        hub.stop()


def _bearer(hub: HubServer, who: tuple[str, str], scope: str) -> dict[str, str]:
    with hub.client(who) as c:
        r = c.get("/token", params={"scope": scope})
    assert r.status_code == 200, r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


@contextmanager
def _browser(hub: HubServer, who: tuple[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as c:
        found = re.search(r'name="login_csrf" value="([^"]*)"', c.get(SIGNIN).text)
        assert found
        data = {"login_csrf": found.group(1), "username": who[0], "password": who[1]}
        assert c.post(SIGNIN, data=data).status_code == 303
        yield c


def _csrf(c: httpx.Client) -> str:
    found = re.search(r'name="csrf" value="([^"]*)"', c.get("/").text)
    assert found
    return found.group(1)


# -- a bearer token's access list is honoured on /v2/<name>/ only ---------------------
def test_a_bearer_lists_only_what_it_may_pull(world: tuple[HubServer, dict]) -> None:
    """A bearer from /token for `acme/app:pull` cannot pull acme/secret (403 on the OCI
    route), so no listing may show acme/secret or its tags to it ("listings show exactly
    the repositories the caller may pull")."""
    hub, creds = world
    bearer = _bearer(hub, creds["alice"], "repository:acme/app:pull")
    with hub.client() as c:
        assert c.get("/v2/acme/secret/manifests/v1", headers=bearer).status_code == 403
        catalog = c.get("/v2/_catalog", headers=bearer).json()["repositories"]
        listed = c.get("/api/v1/repositories", headers=bearer).json()["items"]
        detail = c.get("/api/v1/repositories/acme/secret", headers=bearer).status_code
        lineage = c.get("/api/v1/lineage/acme/secret", params={"tag": "v1"}, headers=bearer)
    assert "acme/secret" not in catalog
    assert "acme/secret" not in {item["name"] for item in listed}
    assert detail == 404
    assert lineage.status_code == 404


def test_a_pull_bearer_cannot_mint_an_admin_token(world: tuple[HubServer, dict]) -> None:
    """A bearer is a 300 s registry credential handed to registry clients for the scopes
    they asked; one asked for `alice/app:pull` must not become a permanent `acme:admin`
    API token (nor create organisations, nor manage members)."""
    hub, creds = world
    bearer = _bearer(hub, creds["alice"], "repository:alice/app:pull")
    with hub.client() as c:
        minted = c.post(
            "/api/v1/tokens", headers=bearer, json={"name": "x", "scopes": ["acme:admin"]}
        )
        org = c.post("/api/v1/orgs", headers=bearer, json={"name": "from-a-bearer"})
        member = c.put("/api/v1/orgs/acme/members/erin", headers=bearer, json={"role": "admin"})
    assert minted.status_code in (401, 403), minted.text
    assert org.status_code in (401, 403), org.text
    assert member.status_code in (401, 403), member.text


# -- membership of someone else's robot -----------------------------------------------
def test_nobody_takes_a_robot_away_from_its_owners(world: tuple[HubServer, dict]) -> None:
    """erin (bobco admin) must not be able to make acme's robot a member of bobco: once
    she can, acme's admin can no longer see, mint or revoke its tokens (a leaked CI token
    then stays valid until a site admin steps in)."""
    hub, creds = world
    with hub.client(creds["erin"]) as c:
        r = c.put("/api/v1/orgs/bobco/members/ci-robot", json={"role": "pull"})
    try:
        assert r.status_code in (400, 403, 409), r.status_code
    finally:
        with _browser(hub, creds["alice"]) as b:
            minted = b.post(
                "/-/settings/robots",
                data={"csrf": _csrf(b), "namespace": "acme", "robot": "ci-robot", "role": "pull"},
            )
        if r.status_code == 204:  # leave the world as it was
            hub.cli("org", "member", "bobco", "ci-robot", "remove")
    assert minted.status_code == 303, minted.text


def test_the_ui_keeps_an_admin_like_the_api(tmp_path: Path) -> None:
    """The API refuses (409) to leave an organisation without a direct admin; the UI's
    member form must refuse the same change."""
    hub = HubServer(tmp_path / "hub").start()
    try:
        alice = hub.add_user("alice")
        hub.cli("org", "add", "solo", "--member", "alice=admin")
        with hub.client(alice) as c:
            assert (
                c.put("/api/v1/orgs/solo/members/alice", json={"role": "pull"}).status_code == 409
            )
        with _browser(hub, alice) as b:
            r = b.post(
                "/-/members/solo", data={"csrf": _csrf(b), "username": "alice", "role": "pull"}
            )
        with hub.client(ADMIN) as c:
            members = {m["user"]: m["role"] for m in c.get("/api/v1/orgs/solo/members").json()}
        assert members.get("alice") == "admin", (r.status_code, members)
    finally:
        hub.stop()
