"""Three hub replicas (own data directories) on one PostgreSQL and one S3 bucket behind
HAProxy: a session continued by any replica, push on one and pull on another, GC
beside pushes, revocation, shared limits and quotas, and a replica killed mid-push."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import oras.client  # type: ignore[import-untyped]
import pytest
from hub_support import ADMIN, EMPTY_CONFIG, EMPTY_MEDIA, OCI_MANIFEST, push_blob, sha
from replica_support import (  # noqa: F401  (fixtures are found by name)
    S3_PREFIX,
    TEST_SETTINGS,
    Replica,
    ReplicaSet,
    fresh_replicas_fixture,
    replicas_fixture,
)

from forkd.registry import client as registry_client
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store

MiB = 1 << 20


def _path(location: str) -> str:
    """An upload Location (absolute or not) as a path for another base URL."""
    url = httpx.URL(location)
    return url.raw_path.decode()


def _upload_objects(replicas: ReplicaSet) -> set[str]:
    return {k for k in replicas.objects() if k.startswith(f"{S3_PREFIX}/uploads/")}


def test_a_chunked_upload_continues_on_every_replica(replicas: ReplicaSet) -> None:
    a, b, c = replicas.replicas
    repo = "library/chunked"
    parts = [os.urandom(300_000), os.urandom(200_000), os.urandom(1000)]
    blob = b"".join(parts)
    digest = sha(blob)
    with (
        replicas.client(ADMIN, via=a) as on_a,
        replicas.client(ADMIN, via=b) as on_b,
        replicas.client(ADMIN, via=c) as on_c,
    ):
        r = on_a.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = _path(r.headers["location"])
        offset = 0
        for client, part in ((on_b, parts[0]), (on_c, parts[1])):
            r = client.patch(
                location,
                content=part,
                headers={"Content-Range": f"{offset}-{offset + len(part) - 1}"},
            )
            assert r.status_code == 202, r.text
            offset += len(part)
            assert r.headers["range"] == f"0-{offset - 1}"
            location = _path(r.headers["location"])
        # Any replica reports the session's progress (GET on the upload).
        status = on_a.get(location)
        assert status.status_code == 204 and status.headers["range"] == f"0-{offset - 1}"
        # A chunk that does not start where the upload ends is refused by any replica.
        stale = on_b.patch(location, content=b"x", headers={"Content-Range": "0-0"})
        assert stale.status_code == 416
        r = on_a.put(location, params={"digest": digest}, content=parts[2])
        assert r.status_code == 201, r.text
    with replicas.client(ADMIN) as balanced:
        got = balanced.get(f"/v2/{repo}/blobs/{digest}")
        assert got.status_code == 200 and got.content == blob
    assert not _upload_objects(replicas)  # the chunks went with the session
    for replica in replicas.replicas:  # no staging bytes left in any data directory
        assert not any(p.stat().st_size for p in (replica.data_dir / "uploads").iterdir())


# -- push on one replica, pull on another ---------------------------------------------
def _forkd(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The `forkd` command as a user runs it."""
    argv = [sys.executable, "-P", "-c", "from forkd.cli.main import main; main()", *args]
    return subprocess.run(argv, env=env, input=stdin, capture_output=True, text=True, timeout=600)


def test_forkd_push_on_one_replica_pulls_on_another(
    replicas: ReplicaSet,
    home: Path,
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
) -> None:
    a, b, _ = replicas.replicas
    env = {
        **os.environ,
        "FORKD_HOME": str(home),
        "FORKD_CREDENTIALS": str(tmp_path / "creds.json"),
    }
    for replica in (a, b):
        login = _forkd(
            env, "login", replica.address, "-u", ADMIN[0], "--password-stdin", stdin=ADMIN[1] + "\n"
        )
        assert login.returncode == 0, login.stderr
    pushed = _forkd(env, "push", "d3", f"{a.address}/library/app:v1", "--json")
    assert pushed.returncode == 0, pushed.stderr
    mine = tmp_path / "mine"
    pulled = _forkd({**env, "FORKD_HOME": str(mine)}, "pull", f"{b.address}/library/app:v1")
    assert pulled.returncode == 0, pulled.stderr
    other = Store(mine)
    assert other.resolve("library/app:v1") == store.resolve("d3")
    assert other.assemble("library/app:v1").memory.read_bytes() == images[3].read_bytes()


def _oras(replica: Replica) -> oras.client.OrasClient:
    client = oras.client.OrasClient(hostname=replica.address, insecure=True)
    assert client.login(username=ADMIN[0], password=ADMIN[1]) == {"Status": "Login Succeeded"}
    return client


def test_oci_clients_push_on_one_replica_and_pull_on_another(
    replicas: ReplicaSet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b, c = replicas.replicas
    src = tmp_path / "src"
    src.mkdir()
    payload = os.urandom(300_000)
    (src / "vmstate.bin").write_bytes(payload)
    monkeypatch.chdir(src)
    assert _oras(a).push(files=["vmstate.bin"], target=f"{a.address}/library/oras:v1").ok
    out = tmp_path / "out"
    _oras(b).pull(target=f"{b.address}/library/oras:v1", outdir=str(out))
    assert (out / "vmstate.bin").read_bytes() == payload

    skopeo = shutil.which("skopeo")
    if skopeo is None:
        if os.environ.get("CI"):
            pytest.fail("skopeo is missing: apt-get install -y skopeo")
        pytest.skip("skopeo not installed (apt-get install -y skopeo)")
    creds = f"{ADMIN[0]}:{ADMIN[1]}"

    def copy(*args: str) -> None:
        proc = subprocess.run(
            [skopeo, "--insecure-policy", "copy", *args],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr

    copied = tmp_path / "dir"
    copy("--src-tls-verify=false", "--src-creds", creds,
         f"docker://{b.address}/library/oras:v1", f"dir:{copied}")  # fmt: skip
    copy("--dest-tls-verify=false", "--dest-creds", creds,
         f"dir:{copied}", f"docker://{replicas.address}/library/copied:v1")  # fmt: skip
    with replicas.client(ADMIN, via=c) as on_c:
        original = on_c.get("/v2/library/oras/manifests/v1", headers={"Accept": OCI_MANIFEST})
        again = on_c.get("/v2/library/copied/manifests/v1", headers={"Accept": OCI_MANIFEST})
        assert again.status_code == 200 and again.content == original.content
        assert on_c.get(f"/v2/library/copied/blobs/{sha(payload)}").content == payload


# -- GC beside pushes ----------------------------------------------------------------
def _psql(replicas: ReplicaSet, sql: str) -> str:
    proc = subprocess.run(
        ["psql", "-X", "-q", "-t", "-A", replicas.database_url, "-c", sql],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def _gc(replica: Replica, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-P", "-c", "from forkd.cli.main import main; main()"]
    argv += ["hub", "gc", "--data", str(replica.data_dir), "--config", str(replica.config)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=600)


def test_gc_on_one_replica_loses_nothing_pushed_through_the_others(
    replicas: ReplicaSet, store: Store, chain: list[str], images: list[Path], tmp_path: Path
) -> None:
    a, b, c = replicas.replicas
    # An old blob nothing references: what GC is for (backdated past the grace period).
    with replicas.client(ADMIN, via=b) as on_b:
        old = push_blob(on_b, "library/gc", os.urandom(5000))
    _psql(replicas, f"UPDATE blobs SET created_at = now() - interval '2 hours' "
                    f"WHERE digest = '{old}'")  # fmt: skip
    _psql(replicas, f"UPDATE repository_blobs SET created_at = now() - interval '2 hours' "
                    f"WHERE digest = '{old}'")  # fmt: skip
    # A blob uploaded through B for a manifest not pushed yet (a push in flight).
    layer = os.urandom(40_000)
    with replicas.client(ADMIN, via=b) as on_b:
        in_flight = push_blob(on_b, "library/gc", layer)
        push_blob(on_b, "library/gc", EMPTY_CONFIG)

    errors: list[BaseException] = []

    def push_chain(tag: str, via: Replica) -> None:
        try:
            with RegistryClient(Hub(via.address, "http"), Credential(*ADMIN)) as client:
                push(store, tag, parse_remote(f"{via.address}/library/gc-{tag}:v1"), client)
        except BaseException as exc:  # reported below
            errors.append(exc)

    pushes = [threading.Thread(target=push_chain, args=(tag, r)) for tag, r in
              (("d1", b), ("d2", c), ("d3", b))]  # fmt: skip
    for t in pushes:
        t.start()
    sweeps = [_gc(a) for _ in range(2)]  # while the pushes go through B and C
    for t in pushes:
        t.join()
    assert not errors, errors
    for sweep in sweeps:
        assert sweep.returncode == 0, sweep.stderr
    assert not _stored(replicas, old)  # swept
    # The in-flight blob survived both sweeps: its manifest can still be pushed (on C).
    with replicas.client(ADMIN, via=c) as on_c:
        manifest = _manifest(in_flight, len(layer))
        r = on_c.put("/v2/library/gc/manifests/v1", content=manifest,
                     headers={"Content-Type": OCI_MANIFEST})  # fmt: skip
        assert r.status_code == 201, r.text
        assert on_c.get(f"/v2/library/gc/blobs/{in_flight}").content == layer
    # Every chain pushed during the sweeps pulls whole through A.
    for tag, image in (("d1", images[1]), ("d2", images[2]), ("d3", images[3])):
        mine = Store(tmp_path / f"pull-{tag}")
        with RegistryClient(Hub(a.address, "http"), Credential(*ADMIN)) as client:
            pull(mine, parse_remote(f"{a.address}/library/gc-{tag}:v1"), client)
        assert mine.assemble(f"library/gc-{tag}:v1").memory.read_bytes() == image.read_bytes()


def _stored(replicas: ReplicaSet, digest: str) -> bool:
    return f"{S3_PREFIX}/blobs/sha256/{digest.split(':')[1]}" in replicas.objects()


def _manifest(layer: str, size: int) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": "application/vnd.forkd.snapshot.v1",
            "config": {"mediaType": EMPTY_MEDIA, "digest": sha(EMPTY_CONFIG), "size": 2},
            "layers": [
                {"mediaType": "application/vnd.forkd.vmstate.v1", "digest": layer, "size": size}
            ],
        }
    ).encode()


# -- revocation ------------------------------------------------------------------------
def test_a_token_revoked_on_one_replica_is_refused_by_all_at_once(replicas: ReplicaSet) -> None:
    name, password = replicas.add_user("revoker")
    a, b, c = replicas.replicas
    with replicas.client((name, password), via=a) as on_a:
        r = on_a.post("/api/v1/tokens/", json={"name": "ci", "scopes": [f"{name}:push"]})
        assert r.status_code == 201, r.text
        token_id, secret = r.json()["id"], r.json()["token"]
        # A bearer token issued by A (signed with the key every replica shares) ...
        bearer = on_a.get(
            "/token", params={"scope": f"repository:{name}/app:pull"}, auth=(name, secret)
        ).json()["token"]
    as_bearer = {"Authorization": f"Bearer {bearer}"}
    for replica in replicas.replicas:  # ... works on every replica, as does the API token
        with replicas.client(via=replica) as anon:
            assert anon.get("/v2/", headers=as_bearer).status_code == 200
            assert anon.get("/v2/", auth=(name, secret)).status_code == 200  # now cached there
    with replicas.client((name, password), via=b) as on_b:  # revoked through B
        assert on_b.delete(f"/api/v1/tokens/{token_id}").status_code == 204
    for replica in (a, b, c):  # the documented bound is 0 s: refused on the next request
        with replicas.client(via=replica) as anon:
            assert anon.get("/v2/", headers=as_bearer).status_code == 401
            assert anon.get("/v2/", auth=(name, secret)).status_code == 401


# -- limits and quotas -----------------------------------------------------------------
def _spread(replicas: ReplicaSet, n: int, request: Callable[[httpx.Client], int]) -> list[int]:
    """``n`` concurrent requests, round-robin over the replicas (addressed directly)."""
    clients = [replicas.client(via=r) for r in replicas.replicas]
    barrier = threading.Barrier(n)

    def one(i: int) -> int:
        barrier.wait()
        return request(clients[i % len(clients)])

    try:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))
    finally:
        for client in clients:
            client.close()


def test_failed_logins_are_limited_across_replicas(replicas: ReplicaSet) -> None:
    name, password = replicas.add_user("guessed")
    limit = TEST_SETTINGS["login_fail_limit"]
    guesser = {"X-Forwarded-For": "198.51.100.23"}  # replicas trust the balancer's address

    guesses = iter(range(1000))
    lock = threading.Lock()

    def guess(client: httpx.Client) -> int:
        with lock:
            wrong = f"wrong-guess-{next(guesses)}"
        return client.get("/v2/", auth=(name, wrong), headers=guesser).status_code

    codes = _spread(replicas, 3 * limit, guess)
    assert sorted(codes) == [401] * int(limit) + [429] * (2 * int(limit)), codes
    with replicas.client(via=replicas.replicas[2]) as c:  # still limited, right password too
        assert c.get("/v2/", auth=(name, password), headers=guesser).status_code == 429
        other = {"X-Forwarded-For": "198.51.100.24"}
        assert c.get("/v2/", auth=(name, password), headers=other).status_code == 200


def test_quotas_hold_across_replicas(replicas: ReplicaSet) -> None:
    replicas.cli("org", "add", "quota-org")
    replicas.cli("quota", "set", "quota-org", "1000")
    blobs = [os.urandom(300) for _ in range(9)]
    sent = iter(range(len(blobs)))
    lock = threading.Lock()

    def upload(client: httpx.Client) -> int:
        with lock:
            i = next(sent)
        data = blobs[i]
        r = client.post(
            f"/v2/quota-org/r{i % 3}/blobs/uploads/",
            params={"digest": sha(data)},
            content=data,
            auth=ADMIN,
        )
        return r.status_code

    codes = _spread(replicas, len(blobs), upload)
    assert sorted(codes) == [201] * 3 + [403] * 6, codes
    with replicas.client(ADMIN) as c:
        assert c.get("/api/v1/namespaces/quota-org/quota").json()["used_bytes"] == 900
    assert sum(_stored(replicas, sha(d)) for d in blobs) == 3

    # Open upload sessions count across replicas too: a session on A holds 600 bytes,
    # then B may not take more than the 100 left.
    replicas.cli("quota", "set", "quota-org", "1500")
    a, b, _ = replicas.replicas
    with replicas.client(ADMIN, via=a) as on_a, replicas.client(ADMIN, via=b) as on_b:
        r = on_a.post("/v2/quota-org/held/blobs/uploads/")
        location = _path(r.headers["location"])
        assert on_a.patch(location, content=os.urandom(600),
                          headers={"Content-Range": "0-599"}).status_code == 202  # fmt: skip
        more = os.urandom(200)
        r = on_b.post("/v2/quota-org/other/blobs/uploads/", params={"digest": sha(more)},
                      content=more)  # fmt: skip
        assert r.status_code == 403, r.text
        assert on_b.delete(location).status_code == 204  # cancelled on B: the room is back
        r = on_b.post("/v2/quota-org/other/blobs/uploads/", params={"digest": sha(more)},
                      content=more)  # fmt: skip
        assert r.status_code == 201, r.text


# -- a replica killed mid-push ------------------------------------------------------------
def test_a_replica_killed_mid_push_loses_nothing(
    fresh_replicas: ReplicaSet,
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rs = fresh_replicas
    victim = rs.replicas[1]
    # Small chunks, so a blob's upload is many PATCHes, spread over the replicas.
    monkeypatch.setattr(registry_client, "UPLOAD_CHUNK", 64 << 10)
    big = os.urandom(2 * MiB)
    target = Hub(rs.address, "http")
    results: dict[str, object] = {}

    def push_all() -> None:
        try:
            with RegistryClient(target, Credential(*ADMIN)) as client:
                client.put_blob("library/kill", sha(big), len(big), lambda o, n: big[o : o + n])
                results["chain"] = push(
                    store, "d3", parse_remote(f"{rs.address}/library/kill:v1"), client
                ).digest
        except BaseException as exc:  # reported below
            results["error"] = exc

    pusher = threading.Thread(target=push_all)
    pusher.start()
    deadline = time.monotonic() + 300
    while _psql(rs, "SELECT count(*) FROM upload_chunks") in ("", "0"):  # under way
        assert time.monotonic() < deadline and pusher.is_alive(), results
        time.sleep(0.05)
    # Catch the victim with a request of the push open on it, then kill it: the balancer
    # answers that request 502 (its connection broke), and the client must try again.
    victim.freeze()
    while not rs.in_flight(victim):
        assert time.monotonic() < deadline and pusher.is_alive(), results
        time.sleep(0.02)
    victim.kill()
    pusher.join(600)
    assert "error" not in results, results["error"]
    assert results["chain"] == store.resolve("d3")
    with rs.client(ADMIN) as c:
        assert c.get(f"/v2/library/kill/blobs/{sha(big)}").content == big
    mine = Store(tmp_path / "mine")
    with RegistryClient(target, Credential(*ADMIN)) as client:
        pull(mine, parse_remote(f"{rs.address}/library/kill:v1"), client)
    assert mine.assemble("library/kill:v1").memory.read_bytes() == images[3].read_bytes()
