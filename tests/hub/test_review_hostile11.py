"""Hostile review 11: a right is checked for as long as it is used, what a pusher who
lost push left behind does not block those who may push, and numbers and choices in
addresses are parsed strictly.

1. a blob download that streamed for minutes, or an upload whose body dripped in,
   went on after the caller's token was revoked, its account removed, its membership
   taken away or its push withdrawn: the check ran once, when the request began. Now
   ``RightsCheck`` (hub/oci/common.py) asks again every ``RIGHTS_RECHECK_S`` seconds
   (monkeypatched short here) and after an upload's last byte: the download is cut
   short of its Content-Length, the upload refused (401/403) with nothing of it kept;
2. upload sessions opened by someone who has since lost push still counted against
   ``upload_sessions_max``, ``upload_sessions_per_user`` and the namespace's quota
   until they expired (an hour): a removed member's sessions blocked the organisation.
   Now, when a limit or the quota would refuse, such sessions are dropped first;
3. a token id in an address went through ``int()``: ``'١٢'`` revoked token 12 and a
   30-digit id was a 500; ``page=1e1`` was page 10; a quota past 64 bits was a 500.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_support import (
    ADMIN,
    RECHECK_S,
    TIMEOUT,
    HubServer,
    SlowBody,
    api_token,
    audited,
    authorized,
    error_code,
    org_with_pusher,
    push_blob,
    sha,
    unique_name,
)

BIG = 32 << 20  # a download larger than what the loopback's socket buffers hold


def _linked(hub: HubServer, repo: str, digest: str) -> bool:
    with hub.client(ADMIN) as c:
        return c.head(f"/v2/{repo}/blobs/{digest}").status_code == 200


def _sessions(hub: HubServer, repo: str) -> list[str]:
    """The upload session rows of ``repo``."""
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        rows = db.execute(
            "SELECT uploads.id FROM uploads JOIN repositories"
            " ON repositories.id = uploads.repository_id WHERE repositories.name = ?",
            (repo,),
        ).fetchall()
    return [upload_id for (upload_id,) in rows]


def _upload_file(hub: HubServer, upload_id: str) -> Path:
    return hub.data_dir / "uploads" / upload_id


# -- how a right is withdrawn ------------------------------------------------------------
Withdraw = Callable[[HubServer, str, tuple[str, str], tuple[str, str], int], None]


def _remove_member(hub: HubServer, org: str, alice: tuple[str, str], bob: Any, _t: int) -> None:
    with hub.client(alice) as c:
        assert c.delete(f"/api/v1/orgs/{org}/members/{bob[0]}").status_code == 204


def _demote(hub: HubServer, org: str, alice: tuple[str, str], bob: Any, _t: int) -> None:
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "pull"})
        assert r.status_code == 204, r.text


def _revoke_token(hub: HubServer, _org: str, _a: Any, bob: tuple[str, str], token: int) -> None:
    with hub.client(bob) as c:
        assert c.delete(f"/api/v1/tokens/{token}").status_code == 204


def _remove_user(hub: HubServer, _org: str, _a: Any, bob: tuple[str, str], _t: int) -> None:
    with hub.client(ADMIN) as c:
        assert c.delete(f"/api/v1/users/{bob[0]}").status_code == 204


# -- 1. a download is cut once its reader loses pull -------------------------------------
@pytest.mark.parametrize(
    "withdraw", [_remove_member, _revoke_token, _remove_user], ids=lambda f: f.__name__[1:]
)
def test_a_download_is_cut_once_its_reader_loses_pull(
    hub: HubServer, quick_recheck: None, withdraw: Withdraw
) -> None:
    """Bob reads a 32 MiB blob slowly (an API token of his); the right is withdrawn after
    its first bytes. It used to stream to the end; now the hub closes the connection
    short of Content-Length within a check, and the audit log says why."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    data = bytes(range(256)) * (BIG // 256)
    with hub.client(alice) as c:
        digest = push_blob(c, repo, data)
    secret, token_id = api_token(hub, bob, f"{org}:pull")
    received = 0
    with hub.client((bob[0], secret)) as c, c.stream("GET", f"/v2/{repo}/blobs/{digest}") as r:
        assert r.status_code == 200
        assert r.headers["content-length"] == str(BIG)
        chunks = r.iter_raw(1 << 16)
        received += len(next(chunks))
        withdraw(hub, org, alice, bob, token_id)
        time.sleep(3 * RECHECK_S)
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                received += len(chunk)
    assert received < BIG
    cut = audited(hub, bob[0], "blob.pull", "cut")
    assert [e["target"] for e in cut] == [f"{repo}@{digest}"], cut


def test_an_anonymous_download_is_cut_once_the_repository_is_private(
    hub: HubServer, quick_recheck: None
) -> None:
    """Anyone may read a public pack; made private meanwhile, the reads stop."""
    org, alice, _bob = org_with_pusher(hub)
    repo = f"{org}/app"
    data = bytes(range(256)) * (BIG // 256)
    with hub.client(alice) as c:
        digest = push_blob(c, repo, data)
    hub.public(repo)
    received = 0
    with hub.client() as c, c.stream("GET", f"/v2/{repo}/blobs/{digest}") as r:
        assert r.status_code == 200
        chunks = r.iter_raw(1 << 16)
        received += len(next(chunks))
        hub.cli("repo", "visibility", repo, "private")
        time.sleep(3 * RECHECK_S)
        with pytest.raises(httpx.RemoteProtocolError):
            for chunk in chunks:
                received += len(chunk)
    assert received < BIG


def test_a_slow_download_whose_reader_keeps_pull_completes(
    hub: HubServer, quick_recheck: None
) -> None:
    """The checks pass while the right holds, with a registry bearer token too (the
    docker flow): every byte arrives, over several check intervals."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    data = bytes(range(256)) * (BIG // 256)
    with hub.client(alice) as c:
        digest = push_blob(c, repo, data)
    with hub.client(bob) as c:
        r = c.get("/token", params={"scope": f"repository:{repo}:pull"})
        assert r.status_code == 200, r.text
        bearer = r.json()["token"]
    got = bytearray()
    headers = {"Authorization": f"Bearer {bearer}"}
    with hub.client() as c, c.stream("GET", f"/v2/{repo}/blobs/{digest}", headers=headers) as r:
        assert r.status_code == 200
        for i, chunk in enumerate(r.iter_raw(1 << 20)):
            got += chunk
            if i < 4:
                time.sleep(RECHECK_S)
    assert sha(bytes(got)) == digest
    assert not audited(hub, bob[0], "blob.pull", "cut")


# -- 1. an upload body that drips on is refused once push is gone ------------------------
def _drip() -> SlowBody:
    return SlowBody([b"d" * 1024 for _ in range(60)], gap=0.03)


@pytest.mark.parametrize(
    ("request_kind", "withdraw", "status", "code"),
    [
        ("patch", _remove_member, 403, "DENIED"),
        ("patch", _demote, 403, "DENIED"),
        ("put", _revoke_token, 401, "UNAUTHORIZED"),
        ("post", _remove_user, 401, "UNAUTHORIZED"),
    ],
    ids=["patch-member-removed", "patch-demoted", "put-token-revoked", "post-user-removed"],
)
def test_an_upload_whose_push_is_withdrawn_while_it_drips_keeps_nothing(
    hub: HubServer,
    quick_recheck: None,
    request_kind: str,
    withdraw: Withdraw,
    status: int,
    code: str,
) -> None:
    """Bob's body drips in (60 parts, 30 ms apart); his right is withdrawn after the
    first. The refusal comes while the body is still dripping (the audit log has it
    before the last part is sent), not when it ends; nothing of this request is kept in
    the session's file and nothing is linked. Before: a PATCH was 202 and kept every
    byte; a PUT or monolithic POST was refused only after the whole body was in."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    secret, token_id = api_token(hub, bob, f"{org}:push")
    body = _drip()
    first = b"first chunk, "
    whole = first + body.data
    with hub.client((bob[0], secret)) as c:
        upload_id = ""
        if request_kind == "post":

            def send() -> httpx.Response:
                return c.post(
                    f"/v2/{repo}/blobs/uploads/", params={"digest": sha(body.data)}, content=body
                )
        else:
            where = c.post(f"/v2/{repo}/blobs/uploads/").headers["Location"]
            upload_id = where.rsplit("/", 1)[1]
            assert c.patch(where, content=first).status_code == 202

            def send() -> httpx.Response:
                if request_kind == "patch":
                    return c.patch(where, content=body)
                return c.put(where, params={"digest": sha(whole)}, content=body)

        with authorized() as allowed, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(send)
            assert body.sent_first.wait(TIMEOUT)
            # Withdrawn once the hub has authorized the request (a fixed sleep after the
            # first bytes could come first on a loaded machine: refused as it began).
            assert allowed.wait(TIMEOUT), "the hub never authorized the request"
            time.sleep(2 * RECHECK_S)  # the request's first check is due
            withdraw(hub, org, alice, bob, token_id)
            body.go_on.set()
            deadline = time.monotonic() + TIMEOUT
            while not audited(hub, bob[0], "blob.push", "denied"):
                assert time.monotonic() < deadline, "the upload was never refused"
                time.sleep(0.01)
            sent_when_refused = body.sent
            r = pending.result(TIMEOUT)
    assert sent_when_refused < len(body.parts), "refused only once the body was all in"
    assert r.status_code == status, r.text
    assert error_code(r) == code
    assert "while this request ran" in r.text
    assert not _linked(hub, repo, sha(body.data))
    assert not _linked(hub, repo, sha(whole))
    if upload_id:  # the session keeps only what came before this request
        assert _upload_file(hub, upload_id).stat().st_size == len(first)
    else:  # the monolithic upload's session is gone
        assert _sessions(hub, repo) == []


def test_a_slow_upload_whose_pusher_keeps_push_is_stored(
    hub: HubServer, quick_recheck: None
) -> None:
    """The checks pass while push holds (a registry bearer token): every dripped byte
    is kept and the blob is linked."""
    org, _alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(bob) as c:
        r = c.get("/token", params={"scope": f"repository:{repo}:pull,push"})
        bearer = r.json()["token"]
    body = SlowBody([b"k" * 1024 for _ in range(12)], gap=RECHECK_S / 2)
    body.go_on.set()
    headers = {"Authorization": f"Bearer {bearer}"}
    with hub.client() as c:
        where = c.post(f"/v2/{repo}/blobs/uploads/", headers=headers).headers["Location"]
        r = c.patch(where, content=body, headers=headers)
        assert r.status_code == 202, r.text
        assert r.headers["Range"] == f"0-{len(body.data) - 1}"
        r = c.put(where, params={"digest": sha(body.data)}, headers=headers)
        assert r.status_code == 201, r.text
    assert _linked(hub, repo, sha(body.data))


# -- 2. orphaned upload sessions ---------------------------------------------------------
def _limited_hub(tmp_path: Path, **settings: Any) -> HubServer:
    return HubServer(tmp_path / "hub", settings).start()


def _open_session(client: httpx.Client, repo: str, data: bytes) -> str:
    """A session with ``data`` in it; its id."""
    r = client.post(f"/v2/{repo}/blobs/uploads/")
    assert r.status_code == 202, r.text
    where = r.headers["Location"]
    if data:
        assert client.patch(where, content=data).status_code == 202
    return str(where.rsplit("/", 1)[1])


@pytest.mark.parametrize(
    "withdraw", [_remove_member, _demote, _remove_user], ids=lambda f: f.__name__[1:]
)
def test_sessions_of_a_pusher_who_lost_push_do_not_block_the_namespace(
    tmp_path: Path, withdraw: Withdraw
) -> None:
    """upload_sessions_max=2: bob and carol each hold a session of the organisation's;
    alice is refused a third (429). Bob loses push: his session used to keep blocking
    alice for an hour. Now it is dropped (row and bytes) when the limit would refuse,
    and carol's, whose opener may still push, is not."""
    hub = _limited_hub(tmp_path, upload_sessions_max=2)
    try:
        org, alice, bob = org_with_pusher(hub)
        carol = hub.add_user(unique_name("carol"))
        with hub.client(alice) as c:
            r = c.put(f"/api/v1/orgs/{org}/members/{carol[0]}", json={"role": "push"})
            assert r.status_code == 204
        repo = f"{org}/app"
        with hub.client(bob) as c:
            bobs = _open_session(c, repo, b"bob's bytes")
        with hub.client(carol) as c:
            carols = _open_session(c, repo, b"carol's bytes")
        with hub.client(alice) as c:
            r = c.post(f"/v2/{repo}/blobs/uploads/")
            assert r.status_code == 429, r.text
            withdraw(hub, org, alice, bob, 0)
            r = c.post(f"/v2/{repo}/blobs/uploads/")
            assert r.status_code == 202, r.text
            assert bobs not in _sessions(hub, repo)
            assert not _upload_file(hub, bobs).exists()
            # Carol may still push: her session stays and still counts.
            assert carols in _sessions(hub, repo)
            assert c.post(f"/v2/{repo}/blobs/uploads/").status_code == 429
        with hub.client(carol) as c:
            assert c.get(f"/v2/{repo}/blobs/uploads/{carols}").status_code == 204
    finally:
        hub.stop()


def test_a_users_sessions_where_they_lost_push_do_not_block_their_own_pushes(
    tmp_path: Path,
) -> None:
    """upload_sessions_per_user=2: bob's two sessions in the organisation he was removed
    from took both of his places; his pushes to his own namespace were 429 until they
    expired. Now they are dropped."""
    hub = _limited_hub(tmp_path, upload_sessions_per_user=2)
    try:
        org, alice, bob = org_with_pusher(hub)
        repo = f"{org}/app"
        with hub.client(bob) as c:
            stale = [_open_session(c, repo, b"x"), _open_session(c, repo, b"y")]
            assert c.post(f"/v2/{bob[0]}/own/blobs/uploads/").status_code == 429
            _remove_member(hub, org, alice, bob, 0)
            r = c.post(f"/v2/{bob[0]}/own/blobs/uploads/")
            assert r.status_code == 202, r.text
        assert _sessions(hub, repo) == []
        assert not any(_upload_file(hub, s).exists() for s in stale)
    finally:
        hub.stop()


def test_sessions_of_a_pusher_who_lost_push_give_the_quota_back(hub: HubServer) -> None:
    """The organisation's quota leaves 1000 bytes; bob's open session holds 800 of them.
    Bob is removed: alice's 600-byte upload used to be refused (403 quota) until bob's
    session expired. Now his session is dropped and hers is stored."""
    org, alice, bob = org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(ADMIN) as admin:
        used = admin.get(f"/api/v1/namespaces/{org}/quota").json()["used_bytes"]
        r = admin.put(f"/api/v1/namespaces/{org}/quota", json={"quota_bytes": used + 1000})
        assert r.status_code == 200, r.text
    with hub.client(bob) as c:
        bobs = _open_session(c, repo, b"b" * 800)
    data = b"a" * 600
    with hub.client(alice) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(data)}, content=data)
        assert r.status_code == 403, r.text  # bob may still push: his bytes count
        _remove_member(hub, org, alice, bob, 0)
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(data)}, content=data)
        assert r.status_code == 201, r.text
    assert bobs not in _sessions(hub, repo)
    assert not _upload_file(hub, bobs).exists()


# -- 3. strict numbers and choices in addresses ------------------------------------------
ARABIC_INDIC = str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩")
FULLWIDTH = str.maketrans("0123456789", "０１２３４５６７８９")


def test_a_token_id_is_ascii_digits(hub: HubServer) -> None:
    """``DELETE /api/v1/tokens/١٢`` revoked token 12, ``+12``, `` 12`` and ``12.0``
    too (or were 404/405), a 30-digit id was a 500; the UI's revoke route took the same.
    Now each is 400 and the token stays."""
    owner = hub.add_user(unique_name("owner"))
    _secret, token_id = api_token(hub, owner, f"{owner[0]}:pull")
    text = str(token_id)
    bad = [
        text.translate(ARABIC_INDIC),
        text.translate(FULLWIDTH),
        f"+{text}",
        f"%20{text}",
        f"-{text}",
        f"{text}.0",
        "9" * 30,
        "0",
    ]
    with hub.client(owner) as c:
        for form in bad:
            r = c.delete(f"/api/v1/tokens/{form}")
            assert r.status_code == 400, (form, r.status_code, r.text)
            assert "token id" in r.text, r.text
            r = c.post(f"/-/settings/tokens/{form}/revoke", data={"csrf": "x"})
            assert r.status_code == 400, (form, r.status_code, r.text[:200])
        assert [t["id"] for t in c.get("/api/v1/tokens").json()] == [token_id]
        assert c.delete(f"/api/v1/tokens/{text}").status_code == 204


@pytest.mark.parametrize(
    "path",
    [
        "/api/v1/repositories?page=1.0",
        "/api/v1/repositories?page=1e1",
        "/api/v1/repositories?page=%D9%A1",  # Arabic-Indic 1
        "/api/v1/repositories?page=0",
        "/api/v1/repositories?page=100001",
        "/api/v1/repositories?per_page=101",
        "/api/v1/repositories?per_page=2e1",
        "/api/v1/repositories?sort=newest",
        "/api/v1/repositories?sort=",
        "/api/v1/repositories/{repo}?page=1e1",
        "/api/v1/repositories/{repo}?per_page=%2B5",
        "/-/search?page=1e1",
        "/-/search?per_page=1.0",
        "/-/search?sort=bogus",
        "/{repo}?page=2.0",
        "/v2/_catalog?last=" + "x" * 300,
        "/v2/{repo}/tags/list?last=" + "t" * 200,
        "/v2/{repo}/tags/list?last=-dash",
    ],
)
def test_list_parameters_are_parsed_strictly(hub: HubServer, path: str) -> None:
    """Each was answered (page 10 for ``1e1``, page 1 for ``1.0``, a 300-character
    ``last`` compared with every name); now 400, saying what was expected."""
    org, alice, _bob = org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(alice) as c:
        r = c.get(path.format(repo=repo))
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    assert "Traceback" not in r.text


def test_list_parameters_that_are_right_still_work(hub: HubServer) -> None:
    org, alice, _bob = org_with_pusher(hub)
    repo = f"{org}/app"
    hub.public(repo)  # the UI's pages: Basic credentials are no session
    with hub.client(alice) as c:
        for path in [
            "/api/v1/repositories?page=1&per_page=100&sort=name",
            "/api/v1/repositories?sort=pulls",
            f"/api/v1/repositories/{repo}?page=1&per_page=5",
            "/-/search?page=1&per_page=20&sort=name",
            f"/{repo}?page=1",
            "/v2/_catalog?n=5&last=",
            f"/v2/{repo}/tags/list?n=5&last=a",
        ]:
            r = c.get(path)
            assert r.status_code == 200, (path, r.status_code, r.text[:300])
        sorted_names = c.get("/api/v1/repositories?sort=name").json()["items"]
        assert [i["name"] for i in sorted_names] == sorted(i["name"] for i in sorted_names)
        r = c.get("/api/v1/repositories?sort=newest")
        assert "updated" in r.text and "pulls" in r.text and "name" in r.text, r.text


@pytest.mark.parametrize("quota", [-1, 2**63, 2**64 - 1])
def test_a_quota_the_database_cannot_hold_is_refused(hub: HubServer, quota: int) -> None:
    """2**64-1 passed msgspec's int and reached the database: a 500. Now 400."""
    org, _alice, _bob = org_with_pusher(hub)
    with hub.client(ADMIN) as admin:
        r = admin.put(f"/api/v1/namespaces/{org}/quota", json={"quota_bytes": quota})
        assert r.status_code == 400, r.text
        assert admin.get(f"/api/v1/namespaces/{org}/quota").json()["quota_bytes"] is None
