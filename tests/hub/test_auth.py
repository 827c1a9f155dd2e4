"""Auth: the registry token flow, scopes, private repositories, robots, rate limits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hub_support import ADMIN, HubServer, artifact, error_code, http, push_blob, sha
from litestar.testing import TestClient

from forkd.hub.app import create_app
from forkd.hub.settings import HubSettings


def test_v2_challenges_anonymous_with_bearer_realm(hub: HubServer) -> None:
    r = http.get(f"{hub.url}/v2/")
    assert r.status_code == 401
    assert error_code(r) == "UNAUTHORIZED"
    challenge = r.headers["www-authenticate"]
    assert challenge.startswith("Bearer ")
    assert f'realm="{hub.url}/token"' in challenge
    assert 'service="forkd-hub"' in challenge


def test_token_flow_with_basic_credentials(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/app"
    r = http.get(
        f"{hub.url}/token",
        params={"service": "forkd-hub", "scope": f"repository:{name}:pull,push"},
        auth=user,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["token"] == body["access_token"] and body["expires_in"] > 0
    bearer = {"Authorization": f"Bearer {body['token']}"}
    assert http.get(f"{hub.url}/v2/", headers=bearer).status_code == 200
    data = b"pushed with a bearer token"
    r = http.post(
        f"{hub.url}/v2/{name}/blobs/uploads/",
        params={"digest": sha(data)},
        content=data,
        headers=bearer,
    )
    assert r.status_code == 201, r.text
    # A token for another repository does not carry over: the client is asked for that scope.
    r = http.get(f"{hub.url}/v2/{user[0]}/other/tags/list", headers=bearer)
    assert r.status_code == 403 and error_code(r) == "DENIED"
    assert 'scope="repository:' in r.headers["www-authenticate"]
    assert "insufficient_scope" in r.headers["www-authenticate"]


def test_bad_password_and_bad_tokens_are_refused(hub: HubServer, user: tuple[str, str]) -> None:
    assert http.get(f"{hub.url}/token", auth=(user[0], "wrong-password")).status_code == 401
    assert http.get(f"{hub.url}/v2/", auth=(user[0], "wrong-password")).status_code == 401
    forged = {"Authorization": "Bearer fkb.eyJzdWIiOjF9.AAAA"}
    r = http.get(f"{hub.url}/v2/", headers=forged)
    assert r.status_code == 401 and "invalid_token" in r.headers["www-authenticate"]
    r = http.get(f"{hub.url}/v2/", headers={"Authorization": "Digest x"})
    assert r.status_code == 401


def test_failed_logins_are_rate_limited(fresh_hub: HubServer) -> None:
    name, password = fresh_hub.add_user("victim")
    for _ in range(3):
        assert http.get(f"{fresh_hub.url}/token", auth=(name, "guess-1234")).status_code == 401
    r = http.get(f"{fresh_hub.url}/token", auth=(name, password))
    assert r.status_code == 429
    assert error_code(r) == "TOOMANYREQUESTS" and int(r.headers["retry-after"]) > 0


def test_push_without_scope_is_refused(hub: HubServer, user: tuple[str, str]) -> None:
    other = hub.add_user(f"{user[0]}x")
    data = b"not yours"
    with hub.client(auth=other) as c:
        r = c.post(f"/v2/{user[0]}/app/blobs/uploads/", params={"digest": sha(data)}, content=data)
    assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN"
    r = http.post(f"{hub.url}/v2/{user[0]}/app/blobs/uploads/")
    assert r.status_code == 401  # anonymous: asked to log in
    assert f'scope="repository:{user[0]}/app:pull,push"' in r.headers["www-authenticate"]


def test_private_repository_is_invisible_public_is_pullable(
    hub: HubServer, user: tuple[str, str]
) -> None:
    name = f"{user[0]}/secret"
    with hub.client(auth=user) as c:
        digest, body = artifact(c, name, b"private bytes", tag="v1")
    stranger = hub.add_user(f"{user[0]}s")
    with hub.client(auth=stranger) as c:
        for path in ("manifests/v1", f"manifests/{digest}", "tags/list"):
            r = c.get(f"/v2/{name}/{path}")
            assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN", path
    assert http.get(f"{hub.url}/v2/{name}/manifests/v1").status_code == 401
    anon_token = http.get(f"{hub.url}/token", params={"scope": f"repository:{name}:pull"}).json()[
        "token"
    ]
    r = http.get(
        f"{hub.url}/v2/{name}/manifests/v1", headers={"Authorization": f"Bearer {anon_token}"}
    )
    assert r.status_code == 401

    hub.public(name)
    r = http.get(f"{hub.url}/v2/{name}/manifests/v1")  # anonymous, no token at all
    assert r.status_code == 200 and r.content == body
    anon_token = http.get(
        f"{hub.url}/token", params={"scope": f"repository:{name}:pull,push"}
    ).json()["token"]
    bearer = {"Authorization": f"Bearer {anon_token}"}
    assert http.get(f"{hub.url}/v2/{name}/manifests/v1", headers=bearer).status_code == 200
    r = http.post(f"{hub.url}/v2/{name}/blobs/uploads/", headers=bearer)
    assert r.status_code == 401  # anonymous push: never granted
    with hub.client(auth=stranger) as c:
        assert c.get(f"/v2/{name}/manifests/v1").status_code == 200
        r = c.post(f"/v2/{name}/blobs/uploads/")
        assert r.status_code == 403 and error_code(r) == "DENIED"
        r = c.delete(f"/v2/{name}/manifests/v1")
        assert r.status_code == 403


def test_api_tokens_narrow_to_their_scopes(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/app"
    pull_only = hub.token(user[0], f"{user[0]}:pull")
    push = hub.token(user[0], f"{user[0]}:push")
    assert pull_only.startswith("fkd_") and push.startswith("fkd_")
    data = b"token scoped"
    with hub.client(auth=(user[0], push)) as c:
        push_blob(c, name, data)
        assert c.head(f"/v2/{name}/blobs/{sha(data)}").status_code == 200
        r = c.delete(f"/v2/{name}/blobs/{sha(data)}")
        assert r.status_code == 403  # push scope does not include delete
    with hub.client(auth=(user[0], pull_only)) as c:
        assert c.head(f"/v2/{name}/blobs/{sha(data)}").status_code == 200
        r = c.post(f"/v2/{name}/blobs/uploads/")
        assert r.status_code == 403 and error_code(r) == "DENIED"
    # A token works only with its own user name.
    other = hub.add_user(f"{user[0]}t")
    assert http.get(f"{hub.url}/v2/", auth=(other[0], push)).status_code == 401
    # Through the token endpoint, the scope is capped the same way.
    r = http.get(
        f"{hub.url}/token",
        params={"scope": f"repository:{name}:pull,push"},
        auth=(user[0], pull_only),
    )
    assert r.status_code == 200
    bearer = {"Authorization": f"Bearer {r.json()['token']}"}
    r = http.post(f"{hub.url}/v2/{name}/blobs/uploads/", headers=bearer)
    assert r.status_code == 403


def test_revoked_tokens_and_removed_users_stop_working_at_once(
    hub: HubServer, user: tuple[str, str]
) -> None:
    token = hub.token(user[0], f"{user[0]}:push")
    bearer = http.get(f"{hub.url}/token", auth=(user[0], token)).json()["token"]
    assert http.get(f"{hub.url}/v2/", auth=(user[0], token)).status_code == 200
    token_id = hub.cli("token", "list", "--user", user[0]).split("\t", 1)[0]
    hub.cli("token", "revoke", token_id)
    assert http.get(f"{hub.url}/v2/", auth=(user[0], token)).status_code == 401
    r = http.get(f"{hub.url}/v2/", headers={"Authorization": f"Bearer {bearer}"})
    assert r.status_code == 401  # the bearer token obtained with it died too

    assert http.get(f"{hub.url}/v2/", auth=user).status_code == 200
    hub.cli("user", "remove", user[0])
    assert http.get(f"{hub.url}/v2/", auth=user).status_code == 401  # despite the login cache


def test_robot_in_organisation_pushes_with_token(hub: HubServer, user: tuple[str, str]) -> None:
    org = f"org{user[0].replace('-', '')}"
    robot = f"{user[0]}-ci"
    hub.cli("user", "add", robot, "--robot")
    hub.cli("org", "add", org, "--member", f"{robot}=push", "--member", f"{user[0]}=pull")
    token = hub.token(robot, f"{org}:push")
    with hub.client(auth=(robot, token)) as c:
        artifact(c, f"{org}/pack", b"from ci", tag="latest")
    with hub.client(auth=user) as c:
        assert c.get(f"/v2/{org}/pack/manifests/latest").status_code == 200
        assert c.post(f"/v2/{org}/pack/blobs/uploads/").status_code == 403
    # A robot has no password to log in with.
    assert http.get(f"{hub.url}/token", auth=(robot, "")).status_code == 401


def test_admin_created_on_first_start_can_do_anything(hub: HubServer) -> None:
    with hub.client(auth=ADMIN) as c:
        assert c.get("/v2/").status_code == 200
        digest, _ = artifact(c, "library/base", b"admin push", tag="v1")
        assert c.delete(f"/v2/library/base/manifests/{digest}").status_code == 202


def test_generated_admin_password_is_printed_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    settings = HubSettings(tmp_path / "hub")  # no FORKD_HUB_ADMIN_* given
    with TestClient(create_app(settings)):
        pass
    m = re.search(r"created admin user 'admin' with password (\S+)", capfd.readouterr().err)
    assert m
    with TestClient(create_app(settings)) as c:  # second start: no new admin, same password
        assert c.get("/v2/", auth=("admin", m.group(1))).status_code == 200
    assert "created admin" not in capfd.readouterr().err
