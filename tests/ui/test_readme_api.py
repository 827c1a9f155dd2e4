"""README and description through the hub API and forkd.registry.readme (no browser)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest
from ui_support import ADMIN, ALICE, BOB, Seeded

from forkd.errors import InvalidInput
from forkd.registry.client import AuthError, RegistryNotFound
from forkd.registry.readme import read_readme, set_readme


def test_readme_api(seeded: Seeded, tmp_path: Path) -> None:
    hub = seeded.hub
    api = f"{hub.url}/api/v1/readme/alice/secret-lab"
    r = httpx.put(api, json={"readme": "x"})
    assert r.status_code == 401 and "Bearer" in r.headers["www-authenticate"]
    assert httpx.get(api).status_code == 401  # private: needs a login
    assert httpx.put(api, json={"readme": "x"}, auth=BOB).status_code == 404  # invisible to bob

    path = tmp_path / "README.md"
    path.write_text("# Secret lab\n\nInternal only.\n")
    with hub.forkd_client(ALICE) as client:
        got = set_readme(client, "alice/secret-lab", read_readme(path), "Internal lab")
    assert got["description"] == "Internal lab" and got["readme"].startswith("# Secret lab")
    r = httpx.get(api, auth=ALICE)
    assert r.status_code == 200 and r.json()["description"] == "Internal lab"
    # Only the given fields change.
    r = httpx.put(api, json={"description": "Lab"}, auth=ALICE)
    assert r.status_code == 200 and r.json()["readme"].startswith("# Secret lab")

    assert httpx.put(api, json={"description": "two\nlines"}, auth=ALICE).status_code == 400
    assert httpx.put(api, json={"readme": "x" * (300 * 1024)}, auth=ALICE).status_code in (400, 413)
    assert httpx.get(f"{hub.url}/api/v1/readme/Bad..Name").status_code == 400

    with hub.forkd_client(BOB) as client, pytest.raises((AuthError, RegistryNotFound)):
        set_readme(client, "alice/secret-lab", "hijacked")
    with pytest.raises(InvalidInput):
        read_readme(tmp_path / "missing.md")


def test_readme_api_is_in_the_openapi_schema(seeded: Seeded) -> None:
    paths = httpx.get(f"{seeded.hub.url}/api/schema/openapi.json").json()["paths"]
    assert any(p.startswith("/api/v1/readme/") for p in paths)
    assert not any(p.startswith("/-/") for p in paths)  # pages are not API


def test_pages_of_a_plain_oci_artifact(seeded: Seeded) -> None:
    """Not every repository holds packs (oras, skopeo): its pages still render."""
    hub = seeded.hub
    with httpx.Client(base_url=hub.url, auth=ADMIN, timeout=60) as c:
        blobs = {b"{}": "application/vnd.oci.empty.v1+json", b"hello": "text/plain"}
        digests = {}
        for data in blobs:
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            r = c.post("/v2/misc/notes/blobs/uploads/", params={"digest": digest}, content=data)
            assert r.status_code == 201, r.text
            digests[data] = digest
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "artifactType": "text/plain",
            "config": {"mediaType": blobs[b"{}"], "digest": digests[b"{}"], "size": 2},
            "layers": [{"mediaType": "text/plain", "digest": digests[b"hello"], "size": 5}],
        }
        r = c.put(
            "/v2/misc/notes/manifests/v1",
            content=json.dumps(manifest).encode(),
            headers={"Content-Type": "application/vnd.oci.image.manifest.v1+json"},
        )
        assert r.status_code == 201, r.text
    hub.cli("repo", "visibility", "misc/notes", "public")
    for path in ("/misc/notes", "/misc/notes/-/tags/v1", "/misc"):
        r = httpx.get(hub.url + path)
        assert r.status_code == 200, (path, r.text[:500])
    assert "No compatibility metadata" in httpx.get(hub.url + "/misc/notes").text
    assert "Not a forkd snapshot layer" in httpx.get(hub.url + "/misc/notes/-/tags/v1").text
