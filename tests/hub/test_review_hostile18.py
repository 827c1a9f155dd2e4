"""Hostile review 18: what two requests at once make of the hub, and whose a robot is.

- Creations of one name at once (PostgreSQL). Each create path asked whether the name was
  free, then inserted: under READ COMMITTED two requests both found it free and the
  second's insert broke the unique key, a 500 and an ERROR with a traceback in the log.
  Any two users could make it happen at will (both create organisation ``acme``), and so
  could two admins creating one team, adding one member, or two organisations' admins
  making robots of one name in the UI (the robot form's error page was the 500 page).
  Now a unique or foreign key another transaction won is ``ConcurrentChange``
  (hub/db.py), wherever the write runs (``transaction`` and ``write``): 409 saying what
  happened on the JSON routes and the registry's, the form's own refusal in the UI.
- A robot's tokens were managed by whoever administered every namespace the robot was a
  direct member of; its team places did not count. A robot that pushes to one
  organisation through a team and is a member of another was the second's admins' to
  manage alone: they listed its tokens (names, scopes) and revoked the ones the first
  organisation's pipelines push with, or minted it tokens. Now a team place counts as a
  membership does (``authz.robot_namespaces``): the robot's managers administer both,
  on every surface that asks (the token page and its revocation, the robot form, the
  member and team routes), and a robot placed only through a team is listed to those
  who administer its team's organisation.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from hub_server import ADMIN, TIMEOUT, HubServer
from hub_support import browser, csrf_of, push_blob, unique_name

RACERS = 8  # requests sent at once for one name
ROUNDS = 3  # names raced for, each a new chance for the race to happen

Call = Callable[[httpx.Client], httpx.Response]


@pytest.fixture
def pg_hub(postgres_url: str, tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"database_url": postgres_url}).start()
    try:
        yield server
    finally:
        server.stop()


def _at_once(server: HubServer, calls: list[Call]) -> Counter[int]:
    """The statuses of ``calls``, each from its own thread and connection, released
    together."""
    clients = [httpx.Client(base_url=server.url, timeout=TIMEOUT) for _ in calls]
    for c in clients:  # connected before the start: the requests leave together
        assert c.get("/healthz").status_code == 200
    start = threading.Barrier(len(calls))
    statuses: list[int] = []

    def run(call: Call, client: httpx.Client) -> None:
        start.wait()
        statuses.append(call(client).status_code)

    threads = [threading.Thread(target=run, args=pair) for pair in zip(calls, clients, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return Counter(statuses)


def _one_created(statuses: Counter[int]) -> None:
    assert statuses == Counter({201: 1, 409: RACERS - 1}), statuses


def _org_with_admins(server: HubServer, org: str, count: int) -> list[tuple[str, str]]:
    """A new organisation ``org`` and ``count`` new users who administer it."""
    owner = server.add_user(unique_name("owner"))
    admins = [server.add_user(unique_name("admin")) for _ in range(count)]
    with server.client(owner) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        for name, _ in admins:
            r = c.put(f"/api/v1/orgs/{org}/members/{name}", json={"role": "admin"})
            assert r.status_code == 204, r.text
    return admins


def test_organisations_of_one_name_created_at_once_are_one_201_and_409s(
    pg_hub: HubServer,
) -> None:
    users = [pg_hub.add_user(f"racer{i}") for i in range(RACERS)]
    for round_ in range(ROUNDS):
        name = f"contested{round_}"
        calls: list[Call] = [
            lambda c, who=who, name=name: c.post("/api/v1/orgs", json={"name": name}, auth=who)
            for who in users
        ]
        _one_created(_at_once(pg_hub, calls))


def test_teams_of_one_name_created_at_once_are_one_201_and_409s(pg_hub: HubServer) -> None:
    admins = [name for name, _ in _org_with_admins(pg_hub, "teamed", RACERS)]
    # Several admins (one account's requests take turns on its row), each with an API
    # token over Basic: a hash, not a password's argon2, stands between the start and
    # the transaction, so the requests reach the database together.
    who = [(name, pg_hub.token(name, "teamed:admin")) for name in admins]
    for round_ in range(ROUNDS):
        body = {"name": f"crew{round_}", "role": "pull"}
        calls: list[Call] = [
            lambda c, auth=auth, body=body: c.post(
                "/api/v1/orgs/teamed/teams", json=body, auth=auth
            )
            for auth in who
        ]
        _one_created(_at_once(pg_hub, calls))


def test_members_added_at_once_by_several_admins_are_never_a_500(pg_hub: HubServer) -> None:
    admins = _org_with_admins(pg_hub, "crowded", RACERS)
    who = [(name, pg_hub.token(name, "crowded:admin")) for name, _ in admins]
    for round_ in range(ROUNDS):
        newcomer = pg_hub.add_user(f"newcomer{round_}")[0]
        calls: list[Call] = [
            lambda c, auth=auth, newcomer=newcomer: c.put(
                f"/api/v1/orgs/crowded/members/{newcomer}", json={"role": "admin"}, auth=auth
            )
            for auth in who
        ]
        statuses = _at_once(pg_hub, calls)
        assert statuses[204] >= 1 and set(statuses) <= {204, 409}, statuses


def test_robots_of_one_name_made_at_once_in_the_ui_are_one_and_refusals(
    pg_hub: HubServer,
) -> None:
    """Admins of one organisation make its robot of one name at once (since review 25 a
    robot made in the UI is named ``ORG+NAME``, so two organisations never contest one):
    one makes it, the others place it or are refused, none is a 500."""
    admins = _org_with_admins(pg_hub, "yard", RACERS)
    with ExitStack() as stack:
        signed_in = [stack.enter_context(browser(pg_hub, *who)) for who in admins]
        forms = [csrf_of(b.get("/-/settings/tokens").text) for b in signed_in]
        for round_ in range(ROUNDS):
            robot = f"shared-bot{round_}"
            calls: list[Call] = [
                lambda _c, b=b, csrf=csrf, robot=robot: b.post(
                    "/-/settings/robots",
                    data={"csrf": csrf, "namespace": "yard", "robot": robot, "role": "pull"},
                )
                for b, csrf in zip(signed_in, forms, strict=True)
            ]
            statuses = _at_once(pg_hub, calls)
            assert statuses[303] >= 1 and set(statuses) <= {303, 400}, statuses


def test_a_robot_placed_in_a_team_is_not_managed_by_another_namespaces_admins_alone(
    hub: HubServer,
) -> None:
    north, south, robot = unique_name("north"), unique_name("south"), unique_name("courier")
    bob = hub.add_user(unique_name("bob"))
    with hub.client(ADMIN) as c:
        for org in (north, south):
            assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        r = c.put(f"/api/v1/orgs/{north}/members/{bob[0]}", json={"role": "admin"})
        assert r.status_code == 204, r.text
        assert c.post("/api/v1/users", json={"name": robot, "robot": True}).status_code == 201
        r = c.put(f"/api/v1/orgs/{north}/members/{robot}", json={"role": "pull"})
        assert r.status_code == 204, r.text
        team = {"name": "couriers", "role": "push", "members": [robot]}
        assert c.post(f"/api/v1/orgs/{south}/teams", json=team).status_code == 201
    # south's pipeline token: the robot pushes to south through its team place.
    secret = hub.token(robot, f"{south}:push")
    listed = re.search(r"^(\d+)\s", hub.cli("token", "list", "--user", robot), re.M)
    assert listed
    token_id = int(listed.group(1))
    with hub.client((robot, secret)) as c:
        push_blob(c, f"{south}/app", b"before")

    with browser(hub, *bob) as b:  # north's admin, not south's
        page = b.get("/-/settings/tokens").text
        assert f"robot-tokens-{robot}" not in page
        assert f"{south}:push" not in page
        r = b.post(f"/-/settings/tokens/{token_id}/revoke", data={"csrf": csrf_of(page)})
        assert r.status_code == 404
        mint = {"csrf": csrf_of(page), "namespace": north, "robot": robot, "role": "push"}
        r = b.post("/-/settings/robots", data=mint)
        assert r.status_code == 400 and "do not administer" in r.text
    with hub.client((robot, secret)) as c:
        push_blob(c, f"{south}/app", b"after")

    carol = hub.add_user(unique_name("carol"))  # administers both: manages the robot
    with hub.client(ADMIN) as c:
        for org in (north, south):
            r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "admin"})
            assert r.status_code == 204, r.text
    with browser(hub, *carol) as b:
        page = b.get("/-/settings/tokens").text
        assert f"robot-tokens-{robot}" in page
