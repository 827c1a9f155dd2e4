"""Hostile review 4: limits one client must not be able to turn against others, and
state that must not be shared by accident.

* upload sessions: lost answers to a session POST (the client retries) must not lock a
  namespace out of uploads for ``upload_idle_timeout``: at a limit, empty sessions idle
  past a short grace that no request writes are reclaimed; one user cannot take all of
  an organisation's places (``upload_sessions_per_user``, across namespaces);
* S3 replicas each on their own database (one SQLite file each) are refused at start:
  the bucket names the database that catalogs its blobs.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hub_support import ADMIN, HubServer, error_code
from s3_hub_support import OWNER_KEY, running_s3_hub, s3_settings
from s3_support import MotoServer

from forkd.errors import InvalidInput
from forkd.hub.settings import HubSettings
from forkd.hub.shared_uploads import EMPTY_SESSION_GRACE
from forkd.hub.workers import prepare


# -- upload sessions: lost POST answers, one member against an organisation -----------
def _session_id(location: str) -> str:
    return location.rsplit("/", 1)[1]


def _age(hub: HubServer, location: str, seconds: float) -> None:
    """Make the session look idle for ``seconds``: its file's mtime (filesystem
    backend) and its row's last activity (shared sessions go by the row)."""
    upload_id = _session_id(location)
    path = hub.data_dir / "uploads" / upload_id
    then = time.time() - seconds
    if path.exists():
        os.utime(path, (then, then))
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(then))
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute(
            "UPDATE uploads SET created_at = ?, touched_at = NULL WHERE id = ?", (stamp, upload_id)
        )


@pytest.fixture(params=["fs", "s3"])
def few_sessions(
    request: pytest.FixtureRequest, tmp_path: Path, moto_server: MotoServer
) -> Iterator[HubServer]:
    limits = {"upload_sessions_max": 3, "upload_sessions_per_user": 10}
    if request.param == "fs":
        server = HubServer(tmp_path / "hub", limits).start()
        try:
            yield server
        finally:
            server.stop()
    else:
        with running_s3_hub(moto_server, tmp_path / "hub", **limits) as s3:
            yield s3


def test_lost_session_answers_do_not_lock_the_namespace_out(few_sessions: HubServer) -> None:
    """A client whose POST answers were lost retried until the namespace had
    ``upload_sessions_max`` sessions. Past the grace, a new POST reclaims an empty one
    no request holds; one with bytes, or one a request is writing, stays."""
    hub = few_sessions
    who = hub.add_user("retrier")
    with hub.client(who) as c:
        lost = [c.post("/v2/retrier/app/blobs/uploads/").headers["location"] for _ in range(3)]
        r = c.post("/v2/retrier/app/blobs/uploads/")
        assert r.status_code == 429 and error_code(r) == "TOOMANYREQUESTS", r.text
        assert "upload_sessions_max" in r.text
        empty, written, held = lost
        assert c.patch(written, content=b"bytes").status_code == 202
        for location in lost:
            _age(hub, location, EMPTY_SESSION_GRACE + 5)
        staging = hub.data_dir / "uploads" / _session_id(held)
        with open(staging, "ab") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a request writing it holds it
            r = c.post("/v2/retrier/app/blobs/uploads/")
            assert r.status_code == 202, r.text
            assert error_code(c.get(empty)) == "BLOB_UPLOAD_UNKNOWN"
            assert c.get(written).headers["range"] == "0-4"
            assert c.get(held).status_code == 204
            # The new session is fresh, the held one is being written: no place left.
            r = c.post("/v2/retrier/app/blobs/uploads/")
            assert r.status_code == 429, r.text
        r = c.post("/v2/retrier/app/blobs/uploads/")  # the writer let go of it
        assert r.status_code == 202, r.text
        assert error_code(c.get(held)) == "BLOB_UPLOAD_UNKNOWN"
        assert c.get(written).headers["range"] == "0-4"
        for location in (written, r.headers["location"]):
            assert c.delete(location).status_code == 204


def test_one_member_cannot_take_all_of_an_organisations_sessions(tmp_path: Path) -> None:
    """``upload_sessions_per_user`` counts a user's sessions in every namespace, below
    the namespace's ``upload_sessions_max``: a member who holds their share leaves the
    others of the organisation room to push."""
    hub = HubServer(tmp_path / "hub", {
        "upload_sessions_max": 4, "upload_sessions_per_user": 2,
    }).start()  # fmt: skip
    try:
        greedy, other = hub.add_user("greedy"), hub.add_user("other")
        hub.cli("org", "add", "shared", "--member", "greedy=push", "--member", "other=push")
        with hub.client(greedy) as g, hub.client(other) as o:
            assert g.post("/v2/shared/app/blobs/uploads/").status_code == 202
            assert g.post("/v2/greedy/own/blobs/uploads/").status_code == 202
            for repo in ("shared/app", "greedy/own"):
                r = g.post(f"/v2/{repo}/blobs/uploads/")
                assert r.status_code == 429 and error_code(r) == "TOOMANYREQUESTS", r.text
                assert "you have 2 open upload sessions" in r.text
                assert "upload_sessions_per_user" in r.text
            for _ in range(2):
                assert o.post("/v2/shared/app/blobs/uploads/").status_code == 202
            with hub.client(ADMIN) as admin:  # the admin is one more user
                assert admin.post("/v2/shared/app/blobs/uploads/").status_code == 202
                r = admin.post("/v2/shared/app/blobs/uploads/")
                assert r.status_code == 429 and "namespace 'shared' has 4" in r.text, r.text
    finally:
        hub.stop()


# -- S3 replicas on databases of their own ----------------------------------------------
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_a_second_database_on_one_bucket_is_refused_at_start(
    request: pytest.FixtureRequest, tmp_path: Path, moto_server: MotoServer, database: str
) -> None:
    """Two S3 hubs on one bucket and prefix, each with its own database (replicas with
    a SQLite file each): GC on one would delete the blobs only the other's catalog
    holds. The first start names its database in the bucket; another database is
    refused before serving (what `forkd hub serve` reports), the first starts again, and
    another prefix in the bucket is another hub's."""
    with running_s3_hub(moto_server, tmp_path / "a") as first:
        bucket = first.bucket
        assert OWNER_KEY in {
            obj["Key"] for obj in moto_server.client().list_objects_v2(Bucket=bucket)["Contents"]
        }
    url = (
        request.getfixturevalue("postgres_url")
        if database == "postgresql"
        else f"sqlite+aiosqlite:///{tmp_path / 'b' / 'hub.db'}"
    )
    settings = s3_settings(moto_server, bucket)
    second = HubSettings(tmp_path / "b", database_url=url, **settings).validated()
    with pytest.raises(InvalidInput, match="cataloged by another database") as refused:
        prepare(second)
    assert "PostgreSQL" in str(refused.value) and "Running several replicas" in str(refused.value)
    prepare(HubSettings(tmp_path / "a", **settings).validated())  # the first one: as before
    elsewhere = {**settings, "s3_prefix": "other-hub"}
    prepare(HubSettings(tmp_path / "b", database_url=url, **elsewhere).validated())


# -- request bodies nested past what a recursive decoder takes ---------------------------
# (method, route as the app declares it, a path of it)
JSON_ROUTES = [
    ("POST", "/api/v1/orgs", "/api/v1/orgs"),
    ("POST", "/api/v1/orgs/{org:str}/teams", "/api/v1/orgs/admin/teams"),
    ("PUT", "/api/v1/orgs/{org:str}/members/{username:str}", "/api/v1/orgs/admin/members/admin"),
    ("POST", "/api/v1/tokens", "/api/v1/tokens"),
    ("POST", "/api/v1/users", "/api/v1/users"),
    ("PUT", "/api/v1/namespaces/{namespace:str}/quota", "/api/v1/namespaces/admin/quota"),
    ("POST", "/api/v1/compact/{name:path}", "/api/v1/compact/admin/app"),
    ("PUT", "/api/v1/readme/{name:path}", "/api/v1/readme/admin/app"),
]
JSON_PATHS = [(method, path) for method, _, path in JSON_ROUTES]


def test_json_routes_lists_every_route_that_takes_a_json_body(tmp_path: Path) -> None:
    from litestar.routes import HTTPRoute

    from forkd.hub.app import create_app

    app = create_app(HubSettings(tmp_path).validated())
    taking = {
        (method, route.path)
        for route in app.routes
        if isinstance(route, HTTPRoute)
        for method, (handler, _) in route.route_handler_map.items()
        if "data" in handler.parsed_fn_signature.parameters
    }
    assert taking == {(method, route) for method, route, _ in JSON_ROUTES}


@pytest.mark.parametrize(("method", "path"), JSON_PATHS)
def test_a_key_twice_in_one_json_body_is_the_clients_error(
    hub: HubServer, method: str, path: str
) -> None:
    """msgspec keeps the last of a repeated key (``{"admin": false, "admin": true}`` is an
    admin to it) where the audit, a proxy or the client may read the first: a 400 saying
    which key, before anything is decoded."""
    with hub.client(ADMIN) as c:
        for body in (b'{"name": "a", "admin": false, "admin": true}',
                     b'{"name": "a", "extra": {"k": 1, "k": 2}}'):
            r = c.request(method, path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == 400, r.text
            assert "appears twice in one object" in r.json()["detail"], r.text


@pytest.mark.parametrize(("method", "path"), JSON_PATHS)
def test_a_deeply_nested_json_body_is_the_clients_error(
    hub: HubServer, method: str, path: str
) -> None:
    """A JSON body of thousands of ``[`` made Litestar's decoder raise RecursionError: a
    500 and a traceback in the log for one small request. It is a 400 saying what was
    wrong, like a deep manifest (forkd/jsondoc.py); a bracket inside a string counts
    nothing, and a flat body is decoded as before."""
    deep = b'{"name": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    with hub.client(ADMIN) as c:
        r = c.request(method, path, content=deep, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nests 20001 levels deep" in r.json()["detail"], r.text
        quoted = b'{"name": "' + b"[" * 20_000 + b'"}'
        r = c.request(method, path, content=quoted, headers={"Content-Type": "application/json"})
        assert r.status_code != 500 and "levels deep" not in r.text, r.text
