"""Hostile review 20: principals that outlived what made them, and caches.

1. A robot's token minted by an organisation admin (the UI's robot form) kept working
   after that admin was removed from the organisation, or deleted: they left with a
   secret that acted as the robot. A token minted for a robot by someone else now stands
   only while its minter may still manage the robot (``authz.minter_stands``, migration
   0013); the organisation's other admins mint new ones. The operator's tokens
   (``forkd hub token create``) carry no minter and stand.
2. Any organisation admin could make any user undeletable: make them an admin, then
   leave; the site admin's removal was refused (last admin of an organisation). It now
   goes through; the organisation stays, for the site's admins.
3. The verified-credential cache was keyed by sha256(user, password): a dump of the hub's
   memory held values a password dictionary runs against at GPU speed. Its keys are now an
   HMAC under a random key of the process.
4. Answers carried no ``Vary``: a cache keyed on the URL alone could give one caller's
   answer to another. Every answer now says ``Vary: Authorization, Cookie``.
5. The UI's robot form set a robot's role without the last-admin check every other
   member change makes: an organisation admin through a team demoted the robot that was
   the organisation's last direct admin. It is refused (400) as the API refuses it (409).
6. A user or organisation could be named after a path the hub serves itself (``api``,
   ``v2``, ...), and its page ``/NAME`` was never reachable. Such names are refused when a
   namespace is made.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import httpx
import pytest
from hub_server import ADMIN, HubServer
from hub_support import audit_log, browser, csrf_of, org_with_pusher, unique_name

from forkd.hub.headers import with_vary
from forkd.hub.tokens import CredentialCache


def _mint_robot_token(hub: HubServer, admin: tuple[str, str], org: str, robot: str) -> str:
    """A token for ``robot`` in ``org`` minted by ``admin`` in the UI's robot form."""
    with browser(hub, *admin) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        data = {"csrf": csrf, "namespace": org, "robot": robot, "role": "pull"}
        r = b.post("/-/settings/robots", data=data, follow_redirects=True)
        assert r.status_code == 200, r.text
        found = re.search(r"fkd_[A-Za-z0-9_-]{30,}", r.text)
        assert found, r.text
        return found.group(0)


def _pulls(hub: HubServer, robot: str, secret: str, org: str) -> int:
    with hub.client((robot, secret)) as c:
        return c.get(f"/v2/{org}/app/tags/list").status_code


Minted = tuple[str, tuple[str, str], tuple[str, str], str, str, str]


@pytest.fixture
def minted(hub: HubServer) -> Iterator[Minted]:
    """An organisation with two direct admins, alice and carol, and a robot with a token
    each of them minted: (org, alice, carol, robot, carol's token, alice's token)."""
    org, alice, _bob = org_with_pusher(hub)
    carol = hub.add_user(unique_name("carol"))
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "admin"})
        assert r.status_code == 204, r.text
    robot = f"{org}+{unique_name('bot')}"  # a robot made in the UI: ORG+NAME (review 25)
    by_carol = _mint_robot_token(hub, carol, org, robot)
    by_alice = _mint_robot_token(hub, alice, org, robot)
    yield org, alice, carol, robot, by_carol, by_alice


def test_a_robot_token_ends_when_its_minter_leaves_the_organisation(
    hub: HubServer, minted: Minted
) -> None:
    org, alice, carol, robot, by_carol, by_alice = minted
    by_operator = hub.token(robot, f"{org}:pull")
    for secret in (by_carol, by_alice, by_operator):
        assert _pulls(hub, robot, secret, org) == 200
    # A bearer token from the registry's /token while carol was an admin.
    with httpx.Client(base_url=hub.url, auth=(robot, by_carol)) as c:
        r = c.get("/token", params={"scope": f"repository:{org}/app:pull"})
        assert r.status_code == 200, r.text
        bearer = r.json()["token"]
    with hub.client(alice) as c:
        assert c.delete(f"/api/v1/orgs/{org}/members/{carol[0]}").status_code == 204
    assert _pulls(hub, robot, by_carol, org) == 401  # the cached credential too
    with httpx.Client(base_url=hub.url) as c:
        r = c.get(f"/v2/{org}/app/tags/list", headers={"Authorization": f"Bearer {bearer}"})
        assert r.status_code == 401, r.text
    assert _pulls(hub, robot, by_alice, org) == 200
    assert _pulls(hub, robot, by_operator, org) == 200
    # Alice's token page says which token stopped, and who minted each.
    with browser(hub, *alice) as b:
        page = b.get("/-/settings/tokens").text
    table = page[page.index(f'data-testid="robot-tokens-{robot}"') :]
    table = table[: table.index("</table>")]
    rows = table.split("<tr>")[2:]  # the head's row, then one per token
    assert len(rows) == 3, table
    carols = [r for r in rows if carol[0] in r]
    assert len(carols) == 1 and "stopped working" in carols[0], rows
    assert [r for r in rows if "stopped working" in r] == carols
    assert sum(alice[0] in r for r in rows) == 1  # hers; the operator's names no one
    # Made an admin again, carol's old token stands again: it was never revoked, only
    # held to what its minter may do now.
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "admin"})
        assert r.status_code == 204
    assert _pulls(hub, robot, by_carol, org) == 200
    # Demoted to push, she manages no robot of the organisation: the token ends.
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "push"})
        assert r.status_code == 204
    assert _pulls(hub, robot, by_carol, org) == 401


def test_a_robot_token_ends_when_its_minter_is_deleted(hub: HubServer, minted: Minted) -> None:
    org, _alice, carol, robot, by_carol, by_alice = minted
    assert _pulls(hub, robot, by_carol, org) == 200
    hub.cli("user", "remove", carol[0])
    assert _pulls(hub, robot, by_carol, org) == 401
    assert _pulls(hub, robot, by_alice, org) == 200
    # No new account is given carol's name: her namespace stays and keeps it (review 25,
    # one pool of names; a robot of her name was made here before). Her token stays dead.
    with pytest.raises(AssertionError, match="already exists"):
        hub.cli("user", "add", carol[0], "--robot")
    assert _pulls(hub, robot, by_carol, org) == 401


def test_a_user_made_an_organisations_admin_by_others_can_be_removed(
    hub: HubServer,
) -> None:
    org, alice, bob = org_with_pusher(hub)
    with hub.client(alice) as c:
        assert (
            c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "admin"}).status_code == 204
        )
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 204
    with hub.client(ADMIN) as c:
        assert c.delete(f"/api/v1/users/{bob[0]}").status_code == 204
        assert c.get(f"/api/v1/orgs/{org}/members").json() == []
        # The organisation stays, with its repository; a site admin gives it an admin.
        assert c.get(f"/v2/{org}/app/tags/list").status_code == 200
        r = c.put(f"/api/v1/orgs/{org}/members/{alice[0]}", json={"role": "admin"})
        assert r.status_code == 204
    removal = [e for e in audit_log(hub) if (e["action"], e["target"]) == ("user.remove", bob[0])]
    assert removal and removal[-1]["orphaned_orgs"] == [org]


def test_the_credential_cache_holds_no_plain_hash_of_a_password() -> None:
    first, second = CredentialCache(), CredentialCache()
    key = first.key("alice", "correct horse")
    assert key == first.key("alice", "correct horse")  # stable within the process
    assert key != second.key("alice", "correct horse")  # salted per cache
    assert key != first.key("alice", "correct horsf")
    plain = {
        hashlib.sha256(b"alice\x00correct horse").hexdigest(),
        hashlib.sha256(b"correct horse").hexdigest(),
    }
    assert key not in plain


def test_every_answer_varies_on_who_asks(hub: HubServer, user: tuple[str, str]) -> None:
    with httpx.Client(base_url=hub.url) as anonymous:
        for path in ("/v2/", "/api/v1/repositories", "/-/signin", "/no/such/page"):
            vary = anonymous.get(path).headers.get("vary", "")
            assert {"authorization", "cookie"} <= {t.strip().lower() for t in vary.split(",")}, (
                path,
                vary,
            )
    with hub.client(user) as c:
        r = c.get("/api/v1/tokens")
        assert r.status_code == 200
        assert "Authorization" in r.headers["vary"] and "Cookie" in r.headers["vary"]
        assert r.headers["cache-control"] == "private, no-cache"


def test_a_routes_own_vary_is_kept() -> None:
    assert with_vary("") == "Authorization, Cookie"
    assert with_vary("Accept-Encoding") == "Accept-Encoding, Authorization, Cookie"
    assert with_vary("accept, authorization") == "accept, authorization, Cookie"
    assert with_vary("*") == "*"


def test_the_robot_form_keeps_an_organisations_last_direct_admin(hub: HubServer) -> None:
    org, alice, _bob = org_with_pusher(hub)
    robot = f"{org}+{unique_name('bot')}"  # a robot made in the UI: ORG+NAME (review 25)
    _mint_robot_token(hub, alice, org, robot)  # a pull member
    with browser(hub, *alice) as b:  # the robot made a direct admin through the form
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        data = {"csrf": csrf, "namespace": org, "robot": robot, "role": "admin"}
        assert b.post("/-/settings/robots", data=data).status_code == 303
    with hub.client(alice) as c:  # alice: admin through a team, no longer a direct one
        team = {"name": "owners", "role": "admin", "members": [alice[0]]}
        assert c.post(f"/api/v1/orgs/{org}/teams", json=team).status_code == 201
        assert c.delete(f"/api/v1/orgs/{org}/members/{alice[0]}").status_code == 204
        # The API refuses to demote the last direct admin...
        r = c.put(f"/api/v1/orgs/{org}/members/{robot}", json={"role": "pull"})
        assert r.status_code == 409, r.text
    with browser(hub, *alice) as b:  # ...and so does the robot form
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        data = {"csrf": csrf, "namespace": org, "robot": robot, "role": "pull"}
        r = b.post("/-/settings/robots", data=data)
        assert r.status_code == 400, r.text
        assert "last admin" in r.text
    with hub.client(ADMIN) as c:
        roles = {m["user"]: m["role"] for m in c.get(f"/api/v1/orgs/{org}/members").json()}
    assert roles[robot] == "admin"


def test_no_new_namespace_takes_a_name_the_hub_serves_itself(hub: HubServer) -> None:
    """A user or organisation named ``api``, ``v2``, ``token``, ``metrics`` or
    ``healthz`` had its page (``/NAME``) hidden behind the hub's own route: refused (400)
    when made, on each way a namespace is made."""
    with hub.client(ADMIN) as c:
        for name in ("api", "v2", "token", "metrics", "healthz"):
            r = c.post("/api/v1/orgs", json={"name": name})
            assert r.status_code == 400 and "reserved" in r.text, r.text
            r = c.post("/api/v1/users", json={"name": name, "password": "long-enough-1"})
            assert r.status_code == 400 and "reserved" in r.text, r.text
            r = c.post(f"/v2/{name}/app/blobs/uploads/")  # a site admin's push makes one
            assert r.status_code == 404 and "reserved" in r.text, r.text  # NAME_UNKNOWN
        # A robot has no namespace, but claims its name from the same pool (review 25).
        r = c.post("/api/v1/users", json={"name": "api", "robot": True})
        assert r.status_code == 400 and "reserved" in r.text, r.text
