"""Every OCI route's anonymous challenge names the scope the route needs, and a client
that follows it (a token for exactly that scope, for a user who holds it) then succeeds
(issue 10 item 16). One table walks every route of hub/oci/router.py."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from hub_support import OCI_MANIFEST, HubServer, artifact, push_blob, sha

_PARAM_RE = re.compile(r'(\w+)="([^"]*)"')


@dataclass
class Fixture:
    """What the rows act on: a repository with an artifact, a source for mounts."""

    hub: HubServer
    who: tuple[str, str]
    repo: str
    source: str
    manifest: str
    manifest_body: bytes

    def basic(self) -> httpx.Client:
        return self.hub.client(self.who)

    def session(self) -> str:
        with self.basic() as c:
            r = c.post(f"/v2/{self.repo}/blobs/uploads/")
            assert r.status_code == 202, r.text
            return str(r.headers["Location"])

    def blob(self, data: bytes) -> str:
        with self.basic() as c:
            return push_blob(c, self.repo, data)

    def manifest_by_digest(self) -> str:
        with self.basic() as c:
            digest, _ = artifact(c, self.repo, os.urandom(16))
            return digest


# (route, method, target builder → (path, request kwargs), scope template, success status)
Row = tuple[str, str, Callable[[Fixture], tuple[str, dict[str, Any]]], str, int]
PULL, PUSH, DELETE = (
    "repository:{repo}:pull",
    "repository:{repo}:pull,push",
    ("repository:{repo}:pull,delete"),
)
ROWS: list[Row] = [
    ("manifest GET", "GET", lambda f: (f"/v2/{f.repo}/manifests/v1", {}), PULL, 200),
    ("manifest HEAD", "HEAD", lambda f: (f"/v2/{f.repo}/manifests/{f.manifest}", {}), PULL, 200),
    (
        "manifest PUT",
        "PUT",
        lambda f: (
            f"/v2/{f.repo}/manifests/v2",
            {"content": f.manifest_body, "headers": {"Content-Type": OCI_MANIFEST}},
        ),
        PUSH,
        201,
    ),
    (
        "manifest DELETE",
        "DELETE",
        lambda f: (f"/v2/{f.repo}/manifests/{f.manifest_by_digest()}", {}),
        DELETE,
        202,
    ),
    ("blob GET", "GET", lambda f: (f"/v2/{f.repo}/blobs/{sha(b'{}')}", {}), PULL, 200),
    ("blob HEAD", "HEAD", lambda f: (f"/v2/{f.repo}/blobs/{sha(b'{}')}", {}), PULL, 200),
    (
        "blob DELETE",
        "DELETE",
        lambda f: (f"/v2/{f.repo}/blobs/{f.blob(os.urandom(16))}", {}),
        DELETE,
        202,
    ),
    ("upload POST", "POST", lambda f: (f"/v2/{f.repo}/blobs/uploads/", {}), PUSH, 202),
    (
        "monolithic upload POST",
        "POST",
        lambda f: (
            f"/v2/{f.repo}/blobs/uploads/",
            {"params": {"digest": sha(b"mono")}, "content": b"mono"},
        ),
        PUSH,
        201,
    ),
    (
        "mount POST",
        "POST",
        lambda f: (
            f"/v2/{f.repo}/blobs/uploads/",
            {"params": {"mount": sha(b"in the source"), "from": f.source}},
        ),
        PUSH + " repository:{source}:pull",
        201,
    ),
    ("upload GET", "GET", lambda f: (f.session(), {}), PUSH, 204),
    ("upload PATCH", "PATCH", lambda f: (f.session(), {"content": b"chunk"}), PUSH, 202),
    (
        "upload PUT",
        "PUT",
        lambda f: (f.session(), {"params": {"digest": sha(b"whole")}, "content": b"whole"}),
        PUSH,
        201,
    ),
    ("upload DELETE", "DELETE", lambda f: (f.session(), {}), PUSH, 204),
    ("tags list", "GET", lambda f: (f"/v2/{f.repo}/tags/list", {}), PULL, 200),
    ("referrers", "GET", lambda f: (f"/v2/{f.repo}/referrers/{f.manifest}", {}), PULL, 200),
]


@pytest.fixture(scope="module")
def fixture(hub: HubServer) -> Fixture:
    who = hub.add_user("scopes")
    repo, source = "scopes/app", "scopes/src"
    with hub.client(who) as c:
        digest, body = artifact(c, repo, b"layer", tag="v1")
        push_blob(c, source, b"in the source")
    return Fixture(hub, who, repo, source, digest, body)


def _challenge(response: httpx.Response) -> dict[str, str]:
    header = response.headers.get("www-authenticate", "")
    assert header.startswith("Bearer "), (response.status_code, header)
    return dict(_PARAM_RE.findall(header))


@pytest.mark.parametrize("row", ROWS, ids=[row[0] for row in ROWS])
def test_the_challenge_names_the_scope_the_route_needs(fixture: Fixture, row: Row) -> None:
    _, method, target, scope_template, success = row
    path, kwargs = target(fixture)
    scope = scope_template.format(repo=fixture.repo, source=fixture.source)
    anonymous = httpx.request(method, fixture.hub.url + path, timeout=60, **kwargs)
    assert anonymous.status_code == 401, anonymous.text
    params = _challenge(anonymous)
    assert params["scope"] == scope

    # Follow it: a token for exactly that scope, then the same request succeeds.
    token = httpx.get(
        params["realm"],
        params={"service": params["service"], "scope": params["scope"]},
        auth=fixture.who,
        timeout=60,
    )
    assert token.status_code == 200, token.text
    bearer = {"Authorization": f"Bearer {token.json()['token']}"}
    headers = {**kwargs.pop("headers", {}), **bearer}
    followed = httpx.request(method, fixture.hub.url + path, headers=headers, timeout=60, **kwargs)
    assert followed.status_code == success, followed.text


def test_every_route_is_in_the_table() -> None:
    from forkd.hub.oci.router import ROUTES

    methods = sum(len(handlers) for _, handlers in ROUTES)
    # The upload POST has three rows (session, monolithic, mount); the rest one each.
    assert len(ROWS) == methods + 2
