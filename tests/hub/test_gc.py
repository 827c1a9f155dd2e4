"""`forkd hub gc` against a running hub: unreferenced blobs go, referenced and in-flight stay."""

from __future__ import annotations

from hub_support import OCI_MANIFEST, HubServer, artifact, error_code, push_blob, sha

from forkd.store.blobs import FsBlobStore


def _on_disk(hub: HubServer, digest: str) -> bool:
    hexd = digest.split(":", 1)[1]
    return (hub.data_dir / "blobs" / "sha256" / hexd[:2] / hexd).is_file()


def test_gc_sweeps_only_what_nothing_references(fresh_hub: HubServer) -> None:
    user = fresh_hub.add_user("gcuser")
    repo = "gcuser/app"
    kept_layer, dropped_layer, loose = b"kept layer", b"dropped layer", b"never referenced"
    in_flight = b"uploaded while gc runs" * 1000
    with fresh_hub.client(auth=user) as c:
        kept, kept_body = artifact(c, repo, kept_layer, tag="v1")
        subject = {"mediaType": OCI_MANIFEST, "digest": kept, "size": len(kept_body)}
        child, _ = artifact(c, repo, b"child layer", tag="v2", subject=subject)
        dropped, _ = artifact(c, repo, dropped_layer, tag="old")
        assert c.delete(f"/v2/{repo}/manifests/{dropped}").status_code == 202
        push_blob(c, repo, loose)
        session = c.post(f"/v2/{repo}/blobs/uploads/").headers["location"]
        assert c.patch(session, content=in_flight[:5000]).status_code == 202
        # Untagging keeps the manifest: untagged manifests are not collected.
        assert c.delete(f"/v2/{repo}/manifests/v1").status_code == 202
    orphan = FsBlobStore(fresh_hub.data_dir / "blobs").put_bytes(b"file without a row")

    out = fresh_hub.cli("gc", "--grace-minutes", "0", "--dry-run")
    assert out.startswith("would remove 3 blobs") and "1 orphan files" in out
    assert _on_disk(fresh_hub, sha(loose))
    out = fresh_hub.cli("gc")  # default grace: everything is too fresh to go
    assert out.startswith("removed 0 blobs") and "0 orphan files" in out

    out = fresh_hub.cli("gc", "--grace-minutes", "0")
    assert out.startswith("removed 3 blobs")  # dropped manifest, its layer, the loose blob
    for digest in (dropped, sha(dropped_layer), sha(loose), orphan):
        assert not _on_disk(fresh_hub, digest)
    for digest in (kept, child, sha(kept_layer), sha(b"{}")):
        assert _on_disk(fresh_hub, digest)

    with fresh_hub.client(auth=user) as c:
        r = c.get(f"/v2/{repo}/blobs/{sha(loose)}")
        assert r.status_code == 404 and error_code(r) == "BLOB_UNKNOWN"
        assert c.get(f"/v2/{repo}/manifests/{kept}").content == kept_body
        assert c.get(f"/v2/{repo}/blobs/{sha(kept_layer)}").content == kept_layer
        # The upload that was in flight during the sweep finishes normally.
        r = c.patch(session, content=in_flight[5000:], headers={"Content-Range": "5000-21999"})
        assert r.status_code == 202
        r = c.put(session, params={"digest": sha(in_flight)})
        assert r.status_code == 201
        assert c.get(f"/v2/{repo}/blobs/{sha(in_flight)}").content == in_flight
        # A collected blob can simply be pushed again.
        push_blob(c, repo, loose)
        assert c.get(f"/v2/{repo}/blobs/{sha(loose)}").content == loose


def test_gc_drops_idle_upload_sessions(fresh_hub: HubServer) -> None:
    user = fresh_hub.add_user("idle")
    with fresh_hub.client(auth=user) as c:
        session = c.post("/v2/idle/app/blobs/uploads/").headers["location"]
        c.patch(session, content=b"abandoned")
        assert "0 stale uploads" in fresh_hub.cli("gc")
        assert c.get(session).status_code == 204
        assert "1 stale uploads" in fresh_hub.cli("gc", "--upload-ttl-hours", "0")
        assert c.get(session).status_code == 404
    assert list((fresh_hub.data_dir / "uploads").iterdir()) == []


def test_gc_racing_pushes_never_leaves_a_manifest_without_its_blobs(
    backend_hub: HubServer,
) -> None:
    """With no grace at all, pushes may be refused (MANIFEST_BLOB_UNKNOWN) but every
    manifest the hub accepted stays complete."""
    import asyncio
    import json
    import threading
    from datetime import timedelta

    from forkd.hub.gc import collect
    from forkd.hub.services import Hub
    from forkd.hub.settings import HubSettings

    user = backend_hub.add_user("racer")
    accepted: list[tuple[str, str]] = []
    unexpected: list[str] = []
    refused: list[str] = []
    stop = threading.Event()
    sweeps: list[int] = []

    def sweeper() -> None:
        async def loop() -> None:
            settings = HubSettings(backend_hub.data_dir, **backend_hub.overrides)
            hub = Hub.build(settings.validated())
            try:
                while not stop.is_set():
                    report = await collect(
                        hub.db,
                        hub.blobs,
                        hub.uploads,
                        grace=timedelta(0),
                        upload_ttl=timedelta(hours=1),
                    )
                    sweeps.append(len(report.blobs))
                    await asyncio.sleep(0.02)  # a sweep loop, not a spin: pushes get turns
            finally:
                await hub.close()

        asyncio.run(loop())

    def pusher(n: int) -> None:
        with backend_hub.client(auth=user) as c:
            for i in range(6):
                payload = b"shared payload" if i % 2 else f"payload {n}-{i}".encode()
                tag = f"t{n}-{i}"
                for _attempt in range(5):  # a client pushes again after a refusal
                    try:
                        digest, _ = artifact(c, "racer/app", payload, tag=tag)
                    except AssertionError as exc:
                        # The one allowed refusal: a sweep took a blob before the manifest.
                        if "MANIFEST_BLOB_UNKNOWN" not in str(exc):
                            unexpected.append(str(exc))
                        refused.append(tag)
                        continue
                    accepted.append((tag, digest))
                    break

    threads = [threading.Thread(target=pusher, args=(n,)) for n in range(3)]
    gc_thread = threading.Thread(target=sweeper)
    gc_thread.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    gc_thread.join()
    assert sweeps, "the sweeper never ran"
    assert unexpected == []
    assert accepted, "no push got through"
    print(f"{len(accepted)} tags pushed, {len(refused)} refusals, {sum(sweeps)} blobs swept")
    with backend_hub.client(auth=user) as c:
        for tag, digest in accepted:
            r = c.get(f"/v2/racer/app/manifests/{digest}")
            assert r.status_code == 200, (tag, r.text)
            doc = json.loads(r.content)
            for desc in [doc["config"], *doc["layers"]]:
                blob = c.get(f"/v2/racer/app/blobs/{desc['digest']}")
                assert blob.status_code == 200 and sha(blob.content) == desc["digest"], tag
