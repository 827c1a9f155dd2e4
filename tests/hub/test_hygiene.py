"""Response hygiene and the blob read fast path (issue 10 items 13e, 13f, 13g, 14):
``nosniff`` on blobs and manifests, README images that load nothing from elsewhere,
404 for the README of a missing repository, blob HEAD/GET without aiosqlite."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from hub_support import ADMIN, HubServer, artifact, push_blob, sha
from litestar.testing import TestClient

from forkd.hub.app import create_app
from forkd.hub.settings import HubSettings
from forkd.hub.ui.render import CSP, render_markdown


def test_blob_and_manifest_answers_are_never_sniffed(hub: HubServer, user: tuple[str, str]) -> None:
    repo = f"{user[0]}/sniff"
    html = b"<html><script>alert(1)</script></html>"
    with hub.client(user) as c:
        digest = push_blob(c, repo, html)
        manifest, _ = artifact(c, repo, b"layer", tag="v1")
        for method in ("GET", "HEAD"):
            for path in (f"/v2/{repo}/blobs/{digest}", f"/v2/{repo}/manifests/{manifest}"):
                r = c.request(method, path)
                assert r.status_code == 200, r.text
                assert r.headers["x-content-type-options"] == "nosniff", (method, path)
        r = c.get(f"/v2/{repo}/blobs/{digest}", headers={"Range": "bytes=0-5"})
        assert r.status_code == 206 and r.headers["x-content-type-options"] == "nosniff"


def test_readme_of_a_missing_repository_is_404(hub: HubServer, user: tuple[str, str]) -> None:
    for who in (ADMIN, user):
        r = httpx.get(f"{hub.url}/api/v1/readme/{user[0]}/missing", auth=who)
        assert r.status_code == 404, r.text
        assert r.json() == {
            "status_code": 404,
            "detail": f"repository {user[0]}/missing not found",
        }


@pytest.mark.parametrize(
    "source",
    [
        "![pixel](https://tracker.example/p.gif?who=me)",
        "![pixel](http://tracker.example/p.gif)",
        "![pixel](//tracker.example/p.gif)",
        "![logout](/-/logout)",
        "![rel](logo.png)",
        "![svg](data:image/svg+xml;base64,PHN2ZyBvbmxvYWQ9YWxlcnQoMSk+)",
        '![ref][1]\n\n[1]: https://tracker.example/p.gif "t"',
    ],
)
def test_readme_images_load_nothing(source: str) -> None:
    html = render_markdown(source)
    assert "<img" not in html, html


def test_readme_images_become_links_and_data_images_stay() -> None:
    html = render_markdown("![the logo](https://example.com/logo.png)")
    assert html == (
        '<p><a href="https://example.com/logo.png" rel="nofollow noopener noreferrer">'
        "the logo</a></p>\n"
    )
    png = "data:image/png;base64,iVBORw0KGgo="
    assert f'<img src="{png}" alt="dot">' in render_markdown(f"![dot]({png})")


def test_ui_pages_allow_images_from_the_hub_only(hub: HubServer) -> None:
    assert "img-src 'self' data:;" in CSP and "https:" not in CSP
    r = httpx.get(f"{hub.url}/")
    assert r.headers["content-security-policy"] == CSP, r.status_code


def test_blob_reads_need_no_aiosqlite_session(tmp_path: Path) -> None:
    """Blob HEAD/GET read access and the blob in one inline read, as a manifest GET does:
    with the aiosqlite read sessions made unusable they still answer."""
    settings = HubSettings(tmp_path / "hub", admin_user=ADMIN[0], admin_password=ADMIN[1])
    app = create_app(settings)
    with TestClient(app) as client:
        client.auth = httpx.BasicAuth(*ADMIN)
        data = b"fast path"
        r = client.post("/v2/admin/fast/blobs/uploads/", params={"digest": sha(data)}, content=data)
        assert r.status_code == 201, r.text
        hub = app.state.hub

        def no_aiosqlite(*_: Any, **__: Any) -> Any:
            raise AssertionError("a blob read went through an aiosqlite session")

        hub.db.read_sessions = no_aiosqlite
        head = client.head(f"/v2/admin/fast/blobs/{sha(data)}")
        assert head.status_code == 200 and head.headers["content-length"] == str(len(data))
        assert client.get(f"/v2/admin/fast/blobs/{sha(data)}").content == data
        missing = client.head(f"/v2/admin/fast/blobs/{sha(b'other')}")
        assert missing.status_code == 404
