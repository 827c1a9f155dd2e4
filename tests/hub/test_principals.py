"""Principals that stay gone: removed users, revoked tokens and changed passwords never
come back through an old session cookie, bearer token or cached credential, and ids are
never handed out twice (issue 10, item 1)."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import httpx
from hub_support import TIMEOUT, HubServer, artifact

SIGNIN = "/-/signin"
TOKENS = "/-/settings/tokens"


def _db(hub: HubServer) -> sqlite3.Connection:
    return sqlite3.connect(hub.data_dir / "hub.db")


def _id_of(hub: HubServer, table: str, where: str, *args: object) -> int:
    with _db(hub) as db:
        row = db.execute(f"SELECT id FROM {table} WHERE {where}", args).fetchone()
    assert row is not None, (table, where, args)
    return int(row[0])


def _reuse_id(hub: HubServer, table: str, new_id: int, old_id: int) -> None:
    """Give a row the id of a removed one, as SQLite did before AUTOINCREMENT (and may
    still do once for ids deleted before migration 0006). Foreign keys off: the
    dependants are moved along by hand."""
    with _db(hub) as db:
        if table == "users":
            for dependant in ("memberships", "team_members", "api_tokens", "ui_sessions"):
                db.execute(f"UPDATE {dependant} SET user_id=? WHERE user_id=?", (old_id, new_id))
        db.execute(f"UPDATE {table} SET id=? WHERE id=?", (old_id, new_id))


def _field(html: str, name: str) -> str:
    found = re.search(rf'name="{name}" value="([^"]*)"', html)
    assert found, f"no field {name}"
    return found.group(1)


def _sign_in(c: httpx.Client, who: tuple[str, str]) -> str:
    token = _field(c.get(SIGNIN).text, "login_csrf")
    resp = c.post(SIGNIN, data={"login_csrf": token, "username": who[0], "password": who[1]})
    assert resp.status_code == 303, resp.text
    return c.cookies["forkd_session"]


def _signed_in_as(hub: HubServer, cookie: str) -> str:
    """The user name the page header shows for ``cookie`` ("" when signed out)."""
    with httpx.Client(base_url=hub.url, cookies={"forkd_session": cookie}, timeout=TIMEOUT) as c:
        page = c.get(TOKENS, follow_redirects=False)
    if page.status_code == 303:
        return ""
    assert page.status_code == 200, page.text
    found = re.search(r'data-testid="me">([^<]+)<', page.text)
    return found.group(1).strip() if found else "?"


def _bearer(hub: HubServer, who: tuple[str, str], scope: str) -> str:
    with hub.client(who) as c:
        resp = c.get("/token", params={"service": "forkd-hub", "scope": scope})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["token"])


def test_ids_are_never_handed_out_again(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    hub.add_user("dave")
    dave = _id_of(hub, "users", "name=?", "dave")
    first_token = hub.token("dave", "dave:pull")
    token_id = _id_of(hub, "api_tokens", "user_id=?", dave)
    hub.cli("token", "revoke", str(token_id))
    hub.cli("user", "remove", "dave")
    hub.add_user("erin")
    assert _id_of(hub, "users", "name=?", "erin") > dave
    hub.token("erin", "erin:pull")
    erin = _id_of(hub, "users", "name=?", "erin")
    assert _id_of(hub, "api_tokens", "user_id=?", erin) > token_id
    with hub.client(("erin", first_token)) as c:
        assert c.get("/v2/").status_code == 401


def test_a_removed_user_does_not_come_back_as_the_next_one(fresh_hub: HubServer) -> None:
    """The review's case: dave is removed, erin made a site admin with dave's id."""
    hub = fresh_hub
    dave = hub.add_user("dave")
    with hub.client(dave) as c:
        artifact(c, "dave/app", b"dave's layer", tag="v1")
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as browser:
        cookie = _sign_in(browser, dave)
    assert _signed_in_as(hub, cookie) == "dave"
    bearer = _bearer(hub, dave, "repository:dave/app:pull,push,delete")
    with hub.client(dave) as c:  # dave's password is now in the verified-credential cache
        assert c.get("/v2/dave/app/tags/list").status_code == 200
    old_id = _id_of(hub, "users", "name=?", "dave")
    hub.cli("user", "remove", "dave")
    hub.cli("user", "add", "erin", "--admin", "--password-stdin", input="erin-password-1\n")
    _reuse_id(hub, "users", _id_of(hub, "users", "name=?", "erin"), old_id)

    assert _signed_in_as(hub, cookie) == ""
    with hub.client(dave) as c:
        assert c.get("/api/v1/users").status_code == 401
    with hub.client() as c:
        auth = {"Authorization": f"Bearer {bearer}"}
        assert c.get("/v2/dave/app/tags/list", headers=auth).status_code == 401
        assert c.delete("/v2/dave/app/manifests/v1", headers=auth).status_code == 401
    with hub.client(("erin", "erin-password-1")) as c:  # erin herself is fine
        assert c.get("/api/v1/users").status_code == 200


def test_a_revoked_token_does_not_come_back_through_a_reused_id(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    hub.add_user("frank")
    old = hub.token("frank", "frank:push")
    old_id = _id_of(hub, "api_tokens", "name=?", "cli")
    bearer = _bearer(hub, ("frank", old), "repository:frank/app:pull,push")
    with hub.client(("frank", old)) as c:
        assert c.get("/v2/").status_code == 200
    hub.cli("token", "revoke", str(old_id))
    hub.token("frank", "frank:push")
    newest = max(_id_of(hub, "api_tokens", "id>?", old_id), old_id)
    _reuse_id(hub, "api_tokens", newest, old_id)
    with hub.client() as c:
        resp = c.get("/v2/frank/app/tags/list", headers={"Authorization": f"Bearer {bearer}"})
        assert resp.status_code == 401
    with hub.client(("frank", old)) as c:
        assert c.get("/v2/").status_code == 401


def test_a_password_change_ends_sessions_and_bearers(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    gina = hub.add_user("gina")
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as browser:
        cookie = _sign_in(browser, gina)
    bearer = _bearer(hub, gina, "repository:gina/app:pull,push")
    with hub.client(gina) as c:
        assert c.get("/v2/").status_code == 200  # cached
    hub.cli("user", "passwd", "gina", "--password-stdin", input="gina-password-2\n")
    assert _signed_in_as(hub, cookie) == ""
    with hub.client() as c:
        resp = c.get("/v2/gina/app/tags/list", headers={"Authorization": f"Bearer {bearer}"})
        assert resp.status_code == 401
    with hub.client(gina) as c:
        assert c.get("/v2/").status_code == 401
    with hub.client(("gina", "gina-password-2")) as c:
        assert c.get("/v2/").status_code == 200


def test_sign_out_ends_the_session_on_the_server(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    hana = hub.add_user("hana")
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as browser:
        cookie = _sign_in(browser, hana)
        copied = cookie  # what an attacker lifted from the browser
        csrf = _field(browser.get("/").text, "csrf")
        assert browser.post("/-/signout", data={"csrf": csrf}).status_code == 303
    assert _signed_in_as(hub, copied) == ""
    # Signing in again opens a new session; the old cookie stays dead.
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as browser:
        again = _sign_in(browser, hana)
    assert again != copied
    assert _signed_in_as(hub, again) == "hana" and _signed_in_as(hub, copied) == ""


def test_removing_a_token_ends_the_ui_sessions_opened_with_it(fresh_hub: HubServer) -> None:
    hub = fresh_hub
    hub.add_user("ivan")
    secret = hub.token("ivan", "ivan:pull")
    with httpx.Client(base_url=hub.url, timeout=TIMEOUT) as browser:
        cookie = _sign_in(browser, ("ivan", secret))
    assert _signed_in_as(hub, cookie) == "ivan"
    hub.cli("token", "revoke", str(_id_of(hub, "api_tokens", "name=?", "cli")))
    assert _signed_in_as(hub, cookie) == ""


def test_migration_0006_keeps_data_and_stops_reuse(tmp_path: Path) -> None:
    """A database made at 0005 keeps every row through the table rebuilds (foreign keys
    off: nothing cascades), and from then on ids are not reused."""
    server = HubServer(tmp_path / "hub")
    server.cli("migrate", "--revision", "0005")
    with sqlite3.connect(tmp_path / "hub" / "hub.db") as db:
        db.execute(
            "INSERT INTO users (id, name, is_admin, is_robot, created_at) "
            "VALUES (1, 'old', 0, 0, '2026-01-01'), (2, 'gone', 0, 0, '2026-01-01')"
        )
        db.execute(
            "INSERT INTO namespaces (id, name, kind, created_at) VALUES (1, 'old', 'user', "
            "'2026-01-01')"
        )
        db.execute("INSERT INTO memberships VALUES (1, 1, 'admin')")
    server.cli("migrate")
    with sqlite3.connect(tmp_path / "hub" / "hub.db") as db:
        assert db.execute("SELECT namespace_id, user_id, role FROM memberships").fetchall() == [
            (1, 1, "admin")
        ]
        stamps = db.execute("SELECT stamp FROM users ORDER BY id").fetchall()
        assert len({s for (s,) in stamps}) == 2 and all(len(s) == 32 for (s,) in stamps)
        db.execute("PRAGMA foreign_keys=ON")
        db.execute("DELETE FROM users WHERE id=2")
        db.execute(
            "INSERT INTO users (name, is_admin, is_robot, stamp, created_at) "
            "VALUES ('new', 0, 0, 'x', '2026-01-01')"
        )
        (new_id,) = db.execute("SELECT id FROM users WHERE name='new'").fetchone()
    assert new_id == 3
