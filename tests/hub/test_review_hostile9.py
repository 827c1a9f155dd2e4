"""Hostile review 9: credentials stay out of the audit log and never crash a parser, the
login limiter counts what a client cannot pick, a mount never links swept bytes, and what
one view or one account may cost is bounded whatever a pusher creates.

1. a refused login was audited under the user name sent: a token pasted there (``fkd_…``)
   or a password typed there went into the append-only log in clear;
2. a mount read the source's link and the blob before the GC lock: a PostgreSQL sweep
   queued in between removed both and the mount linked (201) bytes that were gone;
3. a credential header that is not ASCII was a 500 (compare_digest on str, b64decode);
4. every sign-in added a session row (repeated ones skip argon2): unbounded per account;
5. the failed-login limiter counted IPv6 addresses one by one (a /64 is 2**64 of them),
   and a trusted proxy written as ``::ffff:a.b.c.d`` was taken for the client;
6. the pack page listed and read the facts of every tag; 7. a VMM search read every tag
   of 5,000 packs; 8. a lineage listed every referrer of a level; 9. pages loaded every
   manifest's annotations (4 MiB each);
10. one account's compactions could take every ``compactions_max`` place.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import queue
import re
import sqlite3
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from hub_support import EMPTY_CONFIG, EMPTY_MEDIA, OCI_MANIFEST, HubServer, push_blob
from sqlalchemy import text

from forkd.hub.gc import GcReport, collect
from forkd.hub.services import Hub
from forkd.hub.settings import HubSettings
from forkd.pack.config import Compat
from forkd.store.store import Store
from forkd.synthetic import write_base

TIMEOUT = 60


def _name(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10**9}"


def _audit(hub: HubServer) -> list[dict[str, object]]:
    path: Path = hub.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


# -- 1. a refused login's user field is not kept when it is no user name ------------------
def test_a_credential_sent_as_the_user_name_is_not_audited(hub: HubServer) -> None:
    """Before: ``{"actor": "fkd_…", "action": "login", "result": "denied"}``: the token
    in clear in the audit log (also a password typed into the user field)."""
    alice = hub.add_user(_name("alice"))
    secret = hub.token(alice[0], f"{alice[0]}:pull")
    assert secret.startswith("fkd_")
    typed_password = "Correct Horse Battery Staple!"
    with hub.client() as c:
        # A token as the user name (a client that sends TOKEN:x), with the wrong password.
        assert c.get("/v2/", headers=_basic(secret, "x")).status_code == 401
        assert c.get("/v2/", headers=_basic(secret, "fkd_not-a-token")).status_code == 401
        # A password typed into the user name field.
        assert c.get("/v2/", headers=_basic(typed_password, "")).status_code == 401
        # The UI's sign-in form goes through the same check.
        page = c.get("/-/signin")
        csrf = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
        assert csrf
        r = c.post(
            "/-/signin",
            data={"login_csrf": csrf.group(1), "username": secret, "password": "wrong-one"},
        )
        assert r.status_code == 401, r.text
        # A name an account could have is still what the record names.
        wrong = c.get("/v2/", headers=_basic(alice[0], "not-her-password"))
        assert wrong.status_code == 401
    log_text = (hub.data_dir / "audit.log").read_text()
    assert secret not in log_text
    assert secret[4:20] not in log_text
    assert typed_password not in log_text
    denied = [e for e in _audit(hub) if e["action"] == "login" and e["result"] == "denied"]
    actors = [e["actor"] for e in denied]
    assert actors.count("(not a user name)") >= 4, actors
    assert alice[0] in actors


# -- 2. a mount reads the source under the GC lock ------------------------------------------
class _Holder:
    """A transaction (its own hub process state, as a second replica would have) holding
    the writers' side of the GC lock, which tells how many advisory lock requests queue
    behind it (PostgreSQL's ``pg_locks``)."""

    def __init__(self, hub: HubServer) -> None:
        self.server = hub
        self.held = threading.Event()
        self.release = threading.Event()
        self.wanted: queue.Queue[tuple[int, threading.Event]] = queue.Queue()
        self.failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            asyncio.run(self._hold())
        except BaseException as exc:  # the test reports it
            self.failed.append(exc)
            self.held.set()

    async def _hold(self) -> None:
        settings = HubSettings(self.server.data_dir, **self.server.overrides)
        hub = Hub.build(settings.validated())
        waiting = text("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
        try:
            async with hub.db.transaction() as session:
                await hub.db.lock_for_write(session)
                self.held.set()
                while not self.release.is_set():
                    try:
                        count, reached = self.wanted.get_nowait()
                    except queue.Empty:
                        await asyncio.sleep(0.02)
                        continue
                    deadline = time.monotonic() + TIMEOUT
                    while (await session.scalar(waiting) or 0) < count:
                        assert time.monotonic() < deadline, f"{count} lock waiters never came"
                        await asyncio.sleep(0.02)
                    reached.set()
        finally:
            await hub.close()

    def queued(self, count: int) -> None:
        """Return once ``count`` advisory lock requests wait behind this transaction."""
        reached = threading.Event()
        self.wanted.put((count, reached))
        assert reached.wait(TIMEOUT), self.failed


def _sweep(server: HubServer) -> GcReport:
    async def go() -> GcReport:
        hub = Hub.build(HubSettings(server.data_dir, **server.overrides).validated())
        try:
            return await collect(
                hub.db, hub.blobs, hub.uploads, grace=timedelta(0), upload_ttl=timedelta(hours=1)
            )
        finally:
            await hub.close()

    return asyncio.run(go())


def test_a_mount_never_links_a_blob_a_concurrent_sweep_removed(
    postgres_url: str, tmp_path: Path
) -> None:
    """Before: the mount read ``alice/src``'s link and the blob's presence, then queued for
    the GC lock behind a sweep; the sweep removed the unreferenced blob (link, row, bytes),
    and the mount linked it anyway: 201, then ``GET`` of the blob 404 and a manifest
    naming it accepted. Now the mount reads after the lock: the link is gone, so it falls
    back to an upload session (202), as the distribution spec says."""
    server = HubServer(tmp_path / "hub", {"database_url": postgres_url}).start()
    try:
        alice = server.add_user(_name("alice"))
        src, dst = f"{alice[0]}/src", f"{alice[0]}/dst"
        orphan = f"pushed long ago, never in a manifest {time.time()}".encode()
        with server.client(alice) as c:
            digest = push_blob(c, src, orphan)
            push_blob(c, dst, b"dst exists")
        holder = _Holder(server)
        holder.thread.start()
        assert holder.held.wait(TIMEOUT) and not holder.failed, holder.failed
        with ThreadPoolExecutor(2) as pool:
            sweep = pool.submit(_sweep, server)
            holder.queued(1)  # the sweep waits for the exclusive side

            def mount() -> httpx.Response:
                with server.client(alice) as c:
                    return c.post(
                        f"/v2/{dst}/blobs/uploads/", params={"mount": digest, "from": src}
                    )

            mounted = pool.submit(mount)
            holder.queued(2)  # the mount waits too, behind the sweep
            holder.release.set()
            holder.thread.join(TIMEOUT)
            assert not holder.failed, holder.failed
            report = sweep.result(TIMEOUT)
            r = mounted.result(TIMEOUT)
        assert digest in report.blobs  # the sweep did remove it
        with server.client(alice) as c:
            if r.status_code == 201:
                blob = c.get(f"/v2/{dst}/blobs/{digest}")
                assert blob.status_code == 200, f"mounted {digest}, then: {blob.text}"
            else:
                assert r.status_code == 202, r.text  # an upload session instead
                assert c.get(f"/v2/{dst}/blobs/{digest}").status_code == 404
                # The client uploads the bytes again, and the blob is whole.
                assert push_blob(c, dst, orphan) == digest
                assert c.get(f"/v2/{dst}/blobs/{digest}").content == orphan
    finally:
        server.stop()


# -- 3. credentials that are not ASCII are refused, not a 500 -------------------------------
NOT_ASCII = [
    b"Bearer fkb.e30.\xe9t\xe9",  # a bearer token's signature: compare_digest raised
    b"Basic \xe9\xe9\xe9\xe9",  # a Basic credential: b64decode raised ValueError
    b"Basic YWxpY2U6\xff",
]
AUTHENTICATED_ROUTES = [
    "/v2/",
    "/token",
    "/metrics",
    "/v2/_catalog",
    "/v2/nobody/app/tags/list",
    "/v2/nobody/app/manifests/latest",
    "/api/v1/repositories",
    "/api/v1/tokens",
    "/api/v1/readme/nobody/app",
]


def test_a_credential_that_is_not_ascii_is_refused_on_every_route(hub: HubServer) -> None:
    """Before: 500 Internal Server Error, and a traceback in the hub's log per request."""
    with hub.client() as c:
        for header in NOT_ASCII:
            for path in AUTHENTICATED_ROUTES:
                r = c.get(path, headers=[(b"Authorization", header)])
                assert r.status_code in (400, 401), (header, path, r.status_code, r.text)
                assert r.status_code != 401 or "www-authenticate" in r.headers, (path, header)


# -- 4. the browser sessions one account keeps are bounded ------------------------------------
def _sign_in(hub: HubServer, who: tuple[str, str]) -> str:
    """A new browser session for ``who``: its ``forkd_session`` cookie."""
    with hub.client() as c:
        page = c.get("/-/signin")
        csrf = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
        assert csrf
        r = c.post(
            "/-/signin",
            data={"login_csrf": csrf.group(1), "username": who[0], "password": who[1]},
        )
        assert r.status_code == 303, r.text
        return r.cookies["forkd_session"]


def _signed_in(hub: HubServer, cookie: str) -> bool:
    with hub.client() as c:
        r = c.get("/-/settings/tokens", headers={"Cookie": f"forkd_session={cookie}"})
        return r.status_code == 200


def test_the_sessions_one_account_keeps_are_bounded(hub: HubServer) -> None:
    """Before: every sign-in added a ``ui_sessions`` row kept for 12 h, and sign-ins with
    the same credentials skip the argon2 check (the credential cache): one account added
    rows as fast as it posted the form. Now a sign-in ends that user's oldest sessions
    beyond ``SESSIONS_PER_USER``; other users' sessions are untouched."""
    from forkd.hub.ui.account import SESSIONS_PER_USER

    alice, bob = hub.add_user(_name("alice")), hub.add_user(_name("bob"))
    bobs = _sign_in(hub, bob)
    cookies = [_sign_in(hub, alice) for _ in range(SESSIONS_PER_USER + 5)]
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        (rows,) = db.execute(
            "SELECT count(*) FROM ui_sessions JOIN users ON users.id = ui_sessions.user_id "
            "WHERE users.name = ?",
            (alice[0],),
        ).fetchone()
    assert rows == SESSIONS_PER_USER
    assert not _signed_in(hub, cookies[0])  # the oldest ended
    assert all(_signed_in(hub, c) for c in cookies[-SESSIONS_PER_USER:])
    assert _signed_in(hub, bobs)


# -- 5. the failed-login limiter counts an IPv6 client by its /64 ---------------------------
def test_an_ipv6_client_cannot_rotate_addresses_past_the_login_limit(tmp_path: Path) -> None:
    """Before: counted per address, so a client with an IPv6 /64 (2**64 addresses, the
    smallest block ISPs and clouds hand out) got ``login_fail_limit`` more guesses from
    each new source address. Now addresses of one /64 count together (and an
    IPv4-mapped address as its IPv4); another /64 is someone else. The addresses come
    through a trusted proxy's X-Forwarded-For, as the hub sees them behind one."""
    limit = 3
    server = HubServer(
        tmp_path / "hub", {"login_fail_limit": limit, "trusted_proxies": "127.0.0.1/32"}
    ).start()
    try:
        name, password = server.add_user("target")
        with server.client() as c:
            for i in range(limit):
                source = {"X-Forwarded-For": f"2001:db8:1:2::{i + 1:x}"}
                r = c.get("/v2/", auth=(name, f"guess-{i}-xx"), headers=source)
                assert r.status_code == 401, (i, r.text)
            for i in range(limit, limit + 3):  # new addresses of the same /64
                source = {"X-Forwarded-For": f"2001:db8:1:2:{i:x}::{i:x}"}
                r = c.get("/v2/", auth=(name, f"guess-{i}-xx"), headers=source)
                assert r.status_code == 429, (i, r.status_code)
            # Another /64 (another site) is not held by that one's failures.
            other = {"X-Forwarded-For": "2001:db8:1:3::1"}
            assert c.get("/v2/", auth=(name, password), headers=other).status_code == 200
            # An IPv4 client is its IPv4 address however it is written.
            for i in range(limit):
                v4 = {"X-Forwarded-For": "198.51.100.20"}
                assert c.get("/v2/", auth=(name, f"v4-{i}-xxx"), headers=v4).status_code == 401
            mapped = {"X-Forwarded-For": "::ffff:198.51.100.20"}
            assert c.get("/v2/", auth=(name, "mapped-xxx"), headers=mapped).status_code == 429
    finally:
        server.stop()


# -- 6. a pack page reads and lists one page of tags ------------------------------------------
def test_a_pack_page_lists_and_reads_one_page_of_tags(hub: HubServer) -> None:
    """Before: the pack page (and every tag page) read the facts of every tag of the
    repository (its manifest and config: two blob reads each, S3 GETs with that backend)
    and listed them all, so one anonymous view of a public pack with thousands of tags
    cost thousands of reads. Now a page lists ``TAGS_PER_PAGE`` tags, with links to the
    others, and a tag page reads its own chain only."""
    from forkd.hub.ui.queries import TAGS_PER_PAGE

    alice = hub.add_user(_name("alice"))
    repo = f"{alice[0]}/many"
    total = TAGS_PER_PAGE + 7
    with hub.client(alice) as c:
        config, layer = push_blob(c, repo, EMPTY_CONFIG), push_blob(c, repo, b"one layer")
        for i in range(total):
            doc = {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": EMPTY_MEDIA, "digest": config, "size": 2},
                "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": 9}],
                "annotations": {"n": str(i)},  # a manifest of its own per tag
            }
            r = c.put(
                f"/v2/{repo}/manifests/t{i:03d}",
                content=json.dumps(doc).encode(),
                headers={"Content-Type": OCI_MANIFEST},
            )
            assert r.status_code == 201, r.text
    hub.public(repo)
    with hub.client() as anonymous:
        first = anonymous.get(f"/{repo}")
        assert first.status_code == 200, first.text
        listed = re.findall(rf'href="/{repo}/-/tags/(t\d+)"', first.text)
        assert len(listed) == TAGS_PER_PAGE, len(listed)
        assert f"{total} tags" in first.text
        nxt = re.search(r'rel="next" href="([^"]+)"', first.text)
        assert nxt, "no link to the next page of tags"
        second = anonymous.get(nxt.group(1).replace("&amp;", "&"))
        assert second.status_code == 200, second.text
        rest = re.findall(rf'href="/{repo}/-/tags/(t\d+)"', second.text)
        assert sorted(listed + rest) == [f"t{i:03d}" for i in range(total)]
        assert anonymous.get(f"/{repo}", params={"page": 3}).status_code == 404
        tag_page = anonymous.get(f"/{repo}/-/tags/t{total - 1:03d}")
        assert tag_page.status_code == 200, tag_page.text
        assert f"{repo}:t{total - 1:03d}" in tag_page.text


# -- 7. a filtered search reads a bounded number of packs' facts ------------------------------
def _compat(vmm: str) -> Compat:
    return Compat(
        vmm=vmm,
        vmm_version="8.2.2",
        machine="microvm",
        cpu_model="max",
        accelerators=["kvm"],
        vcpus=1,
        memory_mib=4,
        kernel_digest=None,
        agent_protocol=1,
    )


def test_a_filtered_search_reads_each_packs_newest_tags_only(
    backend_hub: HubServer, tmp_path: Path
) -> None:
    """Before: ``/-/search?vmm=…`` (anyone's, signed out too) read the facts of every tag
    of up to 5,000 packs: two blob reads per tag, so one request over a public pack
    with thousands of tags cost thousands of reads. Now each pack's newest
    ``FILTER_TAGS_PER_PACK`` tags count (and at most ``FILTER_SCAN_FACTS`` manifests a
    search): a qemu tag older than ten firecracker tags no longer makes the pack match."""
    from forkd.hub.ui.queries import FILTER_TAGS_PER_PACK

    hub = backend_hub  # SQLite and PostgreSQL: the newest tags are a window function

    alice = hub.add_user(_name("alice"))
    store = Store.open(tmp_path / "store")
    for tag, vmm, seed in (("q", "qemu", 21), ("f", "firecracker", 22)):
        image = tmp_path / f"{tag}.mem"
        write_base(image, 4 << 20, seed=seed)
        store.import_layer(tag, memory=image, compat=_compat(vmm))
    mixed, plain = f"{alice[0]}/mixed", f"{alice[0]}/plain"
    hub.push(store, "q", f"{mixed}:old-qemu", alice)
    for i in range(FILTER_TAGS_PER_PACK):
        hub.push(store, "f", f"{mixed}:new{i:02d}", alice)
    hub.push(store, "q", f"{plain}:v1", alice)
    hub.public(mixed)
    hub.public(plain)

    def found(vmm: str) -> set[str]:
        with hub.client() as anonymous:
            r = anonymous.get("/-/search", params={"vmm": vmm, "namespace": alice[0]})
            assert r.status_code == 200, r.text
            return set(re.findall(rf'href="/({alice[0]}/[a-z]+)"', r.text))

    assert found("qemu") == {plain}
    assert found("firecracker") == {mixed}


def test_a_trusted_proxy_is_trusted_however_its_address_is_written(tmp_path: Path) -> None:
    """Before: a trusted proxy's hop written as an IPv4-mapped IPv6 address
    (``::ffff:127.0.0.1``, as a dual-stack listener or proxy writes it) was not
    recognised, so the hub took the proxy for the client: every client behind it shared
    one failed-login count, and one guesser locked all of them out."""
    limit = 3
    server = HubServer(
        tmp_path / "hub", {"login_fail_limit": limit, "trusted_proxies": "127.0.0.1/32"}
    ).start()
    try:
        name, password = server.add_user("behind")
        with server.client() as c:
            guesser = {"X-Forwarded-For": "198.51.100.7, ::ffff:127.0.0.1"}
            for i in range(limit):
                r = c.get("/v2/", auth=(name, f"guess-{i}-xx"), headers=guesser)
                assert r.status_code == 401, r.text
            assert c.get("/v2/", auth=(name, "again-xxx"), headers=guesser).status_code == 429
            someone_else = {"X-Forwarded-For": "198.51.100.8, ::ffff:127.0.0.1"}
            r = c.get("/v2/", auth=(name, password), headers=someone_else)
            assert r.status_code == 200, r.text
    finally:
        server.stop()


# -- 8. a lineage names a bounded number of descendants ---------------------------------------
def test_a_lineage_lists_a_bounded_number_of_descendants(hub: HubServer) -> None:
    """Before: the descendants were bounded per level of the graph only, so a manifest
    with thousands of referrers (each one PUT, by anyone who may push) made every view of
    its tag page and lineage API, signed out too on a public pack, list and draw them all.
    Now at most ``MAX_CHAIN`` in all, on both."""
    from forkd.hub.chains import MAX_CHAIN

    alice = hub.add_user(_name("alice"))
    repo = f"{alice[0]}/popular"
    with hub.client(alice) as c:
        config, layer = push_blob(c, repo, EMPTY_CONFIG), push_blob(c, repo, b"one layer")

        def manifest(n: int, subject: dict[str, object] | None = None) -> dict[str, object]:
            doc: dict[str, object] = {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": EMPTY_MEDIA, "digest": config, "size": 2},
                "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": 9}],
                "annotations": {"n": str(n)},
            }
            if subject:
                doc["subject"] = subject
            return doc

        base = json.dumps(manifest(-1)).encode()
        r = c.put(
            f"/v2/{repo}/manifests/base", content=base, headers={"Content-Type": OCI_MANIFEST}
        )
        assert r.status_code == 201, r.text
        subject = {
            "mediaType": OCI_MANIFEST,
            "digest": r.headers["docker-content-digest"],
            "size": len(base),
        }
        for i in range(MAX_CHAIN + 4):
            body = json.dumps(manifest(i, subject)).encode()
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            r = c.put(
                f"/v2/{repo}/manifests/{digest}",
                content=body,
                headers={"Content-Type": OCI_MANIFEST},
            )
            assert r.status_code == 201, r.text
    hub.public(repo)
    with hub.client() as anonymous:
        lineage = anonymous.get(f"/api/v1/lineage/{repo}", params={"tag": "base"})
        assert lineage.status_code == 200, lineage.text
        assert len(lineage.json()["descendants"]) == MAX_CHAIN
        page = anonymous.get(f"/{repo}/-/tags/base")
        assert page.status_code == 200, page.text
        nodes = re.findall(r'data-testid="node-', page.text)
        assert len(nodes) == MAX_CHAIN + 1, len(nodes)  # the tag itself and its descendants


# -- 9. a page does not load every manifest's annotations ----------------------------------------
def test_pack_tag_and_lineage_views_do_not_load_every_manifests_annotations(
    hub: HubServer,
) -> None:
    """Before: the pack page, the tag page and the lineage API loaded every manifest row of
    the repository with its annotations (each up to ``manifest_max_bytes``, 4 MiB), on
    every view: a pusher's few dozen manifests with large annotations made each signed-out
    view of a public pack hold hundreds of MiB. Now no view loads annotations but those
    of the nodes it names, each at most ``NOTES_MAX`` characters. Measured: the peak of
    Python allocations while the hub (in this process) answers."""
    alice = hub.add_user(_name("alice"))
    repo = f"{alice[0]}/noted"
    big, count = 2 << 20, 12
    with hub.client(alice) as c:
        config, layer = push_blob(c, repo, EMPTY_CONFIG), push_blob(c, repo, b"one layer")

        def put(doc: dict[str, object], reference: str | None = None) -> tuple[str, int]:
            body = json.dumps(doc).encode()
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
            r = c.put(
                f"/v2/{repo}/manifests/{reference or digest}",
                content=body,
                headers={"Content-Type": OCI_MANIFEST},
            )
            assert r.status_code == 201, r.text
            return digest, len(body)

        common = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": {"mediaType": EMPTY_MEDIA, "digest": config, "size": 2},
            "layers": [{"mediaType": "application/octet-stream", "digest": layer, "size": 9}],
        }
        base, size = put(common, "base")
        subject = {"mediaType": OCI_MANIFEST, "digest": base, "size": size}
        for i in range(count):  # untagged referrers of base, each with 2 MiB of annotations
            put({**common, "subject": subject, "annotations": {"note": f"{i}" + "x" * big}})
    hub.public(repo)
    views = [f"/{repo}", f"/{repo}/-/tags/base", f"/api/v1/lineage/{repo}?tag=base"]
    with hub.client() as anonymous:
        for view in views:
            assert anonymous.get(view).status_code == 200  # warm: caches, templates
        tracemalloc.start()
        try:
            for view in views:
                tracemalloc.reset_peak()
                r = anonymous.get(view)
                peak = tracemalloc.get_traced_memory()[1]
                assert r.status_code == 200, r.text
                assert peak < count * big // 2, f"{view}: {peak >> 20} MiB at peak"
        finally:
            tracemalloc.stop()


# -- 10. one account runs one server-side compaction at a time ---------------------------------
def test_one_account_cannot_take_every_compaction_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: ``compactions_max`` (2) places for the whole hub, and one account's two
    requests (each may write 16 GiB and hold a core for minutes) took both: every other
    account got 429 for as long as it kept asking. Now an account's second concurrent
    request is the 429 (``Retry-After``), and the place stays free for someone else.
    The compaction work is held (``_compactions_held``): the admission is what is tested."""
    from test_review_hostile6 import _compactions_held

    release, running = _compactions_held(monkeypatch)
    server = HubServer(tmp_path / "hub").start()
    try:
        alice, bob = server.add_user("alice"), server.add_user("bob")

        def post(who: tuple[str, str], tag: str) -> httpx.Response:
            # A short timeout: without the bound, alice's second request takes the other
            # place and is held too.
            with httpx.Client(base_url=server.url, auth=who, timeout=10) as c:
                return c.post(f"/api/v1/compact/{who[0]}/app", json={"tag": tag, "to": "flat"})

        with ThreadPoolExecutor(2) as pool:
            held = pool.submit(post, alice, "first")
            deadline = time.monotonic() + TIMEOUT
            while "first" not in running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert running == ["first"]
            again = post(alice, "second")
            assert again.status_code == 429, again.text
            assert again.headers["retry-after"] == "10"
            assert "one per account" in again.text
            other = pool.submit(post, bob, "bobs")
            while "bobs" not in running and time.monotonic() < deadline:
                time.sleep(0.02)
            assert running == ["first", "bobs"]  # the second place went to bob
            release.set()
            assert held.result(TIMEOUT).status_code == 404  # the held work's answer
            assert other.result(TIMEOUT).status_code == 404
        assert post(alice, "later").status_code == 404  # alice's place is given back
    finally:
        release.set()
        server.stop()
