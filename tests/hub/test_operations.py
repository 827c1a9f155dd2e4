"""Operations: /healthz, Prometheus /metrics, the append-only JSON audit log."""

from __future__ import annotations

import json

from hub_support import ADMIN, HubServer, artifact, http, sha


def test_healthz(hub: HubServer) -> None:
    r = http.get(f"{hub.url}/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_count_requests_bytes_and_blobs(fresh_hub: HubServer) -> None:
    user = fresh_hub.add_user("metered")
    payload = b"m" * 10_000
    with fresh_hub.client(auth=user) as c:
        artifact(c, "metered/app", payload, tag="v1")
        assert c.get(f"/v2/metered/app/blobs/{sha(payload)}").content == payload
        assert c.get("/v2/metered/app/manifests/none").status_code == 404
    http.get(f"{fresh_hub.url}/token", auth=("metered", "wrong-password"))
    r = http.get(f"{fresh_hub.url}/metrics", auth=ADMIN)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert (
        _metric(text, 'forkd_hub_requests_total{method="PUT",route="manifests",status="201"}') == 1
    )
    assert (
        _metric(text, 'forkd_hub_requests_total{method="GET",route="manifests",status="404"}') == 1
    )
    assert _metric(text, "forkd_hub_blob_bytes_received_total") == len(payload) + 2
    assert _metric(text, "forkd_hub_blob_bytes_sent_total") == len(payload)
    assert _metric(text, "forkd_hub_auth_failures_total") == 1
    assert _metric(text, "forkd_hub_blobs ") == 3  # config, layer, manifest
    assert _metric(text, "forkd_hub_repositories ") == 1
    assert "metered/app" not in text  # no repository names in labels


def test_audit_log_records_writes_and_auth_decisions(fresh_hub: HubServer) -> None:
    user = fresh_hub.add_user("audited")
    with fresh_hub.client(auth=user) as c:
        digest, _ = artifact(c, "audited/app", b"audit me", tag="v1")
        c.delete("/v2/audited/app/manifests/v1")
        bad = b"bytes"
        c.post("/v2/audited/app/blobs/uploads/", params={"digest": sha(b"x")}, content=bad)
    http.get(f"{fresh_hub.url}/token", auth=("audited", "wrong-password"))
    with fresh_hub.client(auth=fresh_hub.add_user("nosy")) as c:
        c.post("/v2/audited/app/blobs/uploads/")
    http.get(f"{fresh_hub.url}/token", params={"scope": "repository:audited/app:pull"})

    lines = (fresh_hub.data_dir / "audit.log").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert all({"time", "actor", "ip", "action", "target", "result"} <= set(e) for e in entries)
    seen = {(e["actor"], e["action"], e["target"], e["result"]) for e in entries}
    assert ("audited", "manifest.push", "audited/app@v1", "ok") in seen
    assert ("audited", "blob.push", f"audited/app@{sha(b'audit me')}", "ok") in seen
    assert ("audited", "manifest.delete", "audited/app@v1", "ok") in seen
    assert ("audited", "blob.push", f"audited/app@{sha(b'x')}", "failed") in seen
    assert ("audited", "login", "-", "denied") in seen
    assert ("nosy", "push", "audited/app", "denied") in seen
    assert ("-", "token", "-", "ok") in seen  # anonymous token, nothing granted
    pushed = next(e for e in entries if e["action"] == "manifest.push")
    assert pushed["digest"] == digest and pushed["ip"] == "127.0.0.1"
