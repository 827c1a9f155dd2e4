"""/api/v1 organisation creation, direct-member management and user management: who may,
what it changes (a member made admin over the API manages and pushes), and the audit log."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from hub_support import ADMIN, HubServer, artifact


def _names(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10_000_000}"


def _audit(hub: HubServer) -> list[dict[str, Any]]:
    lines = (hub.data_dir / "audit.log").read_text().splitlines()
    return [json.loads(line) for line in lines if line]


def _logged(hub: HubServer, actor: str, action: str, target: str, result: str = "ok") -> bool:
    return any(
        (e["actor"], e["action"], e["target"], e["result"]) == (actor, action, target, result)
        for e in _audit(hub)
    )


def _members(hub: HubServer, who: tuple[str, str], org: str) -> set[tuple[str, str]]:
    with hub.client(who) as c:
        r = c.get(f"/api/v1/orgs/{org}/members")
        assert r.status_code == 200, r.text
        return {(m["user"], m["role"]) for m in r.json()}


def test_create_org_and_manage_direct_members(hub: HubServer) -> None:
    alice, bob, carol = (hub.add_user(_names(p)) for p in ("alice", "bob", "carol"))
    org = _names("acme")
    with hub.client() as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 401
    with hub.client(alice) as c:
        r = c.post("/api/v1/orgs", json={"name": org})
        assert r.status_code == 201, r.text
        assert r.json() == {"name": org, "kind": "org"}
        # The namespace exists (an organisation's or a user's): 409; a bad name: 400.
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 409
        assert c.post("/api/v1/orgs", json={"name": bob[0]}).status_code == 409
        assert c.post("/api/v1/orgs", json={"name": "Bad..Name"}).status_code == 400
    assert _members(hub, alice, org) == {(alice[0], "admin")}

    # Outsiders manage nothing and cannot push.
    with hub.client(bob) as c:
        assert (
            c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "admin"}).status_code == 403
        )
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 403
        r = c.post(f"/v2/{org}/app/blobs/uploads/", params={"digest": "sha256:" + "0" * 64})
        assert r.status_code in (403, 404)
    with hub.client() as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "pull"})
        assert r.status_code == 401
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 401

    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 204, r.text
        # Bad input: 400.
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "owner"})
        assert r.status_code == 400
        r = c.put(f"/api/v1/orgs/{org}/members/nobody-here", json={"role": "pull"})
        assert r.status_code == 400
        assert c.delete(f"/api/v1/orgs/{org}/members/{carol[0]}").status_code == 400
        # The organisation's only admin cannot demote or remove themselves.
        r = c.put(f"/api/v1/orgs/{org}/members/{alice[0]}", json={"role": "push"})
        assert r.status_code == 409
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 409
    with hub.client(bob) as c:
        artifact(c, f"{org}/app", os.urandom(64), tag="v1")  # push, through the membership
        assert c.delete(f"/v2/{org}/app/manifests/v1").status_code == 403  # not admin
        assert (
            c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "pull"}).status_code
            == 403
        )

    # An admin made over the API manages the organisation and deletes in it.
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "admin"})
        assert r.status_code == 204
    with hub.client(bob) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "pull"})
        assert r.status_code == 204
        assert c.delete(f"/v2/{org}/app/manifests/v1").status_code == 202
        # With another admin, alice may step down; then bob is the last admin.
        r = c.put(f"/api/v1/orgs/{org}/members/{alice[0]}", json={"role": "pull"})
        assert r.status_code == 204
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 204
        assert c.delete(f"/api/v1/orgs/{org}/members/{bob[0]}").status_code == 409
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 409
        # Setting the last admin's role to admin again changes nothing and is fine.
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "admin"})
        assert r.status_code == 204
    assert _members(hub, bob, org) == {(bob[0], "admin"), (carol[0], "pull")}
    with hub.client(alice) as c:
        assert c.get(f"/api/v1/orgs/{org}/members").status_code == 403  # no longer a member
    with hub.client(carol) as c:
        r = c.post(f"/v2/{org}/app/blobs/uploads/", params={"digest": "sha256:" + "0" * 64})
        assert r.status_code == 403  # pull only

    assert _logged(hub, alice[0], "org.create", org)
    assert _logged(hub, bob[0], "member.set", org)
    assert _logged(hub, bob[0], "member.remove", org)
    set_bob = [e for e in _audit(hub) if e["action"] == "member.set" and e.get("user") == bob[0]]
    assert [e["role"] for e in set_bob if e["target"] == org] == ["push", "admin", "admin"]


def test_org_creation_needs_a_password_login(hub: HubServer) -> None:
    alice = hub.add_user(_names("alice"))
    token = hub.token(alice[0], "*:admin")
    with hub.client((alice[0], token)) as c:
        r = c.post("/api/v1/orgs", json={"name": _names("tok")})
        assert r.status_code == 403, r.text
    # Nor a registry bearer token, whether obtained with the password or an API token: it
    # carries repository access only (a bearer for one pull must not become anything more).
    for secret, status in ((alice[1], 403), (token, 403)):
        with hub.client((alice[0], secret)) as c:
            bearer = c.get("/token").json()["token"]
        with hub.client() as c:
            r = c.post(
                "/api/v1/orgs",
                json={"name": _names("bearer")},
                headers={"Authorization": f"Bearer {bearer}"},
            )
            assert r.status_code == status, r.text
    # Robots never do (they have API tokens only).
    robot = _names("robot")
    hub.cli("user", "add", robot, "--robot")
    robot_token = hub.token(robot, "*:admin")
    with hub.client((robot, robot_token)) as c:
        assert c.post("/api/v1/orgs", json={"name": _names("bots")}).status_code == 403
    assert _logged(hub, robot, "org.create", "-", "denied")


def test_member_management_scope_and_personal_namespaces(hub: HubServer) -> None:
    alice, bob = hub.add_user(_names("alice")), hub.add_user(_names("bob"))
    org = _names("corp")
    with hub.client(alice) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        # Direct members are an organisation's: not a user's personal namespace.
        r = c.put(f"/api/v1/orgs/{alice[0]}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 400
    # A token narrowed to pull on the organisation cannot manage members.
    token = hub.token(alice[0], f"{org}:pull")
    with hub.client((alice[0], token)) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 403
    # Site admins may.
    with hub.client(ADMIN) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 204
    assert _members(hub, alice, org) == {(alice[0], "admin"), (bob[0], "push")}
    # An organisation-wide admin team does not count as a direct admin member.
    with hub.client(alice) as c:
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "owners", "role": "admin", "members": [bob[0]]},
        )
        assert r.status_code == 201, r.text
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 409


def test_users_api(hub: HubServer) -> None:
    alice = hub.add_user(_names("alice"))
    name, robot = _names("newbie"), _names("robot")
    body = {"name": name, "password": "newbie-password-1"}
    with hub.client() as c:
        assert c.get("/api/v1/users").status_code == 401
        assert c.post("/api/v1/users", json=body).status_code == 401
        assert c.delete(f"/api/v1/users/{alice[0]}").status_code == 401
    with hub.client(alice) as c:
        assert c.get("/api/v1/users").status_code == 403
        assert c.post("/api/v1/users", json=body).status_code == 403
        assert c.delete(f"/api/v1/users/{alice[0]}").status_code == 403
    admin_token = hub.token(ADMIN[0], "*:admin")
    with hub.client((ADMIN[0], admin_token)) as c:
        assert c.get("/api/v1/users").status_code == 403
        assert c.post("/api/v1/users", json=body).status_code == 403
        assert c.delete(f"/api/v1/users/{alice[0]}").status_code == 403

    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json=body)
        assert r.status_code == 201, r.text
        assert r.json() == {"name": name, "admin": False, "robot": False}
        assert c.post("/api/v1/users", json=body).status_code == 409
        for bad in (
            {"name": "Bad Name", "password": "long-enough-1"},
            {"name": _names("short"), "password": "short"},
            {"name": _names("bot"), "password": "long-enough-1", "robot": True},
        ):
            assert c.post("/api/v1/users", json=bad).status_code == 400, bad
        r = c.post("/api/v1/users", json={"name": robot, "robot": True})
        assert r.status_code == 201
        assert r.json() == {"name": robot, "admin": False, "robot": True}
        listed = {u["name"]: u for u in c.get("/api/v1/users").json()}
        assert listed[name] == {"name": name, "admin": False, "robot": False}
        assert listed[robot]["robot"] is True and listed[ADMIN[0]]["admin"] is True

    # The new user logs in, owns their namespace, and may create organisations.
    newbie = (name, body["password"])
    with hub.client(newbie) as c:
        artifact(c, f"{name}/first", b"first", tag="v1")
        neworg = _names("neworg")
        assert c.post("/api/v1/orgs", json={"name": neworg}).status_code == 201
    # An organisation named like an existing user is refused, and a user named like an org.
    with hub.client(ADMIN) as c:
        org = _names("taken")
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        r = c.post("/api/v1/users", json={"name": org, "password": "long-enough-1"})
        assert r.status_code == 409

    # A site admin made over the API manages users.
    boss = (_names("boss"), "boss-password-1")
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json={"name": boss[0], "password": boss[1], "admin": True})
        assert r.status_code == 201 and r.json()["admin"] is True
    with hub.client(boss) as c:
        # The last admin of an organisation goes too (hub review 13: otherwise anyone
        # made an organisation's admin by others was undeletable); the organisation
        # stays, and a site admin gives it another admin.
        assert c.delete(f"/api/v1/users/{name}").status_code == 204
        assert c.get(f"/api/v1/orgs/{neworg}/members").json() == []
        member = f"/api/v1/orgs/{neworg}/members/{ADMIN[0]}"
        assert c.put(member, json={"role": "admin"}).status_code == 204
        assert c.delete(f"/api/v1/users/{name}").status_code == 400
        assert c.delete(f"/api/v1/users/{robot}").status_code == 204
    with hub.client(newbie) as c:
        assert c.get("/api/v1/tokens").status_code == 401
    with hub.client(ADMIN) as c:
        assert c.delete(f"/api/v1/users/{boss[0]}").status_code == 204

    assert _logged(hub, ADMIN[0], "user.create", name)
    assert _logged(hub, boss[0], "user.remove", name)
    removal = [e for e in _audit(hub) if (e["action"], e["target"]) == ("user.remove", name)]
    assert removal[-1]["orphaned_orgs"] == [neworg]
    assert _logged(hub, alice[0], "user.create", name, "denied")


def test_last_site_admin_stays(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    with hub.client(ADMIN) as c:
        assert c.delete(f"/api/v1/users/{ADMIN[0]}").status_code == 409
        r = c.post(
            "/api/v1/users", json={"name": "second", "password": "second-password", "admin": True}
        )
        assert r.status_code == 201
    with hub.client(("second", "second-password")) as c:
        assert c.delete(f"/api/v1/users/{ADMIN[0]}").status_code == 204
        assert c.delete("/api/v1/users/second").status_code == 409
        assert [u["name"] for u in c.get("/api/v1/users").json()] == ["second"]


def test_org_and_user_api_on_both_backends(backend_hub: HubServer) -> None:
    """The last-admin checks lock rows (FOR UPDATE on PostgreSQL): same answers on both."""
    hub = backend_hub
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/users", json={"name": "dana", "password": "dana-password"})
        assert r.status_code == 201
        assert c.post("/api/v1/orgs", json={"name": "both"}).status_code == 201
        assert c.put("/api/v1/orgs/both/members/dana", json={"role": "admin"}).status_code == 204
        assert c.delete(f"/api/v1/orgs/both/members/{ADMIN[0]}").status_code == 204
        assert c.delete("/api/v1/orgs/both/members/dana").status_code == 409
        assert c.delete(f"/api/v1/users/{ADMIN[0]}").status_code == 409
        # The last admin of "both" goes too; the organisation stays for site admins.
        assert c.delete("/api/v1/users/dana").status_code == 204
        assert c.get("/api/v1/orgs/both/members").json() == []
        assert (
            c.put(f"/api/v1/orgs/both/members/{ADMIN[0]}", json={"role": "admin"}).status_code
            == 204
        )
        assert [m["user"] for m in c.get("/api/v1/orgs/both/members").json()] == [ADMIN[0]]
