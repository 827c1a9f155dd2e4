"""Hostile review 6: what is referenced is not deleted, quota and GC agree, one request
cannot stall the hub, and writes for a caller go to that caller's row.

* a blob a manifest of the repository references is not unlinked, and a manifest an index
  of the repository lists is not deleted (400 ``UNSUPPORTED``): the quota got the bytes
  back while GC kept them, so repeating it filled the disk under a fixed quota; a
  ``subject`` naming a digest its repository does not hold pins nothing; a blob deletion
  racing a manifest push cannot both succeed (on PostgreSQL too);
* the catalog API's tag sizes are computed once per manifest digest, off the event loop,
  and a repository's tags come in pages;
* server-side compactions run at most ``compactions_max`` at a time, more are 429;
* a token or organisation made for the caller goes to the caller's row (by id and stamp),
  never to an account given the same name while the request ran.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
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
    browser,
    error_code,
    push_blob,
    sha,
)

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
SIG = "application/vnd.example.signature"
LAYER = "application/vnd.oci.image.layer.v1.tar"


def _on_disk(hub: HubServer, digest: str) -> bool:
    hexd = digest.split(":", 1)[1]
    return (hub.data_dir / "blobs" / "sha256" / hexd[:2] / hexd).is_file()


def _manifest(layers: list[bytes], **extra: Any) -> bytes:
    doc: dict[str, Any] = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
        "layers": [{"mediaType": LAYER, "digest": sha(b), "size": len(b)} for b in layers],
        **extra,
    }
    return json.dumps(doc).encode()


def _put(
    c: httpx.Client, repo: str, ref: str, body: bytes, kind: str = OCI_MANIFEST
) -> httpx.Response:
    return c.put(f"/v2/{repo}/manifests/{ref}", content=body, headers={"Content-Type": kind})


def _used(hub: HubServer, namespace: str) -> int:
    with hub.client(ADMIN) as c:
        return int(c.get(f"/api/v1/namespaces/{namespace}/quota").json()["used_bytes"])


# -- 1. references -----------------------------------------------------------------------
def test_a_referenced_blob_is_not_unlinked_so_a_quota_holds(backend_hub: HubServer) -> None:
    """Upload a layer, push a manifest naming it, unlink the layer: the quota got its bytes
    back while GC kept them for the manifest, so the same quota held ever more disk. Now
    the unlink is refused while the manifest is there; deleted in order (manifest, then
    blob), the quota gives the bytes back and GC removes them."""
    hub = backend_hub
    hub.add_user("filler")
    hub.cli("quota", "set", "filler", "11000")
    who = ("filler", "filler-password-1")
    repo = "filler/app"
    layers = [os.urandom(3000) for _ in range(4)]
    with hub.client(who) as c:
        push_blob(c, repo, EMPTY_CONFIG)
        for i, layer in enumerate(layers[:3]):
            push_blob(c, repo, layer)
            assert _put(c, repo, f"v{i}", _manifest([layer])).status_code == 201
            r = c.delete(f"/v2/{repo}/blobs/{sha(layer)}")
            assert r.status_code == 400, r.text
            assert error_code(r) == "UNSUPPORTED"
            detail = r.json()["errors"][0]["detail"]
            assert "referenced by 1 manifest" in detail and "Delete those manifests" in detail
            assert sha(_manifest([layer])) in detail
            assert c.get(f"/v2/{repo}/blobs/{sha(layer)}").content == layer
        # Three layers of 3000 bytes held (and their manifests): a fourth does not fit.
        r = c.post(f"/v2/{repo}/blobs/uploads/", params={"digest": sha(layers[3])},
                   content=layers[3])
        assert r.status_code == 403 and error_code(r) == "DENIED", r.text
    used = _used(hub, "filler")
    assert used >= 9000
    hub.cli("gc", "--grace-minutes", "0")
    assert _used(hub, "filler") == used
    for layer in layers[:3]:
        assert _on_disk(hub, sha(layer))

    with hub.client(who) as c:  # in order: the manifest, then its blobs
        body = _manifest([layers[0]])
        assert c.delete(f"/v2/{repo}/manifests/{sha(body)}").status_code == 202
        assert c.delete(f"/v2/{repo}/blobs/{sha(layers[0])}").status_code == 202
        # the config is still referenced by the other two manifests
        assert c.delete(f"/v2/{repo}/blobs/{sha(EMPTY_CONFIG)}").status_code == 400
    assert _used(hub, "filler") == used - 3000 - len(body)
    hub.cli("gc", "--grace-minutes", "0")
    assert not _on_disk(hub, sha(layers[0])) and not _on_disk(hub, sha(body))
    assert _on_disk(hub, sha(layers[1])) and _on_disk(hub, sha(EMPTY_CONFIG))
    with hub.client(who) as c:
        assert c.get(f"/v2/{repo}/manifests/v1").status_code == 200
        assert c.get(f"/v2/{repo}/blobs/{sha(layers[1])}").content == layers[1]


def test_a_manifest_an_index_lists_is_not_deleted(backend_hub: HubServer) -> None:
    hub = backend_hub
    who = hub.add_user("multi")
    repo = "multi/app"
    layer = os.urandom(500)
    with hub.client(who) as c:
        push_blob(c, repo, EMPTY_CONFIG)
        push_blob(c, repo, layer)
        child = _manifest([layer])
        assert _put(c, repo, sha(child), child).status_code == 201
        index = json.dumps({
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [{"mediaType": OCI_MANIFEST, "digest": sha(child), "size": len(child)}],
        }).encode()
        assert _put(c, repo, "latest", index, OCI_INDEX).status_code == 201
        # A referrer of the child (its subject) does not hold it.
        referrer, _ = artifact(c, repo, b"signature", subject={
            "mediaType": OCI_MANIFEST, "digest": sha(child), "size": len(child)})

        r = c.delete(f"/v2/{repo}/manifests/{sha(child)}")
        assert r.status_code == 400 and error_code(r) == "UNSUPPORTED", r.text
        detail = r.json()["errors"][0]["detail"]
        assert sha(index) in detail and referrer not in detail
        assert c.get(f"/v2/{repo}/manifests/{sha(child)}").content == child
        hub.cli("gc", "--grace-minutes", "0")
        assert c.get(f"/v2/{repo}/manifests/latest").content == index
        assert c.get(f"/v2/{repo}/blobs/{sha(layer)}").content == layer

        assert c.delete(f"/v2/{repo}/manifests/{sha(index)}").status_code == 202
        assert c.delete(f"/v2/{repo}/manifests/{sha(child)}").status_code == 202  # now free
        listed = c.get(f"/v2/{repo}/referrers/{sha(child)}").json()["manifests"]
        assert [m["digest"] for m in listed] == [referrer]  # the referrer stays


def test_a_subject_pins_nothing_its_repository_does_not_hold(hub: HubServer) -> None:
    """A pushed ``subject`` may name any digest: one naming another namespace's manifest
    kept that manifest's bytes from GC after its owner deleted it, uncounted by anyone's
    quota. A subject keeps nothing; a manifest's own blobs stay while it is there."""
    owner = hub.add_user("subjowner")
    squatter = hub.add_user("subjsquat")
    owners, squatters, referrers = b"owner's layer", b"squatter's layer", b"a referrer"
    with hub.client(owner) as c:
        target, target_body = artifact(c, "subjowner/app", owners, tag="v1")
        subject = {"mediaType": OCI_MANIFEST, "digest": target, "size": len(target_body)}
        mine, _ = artifact(c, "subjowner/app", referrers, subject=subject, artifact_type=SIG)
    with hub.client(squatter) as c:
        pinned, _ = artifact(c, "subjsquat/pin", squatters, tag="v1", subject=subject)
    with hub.client(owner) as c:
        assert c.delete(f"/v2/subjowner/app/manifests/{target}").status_code == 202
        assert c.delete(f"/v2/subjowner/app/blobs/{sha(owners)}").status_code == 202
    hub.cli("gc", "--grace-minutes", "0")
    assert not _on_disk(hub, target), "a subject elsewhere kept the deleted manifest"
    assert not _on_disk(hub, sha(owners))
    with hub.client(squatter) as c:  # the squatter's manifest is whole and listed
        assert c.get(f"/v2/subjsquat/pin/manifests/{pinned}").status_code == 200
        assert c.get(f"/v2/subjsquat/pin/blobs/{sha(squatters)}").content == squatters
        listed = c.get(f"/v2/subjsquat/pin/referrers/{target}").json()["manifests"]
        assert [m["digest"] for m in listed] == [pinned]
    with hub.client(owner) as c:  # and so is the owner's referrer of the deleted subject
        assert c.get(f"/v2/subjowner/app/manifests/{mine}").status_code == 200
        assert c.get(f"/v2/subjowner/app/blobs/{sha(referrers)}").content == referrers


def test_a_blob_deletion_racing_a_manifest_push_never_both_succeed(
    backend_hub: HubServer,
) -> None:
    """DELETE of a blob and PUT of a manifest naming it, sent together, many times: one of
    them is refused each time (under READ COMMITTED both checks used to pass), and every
    manifest the hub accepted has its blobs, also after a GC sweep."""
    hub = backend_hub
    who = hub.add_user("racing")
    repo = "racing/app"
    both: list[int] = []
    accepted: list[tuple[str, bytes]] = []
    with hub.client(who) as setup:
        push_blob(setup, repo, EMPTY_CONFIG)
    with hub.client(who) as pusher, hub.client(who) as deleter, ThreadPoolExecutor(2) as pool:
        for i in range(30):
            layer = f"racing layer {i}".encode() + os.urandom(8)
            push_blob(pusher, repo, layer)
            body = _manifest([layer])
            start = threading.Barrier(2)

            def put(body: bytes = body, start: threading.Barrier = start) -> httpx.Response:
                start.wait()
                return _put(pusher, repo, sha(body), body)

            def unlink(layer: bytes = layer, start: threading.Barrier = start) -> httpx.Response:
                start.wait()
                return deleter.delete(f"/v2/{repo}/blobs/{sha(layer)}")

            pushed, deleted = pool.submit(put), pool.submit(unlink)
            p, d = pushed.result(), deleted.result()
            assert p.status_code in (201, 400) and d.status_code in (202, 400), (p.text, d.text)
            if p.status_code == 201 and d.status_code == 202:
                both.append(i)
            if p.status_code == 201:
                accepted.append((sha(body), layer))
            else:
                assert error_code(p) == "MANIFEST_BLOB_UNKNOWN", p.text
            if d.status_code == 400:
                assert error_code(d) == "UNSUPPORTED", d.text
    assert not both, f"rounds {both}: the blob was unlinked and a manifest naming it accepted"
    hub.cli("gc", "--grace-minutes", "0")
    with hub.client(who) as c:
        for digest, layer in accepted:
            assert c.get(f"/v2/{repo}/manifests/{digest}").status_code == 200
            assert c.get(f"/v2/{repo}/blobs/{sha(layer)}").content == layer


# -- 2. the catalog API ---------------------------------------------------------------------
def test_repository_detail_reads_each_manifest_once_off_the_event_loop(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One manifest tagged 150 times: its bytes are read (hashed, parsed) once, in a worker
    thread, not once per tag on the event loop; the tags come 100 to a page."""
    from forkd.store.blobs import FsBlobStore

    who = hub.add_user("tagger")
    repo = "tagger/app"
    with hub.client(who) as c:
        digest, body = artifact(c, repo, b"one layer", tag="t000")
        for i in range(1, 150):
            r = _put(c, repo, f"t{i:03d}", body)
            assert r.status_code == 201, r.text
    reads: Counter[tuple[str, bool]] = Counter()
    real_read = FsBlobStore.read
    loop_thread = hub._thread

    def counting_read(self: FsBlobStore, d: str, *args: Any, **kwargs: Any) -> bytes:
        reads[(d, threading.current_thread() is loop_thread)] += 1
        return real_read(self, d, *args, **kwargs)

    monkeypatch.setattr(FsBlobStore, "read", counting_read)
    with hub.client(who) as c:
        first = c.get(f"/api/v1/repositories/{repo}")
        assert first.status_code == 200, first.text
        assert reads[(digest, True)] == 0, "read on the event loop's thread"
        assert reads[(digest, False)] == 1, reads
        detail = first.json()
        assert detail["tags_total"] == 150 and len(detail["tags"]) == 100
        assert detail["page"] == 1 and detail["per_page"] == 100
        doc = json.loads(body)
        size = len(body) + doc["config"]["size"] + doc["layers"][0]["size"]
        assert {t["size"] for t in detail["tags"]} == {size}
        second = c.get(f"/api/v1/repositories/{repo}", params={"page": 2})
        names = [t["name"] for t in second.json()["tags"]]
        assert names == [f"t{i:03d}" for i in range(100, 150)]
        assert c.get(f"/api/v1/repositories/{repo}", params={"per_page": 101}).status_code == 400
    assert reads == Counter({(digest, False): 1}), "read again: the size is cached"


# -- 3. compaction -------------------------------------------------------------------------
def _compactions_held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, list[str]]:
    """Server-side compactions that hold their place until the event is set, then answer
    404 MANIFEST_UNKNOWN; the list names the tags they were started for."""
    import anyio

    from forkd.hub import compaction
    from forkd.hub.errors import Code, RegistryError

    release = threading.Event()
    running: list[str] = []

    async def slow(hub: Any, name: str, tag: str, to: str, **_: Any) -> None:
        running.append(tag)
        while not release.is_set():
            await anyio.sleep(0.02)
        raise RegistryError(Code.MANIFEST_UNKNOWN, f"tag {tag} not in {name}")

    monkeypatch.setattr(compaction, "compact_tag", slow)
    return release, running


def test_compactions_beyond_the_limit_are_refused_not_queued(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the default ``compactions_max`` (2) busy, a third POST /api/v1/compact is 429
    TOOMANYREQUESTS with Retry-After at once; when one ends, the next is taken."""
    release, running = _compactions_held(monkeypatch)
    hub = HubServer(tmp_path / "hub").start()
    try:
        # Three accounts: one account runs one compaction at a time (test_review_hostile9).
        users = [hub.add_user(f"compactor{i}") for i in range(3)]

        def post(tag: str, who: tuple[str, str] = users[2]) -> httpx.Response:
            with hub.client(who) as c:
                return c.post(f"/api/v1/compact/{who[0]}/app", json={"tag": tag, "to": "flat"})

        with ThreadPoolExecutor(2) as pool:
            first = [pool.submit(post, f"busy{i}", users[i]) for i in range(2)]
            deadline = 200
            while len(running) < 2 and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
            assert len(running) == 2, running
            refused = post("third")
            assert refused.status_code == 429, refused.text
            assert error_code(refused) == "TOOMANYREQUESTS"
            assert refused.headers["retry-after"] == "10"
            assert "compactions_max" in refused.text
            assert "third" not in running
            release.set()
            assert [f.result().status_code for f in first] == [404, 404]
        assert post("after").status_code == 404  # the places are given back
    finally:
        hub.stop()


# -- 4. writes go to the caller's row ---------------------------------------------------------
def _swap_for_robot(hub: HubServer, name: str) -> None:
    """Remove user ``name`` and create a robot of the same name (another admin's doing).
    Since review 25 no path of the hub gives a removed user's name to a new account (its
    namespace stays and keeps it: ``accounts.claim_name``); a row an older hub wrote, or
    one written by hand, still may, so the robot is written to the database directly."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from forkd.hub.models import User
    from forkd.hub.settings import HubSettings

    hub.cli("user", "remove", name)
    url = HubSettings(hub.data_dir).validated().database_url
    engine = create_engine(url.replace("+aiosqlite", ""))
    try:
        with Session(engine) as session:
            session.add(User(name=name, is_robot=True))
            session.commit()
    finally:
        engine.dispose()


def _tokens_of(hub: HubServer, name: str) -> str:
    return hub.cli("token", "list", "--user", name).strip()


def test_a_token_is_never_minted_for_an_account_given_the_name_meanwhile(
    fresh_hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio

    from forkd.hub import tokens_api

    hub = fresh_hub
    who = hub.add_user("swapped")
    real_owner = tokens_api._owner

    async def racing_owner(hub_: Any, request: Any) -> Any:
        principal = await real_owner(hub_, request)
        await anyio.to_thread.run_sync(_swap_for_robot, hub, "swapped")
        return principal

    monkeypatch.setattr(tokens_api, "_owner", racing_owner)
    with hub.client(who) as c:
        r = c.post("/api/v1/tokens", json={"name": "ci", "scopes": ["swapped:admin"]})
    assert r.status_code == 401, r.text
    assert "sign in again" in r.text
    assert _tokens_of(hub, "swapped") == "", "the robot got the removed user's token"


def test_an_organisation_never_goes_to_an_account_given_the_name_meanwhile(
    fresh_hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.hub import orgs_api

    hub = fresh_hub
    who = hub.add_user("orgmaker")
    real_is_robot = orgs_api._is_robot

    def racing_is_robot(session: Any, user_id: int | None) -> bool:
        answer = real_is_robot(session, user_id)
        _swap_for_robot(hub, "orgmaker")  # after the check, before the write
        return answer

    monkeypatch.setattr(orgs_api, "_is_robot", racing_is_robot)
    with hub.client(who) as c:
        r = c.post("/api/v1/orgs", json={"name": "swaporg"})
    assert r.status_code == 401, r.text
    with hub.client(ADMIN) as c:
        members = c.get("/api/v1/orgs/swaporg/members")
        assert members.status_code != 200 or "orgmaker" not in members.text, members.text


def test_the_ui_mints_no_token_for_an_account_given_the_name_meanwhile(
    fresh_hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio

    from forkd.hub.ui import account

    hub = fresh_hub
    who = hub.add_user("uiswap")
    real = account._signed_in_with_password

    async def racing(ui: Any, hub_: Any, request: Any, form: Any) -> Any:
        viewer = await real(ui, hub_, request, form)
        await anyio.to_thread.run_sync(_swap_for_robot, hub, "uiswap")
        return viewer

    with browser(hub, *who) as b:
        found = re.search(r'name="csrf" value="([^"]*)"', b.get("/-/settings/tokens").text)
        assert found
        monkeypatch.setattr(account, "_signed_in_with_password", racing)
        r = b.post("/-/settings/tokens",
                   data={"csrf": found.group(1), "name": "web", "scopes": "uiswap:push"})
    assert r.status_code == 400 and "sign in again" in r.text, r.text
    assert _tokens_of(hub, "uiswap") == "", "the robot got the removed user's token"


def test_forkd_compact_remote_waits_while_the_hub_is_busy_and_asks_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client side of the limit: ``compact_remote`` (``forkd compact --remote``) that
    meets a 429 waits as Retry-After says (bounded by RETRY_AFTER_MAX) and asks again, so a
    compaction is not lost to a busy hub; the wait is reported through ``on_busy``."""
    from forkd.registry import compaction as client_side
    from forkd.registry.client import RegistryClient
    from forkd.registry.credentials import Credential
    from forkd.registry.reference import Hub

    release, running = _compactions_held(monkeypatch)
    monkeypatch.setattr(client_side, "RETRY_AFTER_MAX", 0.2)
    hub = HubServer(tmp_path / "hub").start()
    try:
        who = hub.add_user("compactor")
        # Others hold the places: one account runs one compaction at a time.
        others = [hub.add_user(f"busy{i}") for i in range(2)]

        def post(tag: str, as_: tuple[str, str]) -> httpx.Response:
            with hub.client(as_) as c:
                return c.post(f"/api/v1/compact/{as_[0]}/app", json={"tag": tag, "to": "flat"})

        waits: list[float] = []
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(post, f"busy{i}", others[i]) for i in range(2)]
            deadline = 200
            while len(running) < 2 and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
            assert len(running) == 2, running

            def patient() -> None:
                with RegistryClient(Hub(hub.address, "http"), Credential(*who)) as client:
                    client_side.compact_remote(client, "compactor/app", "third", "flat",
                                               on_busy=waits.append)

            third = pool.submit(patient)
            deadline = 200
            while not waits and deadline:
                threading.Event().wait(0.05)
                deadline -= 1
            assert waits and waits[0] == 0.2, waits  # Retry-After 10, bounded for the test
            assert "third" not in running
            release.set()
            assert [f.result().status_code for f in first] == [404, 404]
            from forkd.registry.client import RegistryNotFound

            with pytest.raises(RegistryNotFound, match="MANIFEST_UNKNOWN"):  # the stub's answer
                third.result(timeout=30)
        assert "third" in running, "asked again once a place was free"
    finally:
        hub.stop()


@pytest.mark.parametrize(("header", "seconds"), [
    ("10", 10.0), ("0", 1.0), ("-5", 1.0), ("99999", 30.0), ("nan", 10.0), ("inf", 10.0),
    ("Wed, 21 Oct 2026 07:28:00 GMT", 10.0), (None, 10.0), ("2.5", 2.5),
])
def test_a_hostile_retry_after_neither_spins_nor_hangs_the_client(
    header: str | None, seconds: float
) -> None:
    from forkd.registry.compaction import _retry_after

    assert _retry_after(header) == seconds
