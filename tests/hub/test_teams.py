"""Teams: an organisation's members grouped with one role on its repositories (or a glob
of them); effective role = max(direct membership, teams); /api/v1 management by org admins."""

from __future__ import annotations

import os
import time

import pytest
from hub_support import ADMIN, HubServer, artifact, error_code


def _names(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10_000_000}"


@pytest.fixture
def org(hub: HubServer) -> dict[str, tuple[str, str]]:
    """An organisation with an admin, a pull member and two outsiders."""
    name = _names("org")
    people = {role: hub.add_user(_names(role)) for role in ("boss", "reader", "dev", "other")}
    hub.cli(
        "org", "add", name,
        "--member", f"{people['boss'][0]}=admin",
        "--member", f"{people['reader'][0]}=pull",
    )  # fmt: skip
    people["org"] = (name, "")
    return people


def _push_status(hub: HubServer, auth: tuple[str, str], repo: str) -> int:
    with hub.client(auth) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": "sha256:" + "0" * 64})
        return r.status_code


def test_team_grants_role_and_max_with_membership(
    hub: HubServer, org: dict[str, tuple[str, str]]
) -> None:
    name = org["org"][0]
    boss, reader, dev, other = org["boss"], org["reader"], org["dev"], org["other"]
    with hub.client(ADMIN) as c:
        artifact(c, f"{name}/app", b"seed", tag="v1")
    # Before any team: dev cannot see the repository, reader cannot push.
    with hub.client(dev) as c:
        assert c.get(f"/v2/{name}/app/manifests/v1").status_code == 404
    with hub.client(reader) as c:
        r = c.post(f"/v2/{name}/app/blobs/uploads/")
        assert r.status_code == 403 and error_code(r) == "DENIED"

    with hub.client(boss) as c:
        r = c.post(
            f"/api/v1/orgs/{name}/teams",
            json={"name": "builders", "role": "push", "members": [dev[0], reader[0]]},
        )
        assert r.status_code == 201, r.text
        assert r.json()["members"] == sorted([dev[0], reader[0]])
        assert r.json()["repositories"] == ""
    # dev pushes through the team; reader's effective role is max(pull, push) = push.
    for who in (dev, reader):
        with hub.client(who) as c:
            artifact(c, f"{name}/app", os.urandom(64), tag=f"by-{who[0]}")
            # push, not admin: no delete
            assert c.delete(f"/v2/{name}/app/manifests/v1").status_code == 403
    # The catalog shows the team's repositories.
    with hub.client(dev) as c:
        listed = c.get("/api/v1/repositories", params={"namespace": name}).json()["items"]
        assert [i["name"] for i in listed] == [f"{name}/app"]
    # The bearer-token flow grants team rights too.
    with hub.client(dev) as c:
        r = c.get("/token", params={"scope": f"repository:{name}/app:pull,push"})
        token = r.json()["token"]
    with hub.client() as c:
        r = c.post(f"/v2/{name}/app/blobs/uploads/", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 202, r.text

    # Listing: members see teams and members; outsiders get 403.
    with hub.client(reader) as c:
        teams = c.get(f"/api/v1/orgs/{name}/teams").json()
        assert [(t["name"], t["role"]) for t in teams] == [("builders", "push")]
        members = c.get(f"/api/v1/orgs/{name}/members").json()
        assert {(m["user"], m["role"]) for m in members} == {
            (boss[0], "admin"),
            (reader[0], "pull"),
        }
    with hub.client(other) as c:
        assert c.get(f"/api/v1/orgs/{name}/members").status_code == 403

    # Removing dev from the team takes the rights away at once.
    with hub.client(boss) as c:
        r = c.delete(f"/api/v1/orgs/{name}/teams/builders/members/{dev[0]}")
        assert r.status_code == 204, r.text
    with hub.client(dev) as c:
        assert c.get(f"/v2/{name}/app/manifests/v1").status_code == 404
    # Deleting the team drops reader back to pull.
    with hub.client(boss) as c:
        assert c.delete(f"/api/v1/orgs/{name}/teams/builders").status_code == 204
        assert c.get(f"/api/v1/orgs/{name}/teams").json() == []
    with hub.client(reader) as c:
        assert c.post(f"/v2/{name}/app/blobs/uploads/").status_code == 403


def test_team_restricted_to_repository_glob(
    hub: HubServer, org: dict[str, tuple[str, str]]
) -> None:
    name, boss, dev = org["org"][0], org["boss"], org["dev"]
    with hub.client(ADMIN) as c:
        artifact(c, f"{name}/app-web", b"w", tag="v1")
        artifact(c, f"{name}/secret", b"s", tag="v1")
    with hub.client(boss) as c:
        r = c.post(
            f"/api/v1/orgs/{name}/teams",
            json={"name": "apps", "role": "admin", "repositories": f"{name}/app-*"},
        )
        assert r.status_code == 201, r.text
        assert c.put(f"/api/v1/orgs/{name}/teams/apps/members/{dev[0]}").status_code == 204
        # A glob outside the organisation is refused.
        r = c.post(
            f"/api/v1/orgs/{name}/teams",
            json={"name": "bad", "role": "pull", "repositories": "elsewhere/*"},
        )
        assert r.status_code == 400
        # Duplicate team name: 409.
        r = c.post(f"/api/v1/orgs/{name}/teams", json={"name": "apps", "role": "pull"})
        assert r.status_code == 409
    with hub.client(dev) as c:
        artifact(c, f"{name}/app-new", b"n", tag="v1")  # created through the glob
        assert c.delete(f"/v2/{name}/app-web/manifests/v1").status_code == 202  # admin
        assert c.get(f"/v2/{name}/secret/manifests/v1").status_code == 404
        listed = c.get("/api/v1/repositories", params={"namespace": name}).json()["items"]
        assert sorted(i["name"] for i in listed) == [f"{name}/app-new", f"{name}/app-web"]
        # An admin team limited to a glob does not make its members org admins.
        r = c.post(f"/api/v1/orgs/{name}/teams", json={"name": "mine", "role": "admin"})
        assert r.status_code == 403


def test_only_org_admins_manage_teams(hub: HubServer, org: dict[str, tuple[str, str]]) -> None:
    name, boss, reader, other = org["org"][0], org["boss"], org["reader"], org["other"]
    body = {"name": "t1", "role": "push", "members": [other[0]]}
    for who in (reader, other):
        with hub.client(who) as c:
            r = c.post(f"/api/v1/orgs/{name}/teams", json=body)
            assert r.status_code == 403, r.text
    with hub.client() as c:
        assert c.post(f"/api/v1/orgs/{name}/teams", json=body).status_code == 401
    with hub.client(boss) as c:
        assert c.post(f"/api/v1/orgs/{name}/teams", json=body).status_code == 201
    for who in (reader, other):
        with hub.client(who) as c:
            assert c.delete(f"/api/v1/orgs/{name}/teams/t1").status_code == 403
            r = c.put(f"/api/v1/orgs/{name}/teams/t1/members/{who[0]}")
            assert r.status_code == 403
            r = c.delete(f"/api/v1/orgs/{name}/teams/t1/members/{other[0]}")
            assert r.status_code == 403
    # A pull-scoped token of the org admin cannot manage teams either.
    token = hub.token(boss[0], f"{name}:pull")
    with hub.client((boss[0], token)) as c:
        assert c.delete(f"/api/v1/orgs/{name}/teams/t1").status_code == 403
        assert c.get(f"/api/v1/orgs/{name}/teams").status_code == 200
    # Site admins may; bad input is 400.
    with hub.client(ADMIN) as c:
        r = c.post(f"/api/v1/orgs/{name}/teams", json={"name": "x", "role": "owner"})
        assert r.status_code == 400
        r = c.put(f"/api/v1/orgs/{name}/teams/t1/members/nobody-here")
        assert r.status_code == 400
        assert c.delete(f"/api/v1/orgs/{name}/teams/t1").status_code == 204
    audit = (hub.data_dir / "audit.log").read_text()
    assert '"team.create"' in audit and '"team.delete"' in audit


def test_team_cli(hub: HubServer, org: dict[str, tuple[str, str]]) -> None:
    name, dev, other = org["org"][0], org["dev"], org["other"]
    out = hub.cli("team", "add", name, "ops", "--role", "push", "--member", dev[0])
    assert "created team ops" in out
    hub.cli("team", "member", name, "ops", other[0], "add")
    listing = hub.cli("team", "list", name)
    assert listing.split("\t")[:3] == ["ops", "push", "*"]
    assert sorted(listing.strip().split("\t")[3].split(",")) == sorted([dev[0], other[0]])
    with hub.client(dev) as c:
        artifact(c, f"{name}/cli", b"c", tag="v1")
    hub.cli("team", "member", name, "ops", dev[0], "remove")
    with hub.client(dev) as c:
        assert c.get(f"/v2/{name}/cli/manifests/v1").status_code == 404
    hub.cli("team", "remove", name, "ops")
    assert hub.cli("team", "list", name).strip() == ""
