"""Hostile review 22: one member change for every surface.

1. A user's personal namespace has no members but its owner (docs/hub.md, "Accounts and
   authorisation"): ``PUT /api/v1/orgs/USER/members/...`` refused it (400), but the UI's
   member form on the user's own page added anyone with any role (``bob`` pushed into
   ``alice/...``), and the UI's robot form made robots members of it. Now the one member
   change (``members.change_member``; the robot form's ``members.place_robot`` is the
   same change for a robot it may make first) refuses a personal namespace, 400 with
   the same words on each surface, and the pages offer no such forms.
2. The UI's robot form applied the last-admin rule itself and the API through
   ``members.change_member``: two copies of a rule. Now both the API's member routes and
   the UI's member and robot forms write a member through ``members._place`` (its robot
   rule, its last-admin rule), which the tests below see each entry point go through.
   ``accounts.set_member`` refuses a personal namespace too, so the operator's shell
   (``forkd hub org member``) agrees; a member an older hub stored there can still be
   removed (API and UI), its owner never.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from hub_server import ADMIN, HubServer, hub_group
from hub_support import browser, csrf_of, org_with_pusher, push_blob, unique_name

from forkd.hub import members

PERSONAL = "personal namespace"


def _member_form(b: httpx.Client, namespace: str, username: str, role: str) -> httpx.Response:
    csrf = csrf_of(b.get("/-/settings/tokens").text)
    data = {"csrf": csrf, "username": username, "role": role}
    return b.post(f"/-/members/{namespace}", data=data)


def _robot_form(b: httpx.Client, namespace: str, robot: str, role: str) -> httpx.Response:
    csrf = csrf_of(b.get("/-/settings/tokens").text)
    data = {"csrf": csrf, "namespace": namespace, "robot": robot, "role": role}
    return b.post("/-/settings/robots", data=data)


def _members(hub: HubServer, namespace: str) -> dict[str, str]:
    with hub.client(ADMIN) as c:
        r = c.get(f"/api/v1/orgs/{namespace}/members")
    assert r.status_code == 200, r.text
    return {m["user"]: m["role"] for m in r.json()}


def test_a_personal_namespace_takes_no_members_on_any_surface(hub: HubServer) -> None:
    alice, bob = hub.add_user(unique_name("alice")), hub.add_user(unique_name("bob"))
    robot = unique_name("bot")
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{alice[0]}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 400 and PERSONAL in r.text, r.text
        r = c.delete(f"/api/v1/orgs/{alice[0]}/members/{alice[0]}")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
    with browser(hub, *alice) as b:
        page = b.get(f"/{alice[0]}").text
        assert 'aria-label="Add member"' not in page  # no form offered
        r = _member_form(b, alice[0], bob[0], "push")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
        r = _member_form(b, alice[0], alice[0], "remove")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
        tokens = b.get("/-/settings/tokens").text
        assert f"<option>{alice[0]}</option>" not in tokens  # not offered for robots
        r = _robot_form(b, alice[0], robot, "push")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
    assert _members(hub, alice[0]) == {alice[0]: "admin"}
    with hub.client(bob) as c:  # bob holds nothing in alice's namespace
        r = c.post(f"/v2/{alice[0]}/app/blobs/uploads/")
        assert r.status_code in (401, 403, 404), r.text
    with hub.client(ADMIN) as c:
        assert robot not in c.get("/api/v1/users").text  # no robot made either
    with hub.client(alice) as c:  # the owner still pushes
        push_blob(c, f"{alice[0]}/app", b"mine")


@pytest.fixture
def placed(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str | None]]:
    """Every member write of the hub, as (user, role), from ``members._place``."""
    calls: list[tuple[str, str | None]] = []
    real = members._place

    async def spy(session: Any, principal: Any, ns: Any, user: Any, role: Any, **kw: Any) -> None:
        calls.append((user.name, role))
        await real(session, principal, ns, user, role, **kw)

    monkeypatch.setattr(members, "_place", spy)
    return calls


def test_the_api_and_both_ui_forms_write_members_through_one_path(
    hub: HubServer, placed: list[tuple[str, str | None]]
) -> None:
    org, alice, bob = org_with_pusher(hub)
    robot = f"{org}+{unique_name('bot')}"  # made in the UI: ORG+NAME
    assert placed == [(bob[0], "push")]  # org_with_pusher's own PUT
    placed.clear()
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "pull"})
        assert r.status_code == 204, r.text
    assert placed == [(bob[0], "pull")]
    with browser(hub, *alice) as b:
        assert _member_form(b, org, bob[0], "push").status_code == 303
        assert _robot_form(b, org, robot, "pull").status_code == 303
    assert placed == [(bob[0], "pull"), (bob[0], "push"), (robot, "pull")]
    assert _members(hub, org) == {alice[0]: "admin", bob[0]: "push", robot: "pull"}


def test_a_robot_holding_no_place_is_refused_by_the_api_and_both_forms(hub: HubServer) -> None:
    """A robot a site admin made (no place anywhere: the site admins' alone): an
    organisation admin adopts it on no surface, each refusal from the one rule."""
    org, alice, _bob = org_with_pusher(hub)
    robot = unique_name("stray")
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/users", json={"name": robot, "robot": True}).status_code == 201
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{robot}", json={"role": "pull"})
        assert r.status_code == 403 and "do not administer" in r.text, r.text
    with browser(hub, *alice) as b:
        r = _member_form(b, org, robot, "pull")
        assert r.status_code == 403 and "do not administer" in r.text, r.text
        r = _robot_form(b, org, robot, "pull")
        assert r.status_code == 400 and "do not administer" in r.text, r.text
    assert robot not in _members(hub, org)


def test_the_last_direct_admin_is_kept_by_the_api_and_both_forms(hub: HubServer) -> None:
    org, alice, _bob = org_with_pusher(hub)
    robot = f"{org}+{unique_name('bot')}"  # made in the UI: ORG+NAME
    with browser(hub, *alice) as b:
        assert _robot_form(b, org, robot, "admin").status_code == 303
    with hub.client(alice) as c:  # alice an admin through a team only: the robot is the last
        team = {"name": "owners", "role": "admin", "members": [alice[0]]}
        assert c.post(f"/api/v1/orgs/{org}/teams", json=team).status_code == 201
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 204
        r = c.put(f"/api/v1/orgs/{org}/members/{robot}", json={"role": "pull"})
        assert r.status_code == 409 and "last admin" in r.text, r.text
    with browser(hub, *alice) as b:
        r = _member_form(b, org, robot, "push")
        assert r.status_code == 409 and "last admin" in r.text, r.text
        r = _robot_form(b, org, robot, "pull")
        assert r.status_code == 400 and "last admin" in r.text, r.text
    assert _members(hub, org)[robot] == "admin"


def test_the_operators_shell_gives_no_member_to_a_personal_namespace(hub: HubServer) -> None:
    alice, bob = hub.add_user(unique_name("alice")), hub.add_user(unique_name("bob"))
    argv = ["org", "member", "--data", str(hub.data_dir), alice[0], bob[0], "push"]
    result = CliRunner().invoke(hub_group, argv)
    assert result.exit_code != 0
    assert PERSONAL in result.output, result.output
    assert _members(hub, alice[0]) == {alice[0]: "admin"}


def test_a_member_stored_before_the_rule_can_be_removed_and_the_owner_cannot(
    hub: HubServer,
) -> None:
    """Older hubs' UI added members to personal namespaces: their owner removes them
    (API and UI), gives them no other role, and never removes themselves."""
    alice = hub.add_user(unique_name("alice"))
    bob, carol = hub.add_user(unique_name("bob")), hub.add_user(unique_name("carol"))
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        for who in (bob[0], carol[0]):
            db.execute(
                "INSERT INTO memberships (namespace_id, user_id, role) SELECT n.id, u.id, "
                "'push' FROM namespaces n, users u WHERE n.name = ? AND u.name = ?",
                (alice[0], who),
            )
    with browser(hub, *alice) as b:
        page = b.get(f"/{alice[0]}").text
        assert f'aria-label="Role of {bob[0]}"' in page  # a leftover: a form to remove it
        assert f'aria-label="Role of {alice[0]}"' not in page  # the owner: none
        r = _member_form(b, alice[0], bob[0], "admin")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
        assert _member_form(b, alice[0], bob[0], "remove").status_code == 303
    with hub.client(alice) as c:
        assert c.delete(f"/api/v1/orgs/{alice[0]}/members/{carol[0]}").status_code == 204
        r = c.delete(f"/api/v1/orgs/{alice[0]}/members/{alice[0]}")
        assert r.status_code == 400 and PERSONAL in r.text, r.text
    assert _members(hub, alice[0]) == {alice[0]: "admin"}
