"""Login CSRF and Post/Redirect/Get on the UI's forms, with plain httpx (and one browser
check), against a hub of their own: a forged sign-in must not count as a failed login,
and these tests try many."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ui_support import TIMEOUT, HubServer

CAROL = ("carol", "carol-password-1")
LIMIT = 3  # failed sign-ins before the limiter answers 429
SIGNIN = "/-/signin"
TOKENS = "/-/settings/tokens"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    server = HubServer(
        tmp_path_factory.mktemp("forms") / "hub", overrides={"login_fail_limit": LIMIT}
    ).start()
    try:
        server.add_user(*CAROL)
        yield server
    finally:
        server.stop()


def field(html: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no field {name}"
    return found.group(1)


def set_cookie(resp: httpx.Response, name: str) -> str:
    """The Set-Cookie header for ``name`` in ``resp`` ("" when there is none)."""
    return next((h for h in resp.headers.get_list("set-cookie") if h.startswith(f"{name}=")), "")


def form_pair(hub: HubServer) -> tuple[str, str]:
    """(login cookie, form field) of a fresh GET of the sign-in page."""
    with hub.client() as c:
        page = c.get(SIGNIN)
        return c.cookies["forkd_login"], field(page.text, "login_csrf")


def sign_in(c: httpx.Client, who: tuple[str, str] = CAROL) -> httpx.Response:
    token = field(c.get(SIGNIN).text, "login_csrf")
    return c.post(SIGNIN, data={"login_csrf": token, "username": who[0], "password": who[1]})


def assert_refused(resp: httpx.Response) -> None:
    assert resp.status_code == 403
    assert 'data-testid="error"' in resp.text and "sign-in form expired" in resp.text
    assert not set_cookie(resp, "forkd_session")


def test_signin_page_sets_a_login_csrf_cookie(hub: HubServer) -> None:
    with hub.client() as c:
        resp = c.get(SIGNIN)
    header = set_cookie(resp, "forkd_login").lower()
    for attribute in ("httponly", "samesite=strict", "path=/-/signin", "max-age=1800"):
        assert attribute in header
    assert "secure" not in header  # plain http here, as the session cookie
    assert resp.headers["cache-control"] == "no-store"
    nonce = resp.cookies["forkd_login"]
    assert re.fullmatch(r"[0-9]+\.[A-Za-z0-9_-]{24}", nonce)
    assert re.fullmatch(r"[0-9a-f]{32}", field(resp.text, "login_csrf"))  # its HMAC


def test_forged_signins_are_refused_and_not_counted(hub: HubServer) -> None:
    mine_cookie, mine_field = form_pair(hub)
    theirs_cookie, theirs_field = form_pair(hub)
    forged: list[tuple[dict[str, str], dict[str, str]]] = [
        ({}, {}),  # no cookie, no field: a plain cross-site form
        ({}, {"login_csrf": theirs_field}),  # the attacker's own field, no cookie
        ({"forkd_login": mine_cookie}, {}),
        ({"forkd_login": mine_cookie}, {"login_csrf": "0" * 32}),
        ({"forkd_login": mine_cookie}, {"login_csrf": theirs_field}),  # another pair's field
        ({"forkd_login": mine_cookie}, {"login_csrf": mine_field + "x"}),
        ({"forkd_login": "9" + mine_cookie}, {"login_csrf": mine_field}),
        ({"forkd_login": mine_cookie}, {"login_csrf": "é" * 32}),
    ]
    for password in (CAROL[1], "wrong-password"):
        for cookies, data in forged:
            with httpx.Client(base_url=hub.url, cookies=cookies, timeout=TIMEOUT) as c:
                resp = c.post(SIGNIN, data={**data, "username": CAROL[0], "password": password})
                assert_refused(resp)
                assert "forkd_session" not in c.cookies
    # 8 refusals with a wrong password, yet the limiter (LIMIT) counted none of them.
    with hub.client() as c:
        first = field(c.get(SIGNIN).text, "login_csrf")
        failed = c.post(
            SIGNIN, data={"login_csrf": first, "username": CAROL[0], "password": "wrong"}
        )
        assert failed.status_code == 401 and "Wrong user name or password" in failed.text
        # The page of the failure comes with a new pair: the old field no longer matches.
        resp = c.post(
            SIGNIN, data={"login_csrf": first, "username": CAROL[0], "password": CAROL[1]}
        )
        assert_refused(resp)
        again = field(failed.text, "login_csrf")
        resp = c.post(
            SIGNIN, data={"login_csrf": again, "username": CAROL[0], "password": CAROL[1]}
        )
        assert resp.status_code == 303, resp.text
        session = set_cookie(resp, "forkd_session").lower()
        assert "httponly" in session and "samesite=lax" in session
        # The login cookie is spent with the sign-in.
        assert set_cookie(resp, "forkd_login").startswith('forkd_login="";')
        assert "Sign out" in c.get("/").text
    # The other pair still works, for the browser that holds its cookie.
    with httpx.Client(
        base_url=hub.url, cookies={"forkd_login": theirs_cookie}, timeout=TIMEOUT
    ) as c:
        resp = c.post(
            SIGNIN, data={"login_csrf": theirs_field, "username": CAROL[0], "password": CAROL[1]}
        )
        assert resp.status_code == 303 and "forkd_session" in c.cookies


def test_signout_needs_the_csrf_token(hub: HubServer) -> None:
    with hub.client() as c:
        assert sign_in(c).status_code == 303
        assert c.post("/-/signout", data={}).status_code == 403
        assert c.post("/-/signout", data={"csrf": "x"}).status_code == 403
        assert "Sign out" in c.get("/").text  # still signed in
        resp = c.post("/-/signout", data={"csrf": field(c.get("/").text, "csrf")})
        assert resp.status_code == 303 and "forkd_session" not in c.cookies
    with hub.client() as c:  # nothing to sign out of: just cleared
        assert c.post("/-/signout", data={}).status_code == 303


def test_signout_clears_the_cookie_of_a_removed_user(hub: HubServer) -> None:
    who = hub.add_user("dave")
    with hub.client() as c:
        assert sign_in(c, who).status_code == 303
        hub.cli("user", "remove", "dave")
        assert "Sign out" not in c.get("/").text  # the session died with the user
        resp = c.post("/-/signout", data={})  # the page had no CSRF token to send
        assert resp.status_code == 303 and "forkd_session" not in c.cookies


def test_token_secret_crosses_the_redirect_once(hub: HubServer) -> None:
    with hub.client() as c, hub.client() as other:
        assert sign_in(c).status_code == 303
        assert sign_in(other).status_code == 303  # the same user, another session
        csrf = field(c.get(TOKENS).text, "csrf")
        resp = c.post(TOKENS, data={"csrf": csrf, "name": "ci", "scopes": "carol:pull"})
        assert resp.status_code == 303 and resp.headers["location"] == TOKENS
        header = set_cookie(resp, "forkd_new_token").lower()
        for attribute in ("httponly", "samesite=strict", "path=/-/settings/tokens"):
            assert attribute in header
        assert "max-age" not in header and "expires" not in header  # kept in memory only
        sealed = c.cookies["forkd_new_token"]

        # Another session of the same user is not shown the secret.
        other.cookies.set("forkd_new_token", sealed, path=TOKENS)
        page = other.get(TOKENS)
        assert 'data-testid="new-token"' not in page.text and "ci" in page.text

        page = c.get(TOKENS)
        assert page.status_code == 200 and page.headers["cache-control"] == "no-store"
        secret = re.search(r"fkd_[A-Za-z0-9_\-]+", page.text)
        assert secret and 'data-testid="new-token"' in page.text
        assert httpx.get(f"{hub.url}/v2/", auth=(CAROL[0], secret.group(0))).status_code == 200
        assert set_cookie(page, "forkd_new_token").startswith('forkd_new_token="";')
        again = c.get(TOKENS)
        assert 'data-testid="new-token"' not in again.text
        assert secret.group(0) not in again.text
        assert again.text.count("/revoke") == page.text.count("/revoke") == 1  # one token

        # A failed create is a page with the error (nothing was created), not a redirect.
        bad = c.post(
            TOKENS, data={"csrf": csrf, "name": "x", "scopes": "carol:pull", "expires_days": "0"}
        )
        assert bad.status_code == 400 and "expiry must be" in bad.text
        assert not set_cookie(bad, "forkd_new_token")


def test_cross_site_signin_in_the_browser(hub: HubServer, browser: Any, tmp_path: Path) -> None:
    """A page on another site that posts a sign-in form (with the attacker's own valid
    pair) does not sign the visitor in; the real form then still works."""
    attacker_cookie, attacker_field = form_pair(hub)
    del attacker_cookie  # the attacker cannot plant it in the visitor's browser
    context = browser.new_context()
    try:
        page = context.new_page()
        page.set_default_timeout(30_000)
        page.goto(hub.url + SIGNIN)  # the visitor has a login cookie of their own
        evil = f"""<!doctype html><form id=f method=post action="{hub.url}{SIGNIN}">
<input name=login_csrf value="{attacker_field}"><input name=username value="{CAROL[0]}">
<input name=password value="{CAROL[1]}"></form><script>f.submit()</script>"""
        page.route(
            "http://attacker.test/**",
            lambda route: route.fulfill(status=200, content_type="text/html", body=evil),
        )
        with page.expect_navigation(url=f"{hub.url}{SIGNIN}") as nav:
            page.goto("http://attacker.test/")
        assert nav.value.status == 403
        assert page.get_by_test_id("error").is_visible()
        assert "forkd_session" not in {c["name"] for c in context.cookies()}

        page.goto(f"{hub.url}{SIGNIN}?next=/carol")
        login = [c for c in context.cookies() if c["name"] == "forkd_login"]
        assert login and login[0]["httpOnly"] and login[0]["sameSite"] == "Strict"
        assert login[0]["path"] == SIGNIN
        page.fill("input[name=username]", CAROL[0])
        page.fill("input[name=password]", CAROL[1])
        page.click("form.stack button[type=submit]")
        page.wait_for_url(f"{hub.url}/carol")
        names = {c["name"] for c in context.cookies()}
        assert "forkd_session" in names and "forkd_login" not in names
        assert page.get_by_test_id("me").inner_text() == CAROL[0]
    finally:
        context.close()


def test_session_helpers_refuse_stale_or_foreign_values(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from forkd.hub.ui.session import LOGIN_TTL, NEW_TOKEN_TTL, Sessions

    sessions, other = Sessions(b"k" * 32), Sessions(b"j" * 32)
    nonce = sessions.login_nonce()
    token = sessions.login_csrf(nonce)
    assert sessions.check_login_csrf(nonce, token)
    assert not other.check_login_csrf(nonce, token)  # another hub's key
    assert not sessions.check_login_csrf("", token)
    assert not sessions.check_login_csrf(nonce, "")
    assert not sessions.check_login_csrf("\u00b2." + nonce.partition(".")[2], token)
    sealed = sessions.seal_new_token("session-a", "fkd_secret", "ci")
    assert sessions.open_new_token("session-a", sealed) == ("fkd_secret", "ci")
    assert sessions.open_new_token("session-b", sealed) is None
    flipped = sealed[:20] + ("A" if sealed[20] != "A" else "B") + sealed[21:]
    assert sessions.open_new_token("session-a", flipped) is None
    raw = base64.urlsafe_b64decode(sealed + "=" * (-len(sealed) % 4))
    assert b"fkd_secret" not in raw and b"ci" not in raw  # encrypted, not just signed
    assert other.open_new_token("session-a", sealed) is None
    assert sessions.open_new_token("", sealed) is None

    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + max(LOGIN_TTL, NEW_TOKEN_TTL) + 5)
    assert not sessions.check_login_csrf(nonce, token)
    assert sessions.open_new_token("session-a", sealed) is None
