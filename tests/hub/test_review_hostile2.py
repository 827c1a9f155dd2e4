"""Hostile review 2: values a client sends that no backend can store.

PostgreSQL refuses text with a NUL character (SQLite keeps it) and both refuse an integer
past 64 bits; every route passes client text to SQL somewhere (a query's ``last``, a path's
organisation name, a JSON body's team glob, a manifest's artifactType). The hub checks every
statement's parameters in one place (hub/db.py ``check_storable``), so each of these is a
400 on both backends, never a 500."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_support import (
    ADMIN,
    EMPTY_CONFIG,
    EMPTY_MEDIA,
    OCI_MANIFEST,
    HubServer,
    artifact,
    push_blob,
    sha,
)

from forkd.errors import InvalidInput
from forkd.hub.db import UnstorableValue, check_storable

# (method, path, JSON body): each reaches the database with a value it cannot store.
UNSTORABLE: list[tuple[str, str, Any]] = [
    ("GET", "/v2/alice/app/tags/list?last=%00", None),
    ("GET", "/v2/_catalog?last=v%00", None),
    ("GET", "/v2/alice/app/manifests/v1%00", None),
    ("GET", "/api/v1/repositories?q=%00", None),
    ("GET", "/api/v1/repositories?namespace=a%00", None),
    ("GET", "/api/v1/orgs/ac%00me/members", None),
    ("GET", "/api/v1/namespaces/ac%00me/quota", None),
    ("DELETE", "/api/v1/orgs/acme/teams/t%00", None),
    ("PUT", "/api/v1/orgs/acme/members/b%00b", {"role": "pull"}),
    ("POST", "/api/v1/tokens/", {"name": "t\u0000", "scopes": ["alice:pull"]}),
    (
        "POST",
        "/api/v1/orgs/acme/teams",
        {"name": "t", "role": "pull", "repositories": "acme/\u0000"},
    ),
    ("POST", "/api/v1/orgs/acme/teams", {"name": "t2", "role": "pull", "members": ["\u0000"]}),
]
ADMIN_UNSTORABLE: list[tuple[str, str, Any]] = [
    ("PUT", "/api/v1/namespaces/acme/quota", {"quota_bytes": 10**30}),
    ("DELETE", "/api/v1/users/b%00", None),
]


@pytest.fixture
def world(backend_hub: HubServer) -> tuple[HubServer, httpx.Client, httpx.Client]:
    alice = httpx.Client(base_url=backend_hub.url, auth=backend_hub.add_user("alice"), timeout=30)
    admin = httpx.Client(base_url=backend_hub.url, auth=ADMIN, timeout=30)
    assert alice.post("/api/v1/orgs/", json={"name": "acme"}).status_code == 201
    artifact(alice, "alice/app", b"layer", tag="v1")
    return backend_hub, alice, admin


def test_unstorable_values_are_400_on_every_surface(
    world: tuple[HubServer, httpx.Client, httpx.Client],
) -> None:
    _, alice, admin = world
    for client, probes in ((alice, UNSTORABLE), (admin, ADMIN_UNSTORABLE)):
        for method, path, body in probes:
            r = (
                client.request(method, path, json=body)
                if body is not None
                else client.request(method, path)
            )
            assert r.status_code == 400, (method, path, r.status_code, r.text[:200])


def test_unstorable_query_text_for_anonymous_search_is_400(
    world: tuple[HubServer, httpx.Client, httpx.Client],
) -> None:
    hub, _, _ = world
    r = httpx.get(f"{hub.url}/api/v1/repositories", params={"q": "x\x00"})
    assert r.status_code == 400, r.text
    assert "NUL" in r.json()["detail"]


def test_a_manifest_with_unstorable_text_is_400_in_the_registry_error_body(
    world: tuple[HubServer, httpx.Client, httpx.Client],
) -> None:
    _, alice, _ = world
    push_blob(alice, "alice/app", EMPTY_CONFIG)
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/x\u0000",
        "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
        "layers": [],
    }
    r = alice.put(
        "/v2/alice/app/manifests/v2",
        content=json.dumps(manifest).encode(),
        headers={"Content-Type": OCI_MANIFEST},
    )
    assert r.status_code == 400, r.text
    # an artifactType must be a media type (hostile review 19), so the NUL is refused as
    # that before it could reach the database (UnstorableValue, test_check_storable_refuses)
    assert r.json()["errors"][0]["code"] == "MANIFEST_INVALID"
    assert (
        alice.get("/v2/alice/app/manifests/v2", headers={"Accept": OCI_MANIFEST}).status_code == 404
    )


@pytest.mark.parametrize(
    "params",
    [("a\x00",), {"k": ["ok", ("\x00",)]}, (1 << 63,), (-(1 << 63) - 1,), ("\udc80",)],
)
def test_check_storable_refuses(params: object) -> None:
    with pytest.raises(UnstorableValue):
        check_storable(params)
    assert issubclass(UnstorableValue, InvalidInput)


def test_check_storable_takes_what_both_backends_store() -> None:
    check_storable(("text é ✓", (1 << 63) - 1, -(1 << 63), True, None, b"\x00", 1.5, [{"a": 1}]))


def test_answers_that_carry_a_credential_are_never_cached(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """RFC 6749 5.1: a registry token from /token and an API token's secret from
    POST /api/v1/tokens come with Cache-Control: no-store (a cache between client and hub
    must not keep them)."""
    with httpx.Client(base_url=hub.url, auth=user, timeout=30) as client:
        bearer = client.get("/token", params={"scope": f"repository:{user[0]}/app:pull"})
        assert bearer.status_code == 200 and bearer.json()["token"]
        api = client.post("/api/v1/tokens/", json={"name": "ci", "scopes": [f"{user[0]}:pull"]})
        assert api.status_code == 201 and api.json()["token"]
    for answer in (bearer, api):
        assert answer.headers.get("cache-control") == "no-store", answer.headers
        assert answer.headers.get("pragma") == "no-cache"


def test_browsing_pages_do_not_take_the_write_lock(tmp_path: Path) -> None:
    """The home, search, namespace and pack pages only read: on SQLite they must not queue
    for the single write lock (BEGIN IMMEDIATE), or anonymous browsing holds up every push
    and, while a writer holds the lock, waits up to 30 s and fails. Here another
    connection holds the write lock while the pages are asked for."""
    hub = HubServer(tmp_path / "hub", {"default_visibility": "public"}).start()
    try:
        _browse_while_a_writer_holds_the_lock(hub)
    finally:
        hub.stop()


def _browse_while_a_writer_holds_the_lock(hub: HubServer) -> None:
    import sqlite3

    owner = hub.add_user("olga")
    with hub.client(owner) as client:
        artifact(client, "olga/app", b"layer", tag="v1")
        assert client.post("/api/v1/orgs/", json={"name": "acme"}).status_code == 201
    writer = sqlite3.connect(hub.data_dir / "hub.db", isolation_level=None, timeout=0)
    writer.execute("BEGIN IMMEDIATE")
    try:
        with httpx.Client(base_url=hub.url, timeout=20) as browser:
            for page in ("/", "/-/search?q=app", "/olga", "/acme", "/olga/app"):
                assert browser.get(page).status_code == 200, page
    finally:
        writer.execute("ROLLBACK")
        writer.close()
