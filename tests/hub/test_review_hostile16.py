"""Hostile review 16: what an insider could still do at will, or to someone else.

- A UI sign-in is a credential handed out, as a registry token is: an account with its
  password (or an API token) signed in over and over, reusing one sign-in form (its
  login cookie lives 30 minutes), and every sign-in and sign-out was an audit record
  that no budget bounded: one account filled the disk with ``ui.signin`` lines. Now
  sign-ins and sign-outs are counted with the account's registry tokens
  (``Hub.provoked``, the ``(grants)`` kind: ``audit_provoked_per_minute`` a minute per
  account), and past that counted in one ``audit.suppressed`` record.
- Bounds that counted what their counter could take back: the organisations a user
  created counted only while they administered them (create, make another admin, leave:
  the place came back), and the robots an organisation made only while members (make,
  remove: the place came back, the robot stayed). Now both count what was made
  (``namespaces.created_by``, ``users.robot_for``, migration 0012); and being made the
  admin of someone else's organisations no longer spends one's own places.
- A pack page rendered its README on the event loop at every view: Markdown that is
  slow to parse stalled the whole hub per anonymous view. Now rendered in a worker
  thread, once per text.
- ``POST /api/v1/tokens`` stored a token name of any length cut to 64 characters: now
  400, as the UI's form refuses a field past its limit.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_server import TIMEOUT, HubServer
from hub_support import ADMIN, artifact, browser, csrf_of, org_with_pusher, unique_name

from forkd.hub import accounts
from forkd.hub.ui import render

PER_MINUTE = 40


def audit_lines(server: HubServer) -> list[dict[str, Any]]:
    path = server.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _signin_form(c: httpx.Client) -> tuple[str, str]:
    """(the login cookie, the form's login_csrf) of one sign-in page."""
    page = c.get("/-/signin")
    found = re.search(r'name="login_csrf" value="([^"]*)"', page.text)
    assert found
    return page.cookies["forkd_login"], found.group(1)


def test_signing_in_at_will_is_bounded_in_the_audit_log(tmp_path: Path) -> None:
    """Before: 3 x ``PER_MINUTE`` sign-ins and sign-outs of one account with one sign-in
    form were 6 x ``PER_MINUTE`` audit records. Now at most ``PER_MINUTE`` of them a
    minute, the rest counted in ``audit.suppressed``; another account's sign-in in the
    same minute is still recorded."""
    server = HubServer(tmp_path / "hub", {"audit_provoked_per_minute": PER_MINUTE}).start()
    try:
        name, password = server.add_user(unique_name("looper"))
        other = server.add_user(unique_name("other"))
        with httpx.Client(base_url=server.url, timeout=30) as c:
            nonce, login_csrf = _signin_form(c)
        form = {"login_csrf": login_csrf, "username": name, "password": password}
        for _ in range(3 * PER_MINUTE):
            # A client of its own each time, the same login cookie and form each time.
            with httpx.Client(base_url=server.url, timeout=30) as c:
                c.cookies.set("forkd_login", nonce)
                r = c.post("/-/signin", data=form)
                assert r.status_code == 303
                page = c.get(f"/{name}").text
                csrf = re.search(r'name="csrf" value="([^"]*)"', page)
                assert csrf
                assert c.post("/-/signout", data={"csrf": csrf.group(1)}).status_code == 303
        with httpx.Client(base_url=server.url, timeout=30) as c:
            nonce, login_csrf = _signin_form(c)
            c.cookies.set("forkd_login", nonce)
            r = c.post(
                "/-/signin",
                data={"login_csrf": login_csrf, "username": other[0], "password": other[1]},
            )
            assert r.status_code == 303
        lines = audit_lines(server)
        mine = [e for e in lines if e["actor"] == name and e["action"].startswith("ui.")]
        assert len(mine) <= PER_MINUTE
        assert [e for e in lines if e["actor"] == other[0] and e["action"] == "ui.signin"]
    finally:
        server.stop()


def test_organisations_one_account_creates_stay_bounded_when_handed_over(
    hub: HubServer,
) -> None:
    """Before: the bound counted the organisations the creator was the direct admin of
    at the time. Creating one, making another account its admin (any user, or a robot
    the creator just made in it through the robot form) and leaving it gave the place
    back, so one account made namespaces without end (and a robot with each). Now the
    bound counts the organisations the account created: handing one over frees no
    place, 409 past ``MAX_ORGS_PER_USER``."""
    from forkd.hub.accounts import MAX_ORGS_PER_USER

    founder = hub.add_user(unique_name("handover"))
    heir = hub.add_user(unique_name("heir"))
    answers = []
    with hub.client(founder) as c:
        for i in range(MAX_ORGS_PER_USER + 3):
            org = unique_name(f"handed{i}-")
            r = c.post("/api/v1/orgs", json={"name": org})
            answers.append(r.status_code)
            if r.status_code != 201:
                continue
            r = c.put(f"/api/v1/orgs/{org}/members/{heir[0]}", json={"role": "admin"})
            assert r.status_code == 204, r.text
            assert c.delete(f"/api/v1/orgs/{org}/members/{founder[0]}").status_code == 204
    assert answers == [201] * MAX_ORGS_PER_USER + [409] * 3, answers


def test_being_made_an_admin_does_not_spend_ones_own_places(hub: HubServer) -> None:
    """Before: an org admin could add anyone as a direct admin of their organisations,
    no consent asked, and so use up that account's places: a user made the admin of 20
    organisations by someone else could create none. Now only the organisations one
    created count against one's bound."""
    from forkd.hub.accounts import MAX_ORGS_PER_USER

    griefer = hub.add_user(unique_name("griefer"))
    victim = hub.add_user(unique_name("victim"))
    with hub.client(griefer) as c:
        for i in range(MAX_ORGS_PER_USER):
            org = unique_name(f"grief{i}-")
            assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
            r = c.put(f"/api/v1/orgs/{org}/members/{victim[0]}", json={"role": "admin"})
            assert r.status_code == 204, r.text
    with hub.client(victim) as c:
        r = c.post("/api/v1/orgs", json={"name": unique_name("mine")})
        assert r.status_code == 201, r.text


def test_robots_an_organisation_makes_stay_bounded_when_removed(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the bound on the robots an organisation's admins make counted its robot
    members at the time. Making one in the robot form, then removing it from the
    organisation in the member form, gave the place back, and the robot stayed: an
    account and a name no one else can take, without end. Now the robots made for an
    organisation count whether or not they are still members (2 here)."""
    monkeypatch.setattr(accounts, "MAX_ROBOTS_PER_NAMESPACE", 2)
    org, alice, _bob = org_with_pusher(hub)
    robots = [f"{org}+{unique_name('gone')}" for _ in range(4)]  # ORG+NAME: review 25
    answers = []
    with browser(hub, *alice) as b:
        for robot in robots:
            csrf = csrf_of(b.get("/-/settings/tokens").text)
            data = {"csrf": csrf, "namespace": org, "robot": robot, "role": "pull"}
            r = b.post("/-/settings/robots", data=data)
            answers.append(r.status_code)
            if r.status_code != 303:
                continue
            data = {"csrf": csrf, "username": robot, "role": "remove"}
            assert b.post(f"/-/members/{org}", data=data).status_code == 303
    assert answers == [303, 303, 400, 400], answers
    with hub.client(ADMIN) as c:
        users = c.get("/api/v1/users").text
    assert robots[1] in users and robots[2] not in users and robots[3] not in users


def test_a_readme_that_is_slow_to_render_neither_stalls_the_hub_nor_renders_per_view(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: a pack page rendered its README (Markdown, up to 256 KiB) on the event
    loop, at every view, uncached. Some Markdown costs the parser time that grows faster
    than its length (100,000 ``[`` took seconds; 256 KiB of them 8 s): any pusher set
    such a README on a public pack, and every anonymous view of the page stalled the
    whole hub, every other request waiting. Now the README is rendered in a worker
    thread, once per text (a bounded cache by its hash), so the hub answers meanwhile
    and later views cost nothing.

    The render is held until the test lets it go, so "the hub answers meanwhile" and
    "rendered once" are facts, not timings (it was: /healthz in < 1 s and under half
    the first view's time, the second view in < 1 s)."""
    who = hub.add_user(unique_name("slowmd"))
    repo = f"{who[0]}/readme"
    readme = "[" * 100_000 + f" {repo}"  # a text of its own: not in the hub's cache yet
    rendering, release = threading.Event(), threading.Event()
    renders: list[str] = []
    real = render.render_markdown

    def held(text: str) -> str:
        if text == readme:
            renders.append(text)
            rendering.set()
            release.wait(TIMEOUT)
        return real(text)

    monkeypatch.setattr(render, "render_markdown", held)
    with hub.client(who) as c:
        artifact(c, repo, b"a layer", tag="v1")
        r = c.put(f"/api/v1/readme/{repo}", json={"readme": readme})
        assert r.status_code in (200, 201), r.text
    hub.public(repo)
    answers: list[int] = []

    def view() -> None:
        with hub.client() as c:
            answers.append(c.get(f"/{repo}").status_code)

    viewer = threading.Thread(target=view)
    viewer.start()
    try:
        assert rendering.wait(TIMEOUT), "the README was never rendered"
        # Rendered on the event loop, the held render would keep this from being answered.
        with httpx.Client(base_url=hub.url, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
        assert viewer.is_alive(), "the view did not wait for its README"
    finally:
        release.set()
    viewer.join(TIMEOUT)
    assert answers == [200]
    with hub.client() as c:
        page = c.get(f"/{repo}")
        assert page.status_code == 200
        assert "[[[[" in page.text
    assert len(renders) == 1, "the README was rendered again for the second view"


def test_a_token_name_past_its_column_is_refused_not_cut(hub: HubServer) -> None:
    """Before: ``POST /api/v1/tokens`` stored a name of any length cut to its first 64
    characters without a word (two names differing past there became one; the list and
    the audit log showed another name than the one sent), where the UI's form has
    refused such a field since review 15. Now 400 naming the field, nothing made."""
    who = hub.add_user(unique_name("longname"))
    with hub.client(who) as c:
        r = c.post("/api/v1/tokens", json={"name": "n" * 65, "scopes": [f"{who[0]}:pull"]})
        assert r.status_code == 400, r.text
        assert "name" in r.text
        assert c.get("/api/v1/tokens").json() == []
        r = c.post("/api/v1/tokens", json={"name": "n" * 64, "scopes": [f"{who[0]}:pull"]})
        assert r.status_code == 201, r.text
        assert r.json()["name"] == "n" * 64
