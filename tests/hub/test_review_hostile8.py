"""Hostile review 8: a right withdrawn while a request runs is withdrawn from what it
stores, every route refuses outsiders alike, and what one account may make is bounded.

* in-flight writes: an upload (monolithic or the closing ``PUT``), a manifest body or a
  cross-repository mount whose request began while the caller could push, and whose
  user was removed, token revoked or membership taken away before its bytes were all
  in, stores nothing: the write transaction checks the caller again
  (``auth.still_permitted``);
* the route table: every route Litestar serves, filled in for a private repository and
  its organisation, refuses an anonymous caller and an outsider without naming what
  exists; a new route that forgets its check fails this test;
* team membership is a way into an organisation: it obeys the rules a direct
  membership obeys (robots only through who manages them) and is bounded per request;
  ``/api/v1`` bodies are bounded in bytes on every route;
* per-account counts: API tokens per user and organisations per creator are bounded,
  also when requests race;
* manifests with duplicate keys are ambiguous (a first-wins parser reads another
  document) and refused.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hub_support import ADMIN, EMPTY_CONFIG, OCI_MANIFEST, HubServer, artifact, error_code, sha

TIMEOUT = 60


def _name(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10**9}"


def _org_with_pusher(hub: HubServer) -> tuple[str, tuple[str, str], tuple[str, str]]:
    """A new organisation: alice its admin, bob a push member."""
    alice, bob, org = hub.add_user(_name("alice")), hub.add_user(_name("bob")), _name("org")
    with hub.client(alice) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 204, r.text
        artifact(c, f"{org}/app", b"seed layer", tag="seed")  # the repository exists
    return org, alice, bob


class _SlowBody:
    """A request body sent in two halves; the second waits until ``release``."""

    def __init__(self, first: bytes, second: bytes) -> None:
        self.first, self.second = first, second
        self.sent_first = threading.Event()
        self.go_on = threading.Event()

    def __iter__(self) -> Iterator[bytes]:
        yield self.first
        self.sent_first.set()
        assert self.go_on.wait(TIMEOUT)
        yield self.second


def _open_sessions(hub: HubServer) -> int:
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        return int(db.execute("SELECT count(*) FROM uploads").fetchone()[0])


def _while_sending(
    hub: HubServer, send: Any, body: _SlowBody, withdraw: Any, *, session_row: bool
) -> httpx.Response:
    """Send a request with ``body`` in a thread, run ``withdraw`` once the hub is reading
    its body (it has opened its upload session row, or had a second to), then let the
    rest of the body go."""
    with ThreadPoolExecutor(1) as pool:
        before = _open_sessions(hub)
        pending = pool.submit(send)
        assert body.sent_first.wait(TIMEOUT)
        deadline = time.monotonic() + TIMEOUT
        if session_row:
            while _open_sessions(hub) <= before:
                assert time.monotonic() < deadline, "the upload never began"
                time.sleep(0.02)
        else:
            time.sleep(1.0)
        withdraw()
        body.go_on.set()
        return pending.result(TIMEOUT)


def _remove_member(hub: HubServer, admin: tuple[str, str], org: str, user: str) -> None:
    with hub.client(admin) as c:
        assert c.delete(f"/api/v1/orgs/{org}/members/{user}").status_code == 204


def _blob_linked(hub: HubServer, repo: str, digest: str) -> bool:
    with hub.client(ADMIN) as c:
        return c.head(f"/v2/{repo}/blobs/{digest}").status_code == 200


# -- 1. a right withdrawn mid-request -------------------------------------------------
def test_an_upload_whose_pusher_was_removed_meanwhile_stores_nothing(hub: HubServer) -> None:
    """Bob began a monolithic upload into the organisation's private repository; alice
    removed him from the organisation while his bytes were arriving. The upload was
    authorised only when it began, so it was linked (201) and counted against the
    organisation. Now the link's transaction checks again: 404 (he may not even see the
    repository now) and the blob is not in it."""
    org, alice, bob = _org_with_pusher(hub)
    repo = f"{org}/app"
    body = _SlowBody(b"bob's first half ", b"and the second")
    digest = sha(body.first + body.second)
    with hub.client(bob) as c:
        r = _while_sending(
            hub,
            lambda: c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": digest}, content=body),
            body,
            lambda: _remove_member(hub, alice, org, bob[0]),
            session_row=True,
        )
    assert r.status_code == 404, r.text
    assert error_code(r) == "NAME_UNKNOWN"
    assert not _blob_linked(hub, repo, digest)


def test_an_upload_with_a_token_revoked_meanwhile_stores_nothing(hub: HubServer) -> None:
    """The closing PUT of a chunked upload, sent with an API token that its owner revoked
    while the last chunk was arriving: 401, nothing linked."""
    org, _alice, bob = _org_with_pusher(hub)
    repo = f"{org}/app"
    token = hub.token(bob[0], f"{org}:push")
    with hub.client(bob) as c:
        token_id = c.get("/api/v1/tokens").json()[-1]["id"]
    body = _SlowBody(b"the last ", b"chunk")
    digest = sha(b"first chunk, " + body.first + body.second)

    def revoke() -> None:
        with hub.client(bob) as c:
            assert c.delete(f"/api/v1/tokens/{token_id}").status_code == 204

    with hub.client((bob[0], token)) as c:
        where = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
        assert c.patch(where, content=b"first chunk, ").status_code == 202
        r = _while_sending(
            hub,
            lambda: c.put(where, params={"digest": digest}, content=body),
            body,
            revoke,
            session_row=False,
        )
    assert r.status_code == 401, r.text
    assert not _blob_linked(hub, repo, digest)


def test_a_manifest_whose_pusher_lost_push_meanwhile_is_not_recorded(hub: HubServer) -> None:
    """A manifest body arrives slowly; the pusher is demoted to pull before it is all
    in. It used to be recorded and tagged (the check ran before the body was read); now
    403 DENIED, and the tag does not exist."""
    org, alice, bob = _org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(bob) as c:
        layer = b"bob's layer"
        c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(EMPTY_CONFIG)}, content=b"{}")
        c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(layer)}, content=layer)
        doc = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {
                    "mediaType": "application/vnd.oci.empty.v1+json",
                    "digest": sha(EMPTY_CONFIG),
                    "size": 2,
                },
                "layers": [
                    {"mediaType": "application/octet-stream", "digest": sha(layer), "size": 11}
                ],
            }
        ).encode()
        body = _SlowBody(doc[:20], doc[20:])

        def demote() -> None:
            with hub.client(alice) as a:
                r = a.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "pull"})
                assert r.status_code == 204, r.text

        r = _while_sending(
            hub,
            lambda: c.put(
                f"/v2/{repo}/manifests/late",
                content=body,
                headers={"Content-Type": OCI_MANIFEST},
            ),
            body,
            demote,
            session_row=False,
        )
        assert r.status_code == 403, r.text
        assert error_code(r) == "DENIED"
        assert "withdrawn while this request ran" in r.text
        assert c.get(f"/v2/{repo}/manifests/late").status_code == 404
