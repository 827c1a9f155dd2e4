"""Hostile review 5: token management needs the password, bodies refuse unknown fields,
and errors do not echo what the client sent.

* a registry bearer token or an API token (over Basic, or a UI session opened with one)
  lists, creates and revokes no tokens: a pull-only token must not read the others' names
  and scopes, or revoke the deploy token;
* every JSON body refuses unknown fields: a misspelt ``repository`` must not give a team
  the whole organisation, a misspelt ``expires_days`` must not make a token that never
  expires;
* a body or parameter that does not match its type is a 400 naming the field, never the
  URL (Litestar's default detail repeats the query string); values the client sent are
  shortened in messages.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from hub_support import ADMIN, TIMEOUT, HubServer

SIGNIN = "/-/signin"
MARKER = "<script>x" + "y" * 300


@contextmanager
def _browser(hub: HubServer, user: str, secret: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as c:
        found = re.search(r'name="login_csrf" value="([^"]*)"', c.get(SIGNIN).text)
        assert found
        data = {"login_csrf": found.group(1), "username": user, "password": secret}
        assert c.post(SIGNIN, data=data).status_code == 303
        yield c


def _csrf(c: httpx.Client, path: str) -> str:
    found = re.search(r'name="csrf" value="([^"]*)"', c.get(path).text)
    assert found
    return found.group(1)


def test_only_the_password_manages_tokens(hub: HubServer) -> None:
    who = hub.add_user("tess")
    with hub.client(who) as c:
        deploy = c.post("/api/v1/tokens", json={"name": "deploy", "scopes": ["tess:admin"]})
        assert deploy.status_code == 201, deploy.text
        deploy_id = deploy.json()["id"]
        pull_only = c.post("/api/v1/tokens", json={"name": "ci", "scopes": ["tess:pull"]})
        bearer = c.get("/token", params={"scope": "repository:tess/app:pull"}).json()["token"]
    narrow = {"auth": ("tess", pull_only.json()["token"])}
    wide = {"auth": ("tess", deploy.json()["token"])}
    by_bearer = {"headers": {"Authorization": f"Bearer {bearer}"}}
    for how in (narrow, wide, by_bearer):
        with httpx.Client(base_url=hub.url, timeout=TIMEOUT, **how) as c:  # type: ignore[arg-type]
            listed = c.get("/api/v1/tokens")
            assert listed.status_code == 403 and "password" in listed.text, listed.text
            assert "deploy" not in listed.text
            gone = c.delete(f"/api/v1/tokens/{deploy_id}")
            assert gone.status_code == 403, gone.text
            made = c.post("/api/v1/tokens", json={"name": "x", "scopes": ["tess:pull"]})
            assert made.status_code == 403, made.text
    with hub.client(who) as c:  # the deploy token is still there, and still works
        names = [t["name"] for t in c.get("/api/v1/tokens").json()]
        assert names == ["deploy", "ci"]
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT, **wide) as c:  # type: ignore[arg-type]
        assert c.get("/v2/_catalog").status_code == 200

    # a UI session opened with a token sees no tokens and revokes none
    with _browser(hub, "tess", pull_only.json()["token"]) as b:
        page = b.get("/-/settings/tokens")
        assert page.status_code == 200 and "deploy" not in page.text
        assert "sign in with your password" in page.text
        r = b.post(f"/-/settings/tokens/{deploy_id}/revoke",
                   data={"csrf": _csrf(b, "/")})
        assert r.status_code == 403, r.text
    with hub.client(who) as c:
        assert [t["name"] for t in c.get("/api/v1/tokens").json()] == ["deploy", "ci"]
    # the password's own session does
    with _browser(hub, *who) as b:
        page = b.get("/-/settings/tokens")
        assert page.status_code == 200 and "deploy" in page.text


def test_bodies_refuse_unknown_fields(hub: HubServer) -> None:
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/orgs", json={"name": "strict"}).status_code == 201
        typo = c.post("/api/v1/orgs/strict/teams",
                      json={"name": "ci", "role": "admin", "repository": "strict/app-*"})
        assert typo.status_code == 400 and "repository" in typo.text, typo.text
        teams = c.get("/api/v1/orgs/strict/teams")
        assert teams.status_code == 200 and "ci" not in [t["name"] for t in teams.json()]
        never = c.post("/api/v1/tokens", json={"name": "t", "scopes": ["strict:pull"],
                                               "expires_in_days": 1})
        assert never.status_code == 400 and "expires_in_days" in never.text, never.text
        assert "t" not in [t["name"] for t in c.get("/api/v1/tokens").json()]
        for path, body in [("/api/v1/orgs", {"name": "o2", "kind": "x"}),
                           ("/api/v1/users", {"name": "newbie", "superuser": True}),
                           ("/api/v1/orgs/strict/members/admin", {"role": "admin", "x": 1}),
                           ("/api/v1/namespaces/strict/quota", {"quota_bytes": 5, "soft": True})]:
            r = c.request("PUT" if "members" in path or "quota" in path else "POST", path,
                          json=body)
            assert r.status_code == 400 and "unknown field" in r.text, (path, r.text)
        assert c.get("/api/v1/users").status_code == 200
        assert "newbie" not in c.get("/api/v1/users").text


def test_errors_do_not_echo_the_request(hub: HubServer) -> None:
    with hub.client(ADMIN) as c:
        r = c.get("/api/v1/repositories", params={"sort": "zz", "msg": MARKER})
        assert r.status_code == 400, r.text
        assert "<script>" not in r.text and "msg" not in r.text and "sort" in r.text
        r = c.post(f"/api/v1/orgs?{MARKER}=1", json={"name": 5})
        assert r.status_code == 400 and "<script>" not in r.text, r.text
        assert c.post("/api/v1/orgs", json={"name": "echo"}).status_code == 201
        r = c.put("/api/v1/orgs/echo/members/admin", json={"role": MARKER})
        assert r.status_code == 400 and "y" * 100 not in r.text, r.text
    r = httpx.get(f"{hub.url}/token", params={"service": MARKER}, timeout=TIMEOUT)
    assert r.status_code == 403 and "y" * 100 not in r.text, r.text
    # a UI page: the same rule
    r = httpx.get(f"{hub.url}/-/search", params={"page": MARKER}, timeout=TIMEOUT)
    assert r.status_code == 400 and "page" in r.text and "y" * 100 not in r.text, r.text
