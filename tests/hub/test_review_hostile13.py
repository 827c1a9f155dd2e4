"""Hostile review 13: the audit log names an account by its id as well as its name.

A user removed and a new one given the same name were the same ``actor`` in the audit
log: what the first did read as the second's. Every record whose actor is an account now
carries ``actor_id``, the account's id, which no later account gets (ids are never reused:
``models.NO_REUSE``). Records of a name that is not an account (a refused login, the
retention rule) carry none.
"""

from __future__ import annotations

import httpx
from hub_server import HubServer
from hub_support import (
    audit_log,
    browser,
    csrf_of,
    org_with_pusher,
    unique_name,
)


def test_a_removed_user_and_a_robot_given_its_name_are_two_actors(hub: HubServer) -> None:
    """An account acts, is removed; an organisation's admin makes a robot of the same name
    (the name is free again), which acts too: two actors of one name, two ids. (Since
    review 25 a person's name stays its namespace's after its removal, and a robot made
    in the UI is named ``ORG+NAME``: the account removed here is a robot of that name.)"""
    org, alice, _bob = org_with_pusher(hub)
    name = f"{org}+{unique_name('reborn')}"
    hub.cli("user", "add", name, "--robot")
    hub.cli("org", "member", org, name, "pull")
    with hub.client((name, hub.token(name, f"{org}:pull"))) as c:  # refused, and audited
        assert c.post(f"/v2/{org}/app/blobs/uploads/").status_code in (401, 403)
    hub.cli("user", "remove", name)
    with browser(hub, *alice) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        r = b.post("/-/settings/robots",
                   data={"csrf": csrf, "namespace": org, "robot": name, "role": "pull"})
        assert r.status_code == 303, r.text  # to the token, shown once
    robot = (name, hub.token(name, f"{org}:pull"))
    with hub.client(robot) as c:  # pull only: a push is refused, and audited
        assert c.post(f"/v2/{org}/app/blobs/uploads/").status_code in (401, 403)
    acted = [e for e in audit_log(hub) if e["actor"] == name]
    ids = {e.get("actor_id") for e in acted}
    assert len(ids) == 2 and None not in ids, acted


def test_a_name_that_is_no_account_has_no_actor_id(hub: HubServer) -> None:
    name = unique_name("nobody")
    with httpx.Client(base_url=hub.url, auth=(name, "not-a-password-1")) as c:
        assert c.get("/api/v1/tokens").status_code == 401
    refused = [e for e in audit_log(hub) if e["action"] == "login" and e["actor"] == name]
    assert refused and all("actor_id" not in e for e in refused), refused
