"""Hostile review 3: answers that must not depend on what a client cannot know, and
states that must not be lost.

* a malformed manifest reference (digest or tag) is the client's error (400) on every
  method, as it is on the blob and referrers routes, never 404 MANIFEST_UNKNOWN;
* /metrics counts private repositories: it is for a metrics token and site admins only;
* a PATCH racing the closing PUT of its session is refused, and the PUT stores the blob;
* a second data directory on the database of a filesystem-backend hub is refused at start.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_support import ADMIN, HubServer, artifact, error_code, sha

from forkd.errors import InvalidInput
from forkd.hub.settings import HubSettings

BAD_DIGESTS = ["sha256:xyz", "sha256:" + "a" * 63, "md5:abcd", "sha256:" + "A" * 64, "sha256:"]
BAD_TAGS = ["-tag", "x" * 129, ".dot", "a~b"]


@pytest.mark.parametrize("reference", BAD_DIGESTS + BAD_TAGS)
def test_a_malformed_manifest_reference_is_400_on_every_method(
    hub: HubServer, user: tuple[str, str], reference: str
) -> None:
    name = f"{user[0]}/refs"
    code = "DIGEST_INVALID" if ":" in reference else "MANIFEST_INVALID"
    with hub.client(user) as c:
        artifact(c, name, b"layer", tag="v1")
        for method in ("GET", "HEAD", "DELETE", "PUT"):
            r = c.request(method, f"/v2/{name}/manifests/{reference}", content=b"{}")
            assert r.status_code == 400, (method, reference, r.status_code, r.text)
            if method != "HEAD":
                assert error_code(r) == code, r.text
        if ":" in reference:
            for path in (f"blobs/{reference}", f"referrers/{reference}"):
                r = c.get(f"/v2/{name}/{path}")
                assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID", r.text


def test_a_malformed_reference_tells_nothing_about_a_hidden_repository(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """The access check comes first: someone who may not see the repository gets the
    answer every invisible repository gets, malformed reference or not."""
    owner = hub.add_user(f"{user[0]}-owner")
    with hub.client(owner) as c:
        artifact(c, f"{owner[0]}/secret", b"layer", tag="v1")
    with hub.client(user) as c:
        for ref in ("sha256:xyz", "-tag", "v1"):
            for repo in (f"{owner[0]}/secret", f"{owner[0]}/absent"):
                r = c.get(f"/v2/{repo}/manifests/{ref}")
                assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN", r.text
    r = httpx.get(f"{hub.url}/v2/{owner[0]}/secret/manifests/sha256:xyz")
    assert r.status_code == 401


# -- /metrics ------------------------------------------------------------------------
METRICS_TOKEN = "m" * 12 + "-scrape-token"


def test_metrics_are_for_the_metrics_token_and_site_admins_only(tmp_path: Path) -> None:
    """The counts cover private repositories (how many, their blobs and bytes, every
    request's route and status), so an outsider watching them learns when someone creates
    or pushes to one: anonymous callers get 401, users who are not site admins 403, and
    neither a registry bearer token nor a narrower API token of an admin reads them."""
    hub = HubServer(tmp_path / "hub", {"metrics_token": METRICS_TOKEN}).start()
    try:
        owner = hub.add_user("olga")
        with hub.client(owner) as c:
            artifact(c, "olga/private", b"layer", tag="v1")
            narrow = c.post("/api/v1/tokens", json={"name": "t", "scopes": ["olga:admin"]})
        url = f"{hub.url}/metrics"
        r = httpx.get(url)
        assert r.status_code == 401 and "metrics_token" in r.text
        assert r.headers["www-authenticate"].startswith("Bearer ")
        assert "forkd_hub_repositories" not in r.text
        for header in (f"Bearer {METRICS_TOKEN}x", "Bearer", f"Basic {METRICS_TOKEN}"):
            r = httpx.get(url, headers={"Authorization": header})
            assert r.status_code == 401, (header, r.status_code)
        not_ascii = "Bearer \u00e9t\u00e9".encode("latin-1")
        r = httpx.get(url, headers={"Authorization": not_ascii})
        assert r.status_code == 401
        assert httpx.get(url, auth=owner).status_code == 403
        bearer = httpx.get(
            f"{hub.url}/token", params={"scope": "repository:olga/private:pull"}, auth=ADMIN
        ).json()["token"]
        r = httpx.get(url, headers={"Authorization": f"Bearer {bearer}"})
        assert r.status_code == 403
        admin_narrow = _admin_token(hub, ["olga:pull"])
        assert httpx.get(url, auth=("admin", admin_narrow)).status_code == 403
        assert narrow.status_code == 201
        for auth in (
            {"headers": {"Authorization": f"Bearer {METRICS_TOKEN}"}},
            {"auth": ADMIN},
            {"auth": ("admin", _admin_token(hub, ["*:admin"]))},
        ):
            r = httpx.get(url, **auth)  # type: ignore[arg-type]
            assert r.status_code == 200, (auth, r.text[:200])
            assert "forkd_hub_repositories 1.0" in r.text
    finally:
        hub.stop()


def _admin_token(hub: HubServer, scopes: list[str]) -> str:
    with hub.client(ADMIN) as c:
        r = c.post("/api/v1/tokens", json={"name": "m", "scopes": scopes})
    assert r.status_code == 201, r.text
    return str(r.json()["token"])


def test_a_short_metrics_token_is_refused_at_start(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="at least 16"):
        HubSettings(tmp_path, metrics_token="short").validated()


# -- a PATCH racing the closing PUT ----------------------------------------------------
def _slow_body() -> Iterator[bytes]:
    yield b"x"
    time.sleep(0.3)
    yield b"y"


def _hammer(
    hub: HubServer, who: tuple[str, str], location: str, stop: threading.Event
) -> list[tuple[int, str]]:
    """PATCH ``location`` with slow bodies until ``stop``; the answers."""
    answers = []
    with hub.client(who) as c:
        while not stop.is_set():
            r = c.patch(location, content=_slow_body())
            answers.append((r.status_code, r.text))
    return answers


def test_a_patch_racing_the_closing_put_never_loses_the_session(
    fresh_hub: HubServer,
) -> None:
    """PATCHes hammer a session while its closing PUT runs (with a quota set, so the PUT
    reads the database between its last byte and the store: the window there was). The
    PUT must store the blob (201) and every PATCH is refused (416 BLOB_UPLOAD_INVALID
    while the PUT holds the session, BLOB_UPLOAD_UNKNOWN after); before, a PATCH that
    slipped into the window made the PUT fail and drop the session under the PATCH."""
    from concurrent.futures import ThreadPoolExecutor

    user = fresh_hub.add_user("racer")
    with fresh_hub.client(ADMIN) as admin:
        r = admin.put("/api/v1/namespaces/racer/quota", json={"quota_bytes": 1 << 30})
        assert r.status_code == 200, r.text
    blob = b"r" * 200_000
    digest = sha(blob)
    with fresh_hub.client(user) as c, ThreadPoolExecutor(3) as pool:
        for _round in range(6):
            location = c.post("/v2/racer/app/blobs/uploads/").headers["location"]
            r = c.patch(location, content=blob[:100_000], headers={"Content-Range": "0-99999"})
            assert r.status_code == 202, r.text
            stop = threading.Event()
            hammers = [pool.submit(_hammer, fresh_hub, user, location, stop) for _ in range(3)]
            try:
                put = c.put(location, params={"digest": digest}, content=blob[100_000:])
            finally:
                time.sleep(0.2)
                stop.set()
            answers = [a for h in hammers for a in h.result()]
            assert put.status_code == 201, (put.status_code, put.text, answers[-3:])
            assert c.get(f"/v2/racer/app/blobs/{digest}").content == blob
            for status, text in answers:
                assert status in (404, 416), (status, text)
                assert ("BLOB_UPLOAD_UNKNOWN" if status == 404 else "BLOB_UPLOAD_INVALID") in text
            c.delete(f"/v2/racer/app/blobs/{digest}")


# -- replicas that cannot share the blobs ------------------------------------------------
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_second_data_directory_on_a_filesystem_hub_database_is_refused_at_start(
    request: pytest.FixtureRequest, tmp_path: Path, database: str
) -> None:
    """Two `forkd hub serve` processes on one database, each with its own data directory
    and the filesystem blob backend (replicas set up without S3, or a SQLite file shared
    between directories): the second would answer for blobs it does not have and GC
    would sweep the first one's. It is refused at start, saying what to do; the first
    directory starts again as before."""
    from click.testing import CliRunner

    from forkd.cli.main import cli

    url = (
        request.getfixturevalue("postgres_url")
        if database == "postgresql"
        else f"sqlite+aiosqlite:///{tmp_path / 'a' / 'hub.db'}"
    )
    first = HubServer(tmp_path / "a", {"database_url": url}).start()
    first.stop()
    argv = ["hub", "serve", "--data", str(tmp_path / "b"), "--database-url", url]
    with socket.create_server(("127.0.0.1", 0)) as taken:  # were it to serve: it cannot
        port = taken.getsockname()[1]
        result = CliRunner().invoke(cli, [*argv, "--listen", f"127.0.0.1:{port}"])
    assert result.exit_code != 0, result.output
    assert "another data directory" in result.output, result.output
    assert "Running several replicas" in result.output and "Traceback" not in result.output
    again = HubServer(tmp_path / "a", {"database_url": url}).start()
    again.stop()
