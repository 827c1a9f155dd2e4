"""Names with a control character or a look-alike letter are refused by a running hub with
400 before anything is stored (issue 10 item 9): `$` in `re.match` accepted a trailing
newline, so `v1\\n` was stored as a tag and `acme/app\\n` created a ghost repository."""

from __future__ import annotations

import json

import pytest
from hub_support import (
    ADMIN,
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    error_code,
    push_blob,
    sha,
)

HOSTILE = ["%0A", "%0D", "%0D%0A", "%09", "%00", "%E2%80%A8", "%C2%85"]


def _manifest(client: object, repo: str) -> bytes:
    push_blob(client, repo, EMPTY_CONFIG)  # type: ignore[arg-type]
    layer = push_blob(client, repo, b"payload")  # type: ignore[arg-type]
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
            "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": 7}],
        }
    ).encode()


def _tags(hub: HubServer, who: tuple[str, str], repo: str) -> list[str]:
    with hub.client(who) as c:
        r = c.get(f"/v2/{repo}/tags/list")
        assert r.status_code == 200, r.text
        return list(r.json()["tags"] or [])


@pytest.mark.parametrize("suffix", HOSTILE)
def test_manifest_put_to_a_hostile_tag_is_400(
    hub: HubServer, user: tuple[str, str], suffix: str
) -> None:
    repo = f"{user[0]}/app"
    with hub.client(user) as c:
        body = _manifest(c, repo)
        r = c.put(
            f"/v2/{repo}/manifests/v1{suffix}",
            content=body,
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert r.status_code == 400, r.text
        assert (
            c.put(
                f"/v2/{repo}/manifests/v1", content=body, headers={"Content-Type": OCI_MANIFEST}
            ).status_code
            == 201
        )
    assert _tags(hub, user, repo) == ["v1"]


@pytest.mark.parametrize("suffix", [*HOSTILE, "%D0%B0"])  # the last: Cyrillic а
def test_manifest_put_to_a_hostile_repository_is_400_and_creates_nothing(
    hub: HubServer, user: tuple[str, str], suffix: str
) -> None:
    good = f"{user[0]}/app"
    with hub.client(user) as c:
        body = _manifest(c, good)
        ghost = f"{good}{suffix}"
        r = c.put(f"/v2/{ghost}/manifests/v1", content=body, headers={"Content-Type": OCI_MANIFEST})
        assert r.status_code == 400, r.text
        assert error_code(r) == "NAME_INVALID"
        r = c.post(f"/v2/{ghost}/blobs/uploads/", params={"digest": sha(b"x")}, content=b"x")
        assert r.status_code == 400, r.text
    with hub.client(ADMIN) as c:
        r = c.get("/v2/_catalog", params={"n": 10000})
        assert r.status_code == 200, r.text
        assert all(name.isascii() and name.isprintable() for name in r.json()["repositories"])


def test_hostile_digests_and_routes_are_refused(hub: HubServer, user: tuple[str, str]) -> None:
    repo = f"{user[0]}/app"
    with hub.client(user) as c:
        digest = push_blob(c, repo, b"blob")
        assert c.get(f"/v2/{repo}/blobs/{digest}").status_code == 200
        r = c.get(f"/v2/{repo}/blobs/{digest}%0A")
        assert r.status_code == 400, r.text
        # A route with a trailing newline is no route (the router matches whole paths).
        assert c.get(f"/v2/{repo}/tags/list%0A").status_code == 404
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["location"]
        r = c.patch(location + "%0A", content=b"x")
        assert r.status_code in (400, 404), r.text


@pytest.mark.parametrize(
    "name", ["bobco\n", "bobco\r\n", "\nbobco", "bobc\u043e", "bob\tco", "bobco\u200d"]
)
def test_creating_a_hostile_org_is_400(hub: HubServer, user: tuple[str, str], name: str) -> None:
    with hub.client(user) as c:
        r = c.post("/api/v1/orgs", json={"name": name})
        assert r.status_code == 400, r.text
        assert "invalid namespace" in r.text


def test_hostile_team_and_user_names_are_400(hub: HubServer, user: tuple[str, str]) -> None:
    org = f"o{user[0].replace('-', '')}"
    with hub.client(user) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        for bad in ("dev\n", "d\u0435v", "dev\x00"):
            r = c.post(f"/api/v1/orgs/{org}/teams", json={"name": bad, "role": "pull"})
            assert r.status_code == 400, r.text
        r = c.get(f"/api/v1/orgs/{org}/teams")
        assert r.status_code == 200 and r.json() == [], r.text
    with hub.client(ADMIN) as c:
        for bad in ("eve\n", "\u0435ve", "eve\u2028"):
            r = c.post("/api/v1/users", json={"name": bad, "password": "eve-password-1"})
            assert r.status_code == 400, r.text
