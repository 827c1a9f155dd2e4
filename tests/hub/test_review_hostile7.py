"""Hostile review 7: an upload session is its opener's, an index cannot be its own child's
referrer, no response names a host the operator did not choose, cookies stay Secure
behind a TLS proxy, and a referrers list is bounded.

* a session's id opens nothing for anyone but the account that started it: another
  pusher of the repository, a site admin or another user's token gets
  ``BLOB_UPLOAD_UNKNOWN`` (404) on ``GET``/``PATCH``/``PUT``/``DELETE``, and the session
  stays whole for its opener (any of the opener's credentials);
* an index whose ``subject`` is one of its own ``manifests`` is refused at push (the
  child's deletion check does not count indexes naming it as their subject, so the
  child could be deleted under the index);
* a Host header that is not a host name (user info, a quote) is 400, and with
  ``allowed_hosts`` set a Host not listed is 400 too: the token realm and the UI's pull
  commands follow the Host when ``public_url`` is not set;
* with an https ``public_url`` (a TLS-terminating proxy in front) the UI's cookies are
  Secure;
* the referrers list comes in pages (descriptors and annotation bytes bounded).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_support import ADMIN, OCI_MANIFEST, HubServer, artifact, error_code, sha

from forkd.errors import InvalidInput
from forkd.hub.settings import HubSettings

OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def _name(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10**9}"


# -- 1. upload sessions belong to their opener -------------------------------------------
def _shared_org(hub: HubServer) -> tuple[str, tuple[str, str], tuple[str, str]]:
    """An organisation where alice (admin) and bob (push) may both push."""
    alice, bob, org = hub.add_user(_name("alice")), hub.add_user(_name("bob")), _name("team")
    with hub.client(alice) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        r = c.put(f"/api/v1/orgs/{org}/members/{bob[0]}", json={"role": "push"})
        assert r.status_code == 204, r.text
    return org, alice, bob


def _bearer(hub: HubServer, who: tuple[str, str], scope: str) -> httpx.Client:
    with hub.client(who) as c:
        r = c.get("/token", params={"service": "forkd-hub", "scope": scope})
        assert r.status_code == 200, r.text
        token = r.json()["token"]
    return httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_an_upload_session_is_its_openers_only(hub: HubServer) -> None:
    """Bob may push to the organisation's repository, and so may the site admin; neither
    could write, finish, read or cancel the session alice opened there, given its id
    (a log line, a proxy, a shared terminal): bob's PUT published his bytes as the blob
    alice's client went on to reference. Now the session answers only to alice."""
    org, alice, bob = _shared_org(hub)
    repo = f"{org}/app"
    with hub.client(alice) as c:
        r = c.post(f"/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, r.text
        where = r.headers["Location"]
        assert c.patch(where, content=b"alice's ").status_code == 202
    hostile = b"bob's bytes"
    bob_token = hub.token(bob[0], f"{org}:push")
    outsiders = [
        hub.client(bob),
        hub.client((bob[0], bob_token)),
        hub.client(ADMIN),
        _bearer(hub, bob, f"repository:{repo}:pull,push"),
    ]
    for c in outsiders:
        with c:
            for r in [
                c.get(where),
                c.patch(where, content=hostile, headers={"Content-Range": "8-18"}),
                c.put(where, params={"digest": sha(b"alice's " + hostile)}, content=hostile),
                c.delete(where),
            ]:
                assert r.status_code == 404, (r.request.method, r.text)
                assert error_code(r) == "BLOB_UPLOAD_UNKNOWN"
                assert "among the sessions you started" in r.text
    # Whole for alice, through another of her credentials (an API token) too.
    token = hub.token(alice[0], f"{org}:push")
    with hub.client((alice[0], token)) as c:
        r = c.get(where)
        assert r.status_code == 204 and r.headers["Range"] == "0-7", r.text
        data = b"alice's layer"
        r = c.put(where, params={"digest": sha(data)}, content=b"layer")
        assert r.status_code == 201, r.text
        assert c.get(f"/v2/{repo}/blobs/{sha(data)}").content == data


def test_an_upload_session_is_not_cancelled_by_another_user(hub: HubServer) -> None:
    """DELETE by another pusher dropped the session (its bytes and row): alice's next
    PATCH found it gone. It is still there after bob's attempt, and alice cancels it."""
    org, alice, bob = _shared_org(hub)
    with hub.client(alice) as c:
        where = c.post(f"/v2/{org}/app/blobs/uploads/").headers["Location"]
    with hub.client(bob) as c:
        assert c.delete(where).status_code == 404
    with hub.client(alice) as c:
        assert c.patch(where, content=b"abc").status_code == 202
        assert c.delete(where).status_code == 204
        assert error_code(c.get(where)) == "BLOB_UPLOAD_UNKNOWN"


# -- 2. an index is not its child's referrer ---------------------------------------------
def test_an_index_naming_its_child_as_subject_is_refused(hub: HubServer) -> None:
    """An index listing manifest M and naming M as its subject slipped the deletion
    check of M (indexes that only refer to M as their subject do not hold it), so M
    could be deleted while the index still listed it. Such an index is refused at push;
    the same index without the subject holds M."""
    who = hub.add_user(_name("idx"))
    repo = f"{who[0]}/multi"
    with hub.client(who) as c:
        child, body = artifact(c, repo, b"child layer")
        described = {"mediaType": OCI_MANIFEST, "digest": child, "size": len(body)}
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [described],
            "subject": described,
        }
        r = c.put(
            f"/v2/{repo}/manifests/both",
            content=json.dumps(doc).encode(),
            headers={"Content-Type": OCI_INDEX},
        )
        assert r.status_code == 400, r.text
        assert error_code(r) == "MANIFEST_INVALID"
        assert "also one of this index's manifests" in r.text
        # Without the subject the index holds its child.
        child2, body2 = artifact(c, repo, b"second child layer")
        doc = {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [{"mediaType": OCI_MANIFEST, "digest": child2, "size": len(body2)}],
            "subject": described,
        }
        r = c.put(
            f"/v2/{repo}/manifests/ok",
            content=json.dumps(doc).encode(),
            headers={"Content-Type": OCI_INDEX},
        )
        assert r.status_code == 201, r.text
        r = c.delete(f"/v2/{repo}/manifests/{child2}")
        assert r.status_code == 400 and error_code(r) == "UNSUPPORTED", r.text


# -- 3. Host ------------------------------------------------------------------------------
@pytest.fixture
def pinned_hub(tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(tmp_path / "hub", {"allowed_hosts": "hub.example, 127.0.0.2:1"}).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize(
    "host",
    [
        "user@evil.example",  # the realm became http://user@evil.example/token
        "evil.example:65536",  # a 500: Litestar's URL of the request raised
        "evil.example:99999999",
    ],
)
def test_a_host_that_is_not_a_host_name_is_refused(hub: HubServer, host: str) -> None:
    """A Host with user info went into the token realm (``http://user@evil.example/
    token``): the URL a client sends its password to. Only a host name, an IP address or
    an [IPv6] literal with an optional port is taken; anything else is 400, with no
    challenge. A port past 65535 was a 500 (Litestar's URL of the request raised)."""
    r = httpx.get(f"{hub.url}/v2/", headers={"Host": host}, timeout=30)
    assert r.status_code == 400, r.text
    assert "WWW-Authenticate" not in r.headers
    assert "is not a host name" in r.text


def test_a_well_formed_host_still_gives_the_realm(hub: HubServer) -> None:
    for host, base in [
        ("hub.example:5000", "http://hub.example:5000"),
        ("compose_hub", "http://compose_hub"),
        ("[::1]:5000", "http://[::1]:5000"),
    ]:
        r = httpx.get(f"{hub.url}/v2/", headers={"Host": host}, timeout=30)
        assert r.status_code == 401, r.text
        assert f'realm="{base}/token"' in r.headers["WWW-Authenticate"]


def test_allowed_hosts_pin_the_host(pinned_hub: HubServer) -> None:
    """With ``allowed_hosts`` set, a Host not listed is 400 on every route (registry,
    token, API and UI), so neither a realm nor a page names it; a listed name without a
    port takes any port, one with a port only that one; ``/healthz`` answers whatever
    the Host (load balancers probe it by address)."""
    url = pinned_hub.url
    for host in ["evil.example", f"127.0.0.1:{pinned_hub.port}", "127.0.0.2:2", "hub.example.evil"]:
        for path in ["/v2/", "/token", "/api/v1/repositories", "/"]:
            r = httpx.get(url + path, headers={"Host": host}, timeout=30)
            assert r.status_code == 400, (host, path, r.text)
            assert "WWW-Authenticate" not in r.headers
            assert host not in r.headers.get("location", "")
        assert "allowed_hosts" in r.text
    for host in ["hub.example", "HUB.example:5000", "127.0.0.2:1"]:
        r = httpx.get(url + "/v2/", headers={"Host": host}, timeout=30)
        assert r.status_code == 401, (host, r.text)
        assert f'realm="http://{host}/token"' in r.headers["WWW-Authenticate"]
    r = httpx.get(url + "/healthz", headers={"Host": "evil.example"}, timeout=30)
    assert r.status_code == 200


def test_allowed_hosts_must_be_host_names(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match=re.escape("invalid allowed host 'http://hub.example'")):
        HubSettings(tmp_path, allowed_hosts="hub.example,http://hub.example").validated()
    settings = HubSettings(tmp_path, allowed_hosts=" B.example , a.example:5000").validated()
    assert settings.allowed_hosts == "a.example:5000,b.example"


# -- 4. the session cookie behind a TLS proxy ---------------------------------------------
@pytest.fixture
def proxied_hub(tmp_path: Path) -> Iterator[HubServer]:
    """A hub whose clients reach it as https (a TLS-terminating proxy forwards HTTP)."""
    server = HubServer(tmp_path / "hub", {"public_url": "https://hub.example"}).start()
    try:
        yield server
    finally:
        server.stop()


def test_cookies_are_secure_when_the_public_url_is_https(proxied_hub: HubServer) -> None:
    """Behind a TLS-terminating proxy the hub sees plain HTTP, so the session cookie went
    out without ``Secure``: a browser then sent it on any plain-HTTP visit to the host
    (a link, a redirect, a network attacker's injected request). With an https
    ``public_url`` every cookie the UI sets is Secure (and still HttpOnly, SameSite)."""
    with proxied_hub.client() as c:
        page = c.get("/-/signin")
        assert page.status_code == 200, page.text
        found = re.search(r'name="login_csrf" value="([^"]*)"', page.text)
        assert found
        # Named __Host-… over HTTPS since hostile review 24 (test_review_hostile24.py).
        nonce = re.search(r"__Host-forkd_login=([^;]+)", page.headers["set-cookie"])
        assert nonce
        assert "secure" in page.headers["set-cookie"].lower()
        r = c.post(
            "/-/signin",
            data={"login_csrf": found.group(1), "username": ADMIN[0], "password": ADMIN[1]},
            headers={"Cookie": f"__Host-forkd_login={nonce.group(1)}"},
        )
        assert r.status_code == 303, r.text
        session = [
            v for v in r.headers.get_list("set-cookie") if v.startswith("__Host-forkd_session=")
        ]
        assert len(session) == 1
        flags = {f.strip().lower() for f in session[0].split(";")[1:]}
        assert {"secure", "httponly", "samesite=lax"} <= flags


# -- 5. the referrers list comes in pages --------------------------------------------------
def _referrer(c: httpx.Client, repo: str, subject: dict[str, object], note: str) -> str:
    digest, _ = artifact(
        c,
        repo,
        note.encode()[:64],
        artifact_type="application/vnd.example.sbom",
        subject=subject,
    )
    return digest


def _annotated_referrer(c: httpx.Client, repo: str, subject: dict[str, object], note: str) -> str:
    """A referrer of ``subject`` whose annotations hold ``note``."""
    doc = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": "application/vnd.example.sig",
        "config": {
            "mediaType": "application/vnd.oci.empty.v1+json",
            "digest": sha(b"{}"),
            "size": 2,
        },
        "layers": [],
        "subject": subject,
        "annotations": {"note": note},
    }
    body = json.dumps(doc).encode()
    r = c.put(
        f"/v2/{repo}/manifests/{sha(body)}", content=body, headers={"Content-Type": OCI_MANIFEST}
    )
    assert r.status_code == 201, r.text
    return sha(body)


def _all_referrers(c: httpx.Client, first: str) -> list[list[str]]:
    pages, url = [], first
    while url:
        r = c.get(url)
        assert r.status_code == 200, r.text
        pages.append([d["digest"] for d in r.json()["manifests"]])
        link = re.match(r'<([^>]+)>; rel="next"', r.headers.get("Link", ""))
        url = link.group(1) if link else ""
        assert len(pages) < 50
    return pages


def test_referrers_with_large_annotations_come_in_pages(hub: HubServer) -> None:
    """Every referrer of a subject, annotations included, went into one response: a
    pusher made each referrer's annotations nearly a manifest's size (4 MiB) and a pull
    of the referrers built them all at once (thousands of them: gigabytes). A page holds
    at most 4 MiB of annotations; ``Link`` leads to the rest, each referrer once."""
    who = hub.add_user(_name("refs"))
    repo = f"{who[0]}/signed"
    with hub.client(who) as c:
        subject_digest, body = artifact(c, repo, b"signed image")
        subject = {"mediaType": OCI_MANIFEST, "digest": subject_digest, "size": len(body)}
        big = [_annotated_referrer(c, repo, subject, f"{i}" * (3 << 20)) for i in range(2)]
        pages = _all_referrers(c, f"/v2/{repo}/referrers/{subject_digest}")
    assert len(pages) == 2, [len(p) for p in pages]
    assert sorted(d for p in pages for d in p) == sorted(big)


def test_referrer_pages_keep_the_filter_and_list_each_once(
    hub: HubServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from forkd.hub.oci import referrers

    monkeypatch.setattr(referrers, "PAGE", 3)
    who = hub.add_user(_name("refp"))
    repo = f"{who[0]}/signed"
    with hub.client(who) as c:
        subject_digest, body = artifact(c, repo, b"subject image")
        subject = {"mediaType": OCI_MANIFEST, "digest": subject_digest, "size": len(body)}
        sigs = [_annotated_referrer(c, repo, subject, f"sig {i}") for i in range(7)]
        other = _referrer(c, repo, subject, "other")  # a different artifact type
        pages = _all_referrers(
            c,
            f"/v2/{repo}/referrers/{subject_digest}?artifactType=application/vnd.example.sig",
        )
        assert [len(p) for p in pages] == [3, 3, 1]
        assert sorted(d for p in pages for d in p) == sorted(sigs)
        everything = _all_referrers(c, f"/v2/{repo}/referrers/{subject_digest}")
        assert sorted(d for p in everything for d in p) == sorted([*sigs, other])
        r = c.get(f"/v2/{repo}/referrers/{subject_digest}", params={"last": "nope"})
        assert r.status_code == 400 and error_code(r) == "DIGEST_INVALID"


# -- 6. a bearer token names a bounded number of repositories -----------------------------
def test_a_token_names_at_most_64_repositories(hub: HubServer) -> None:
    """``/token`` granted every scope asked for: a site admin's token for 1,000
    repositories was 180 kB (past any proxy's header limit, so useless) after 1,000
    authorisation reads and one audit entry naming them all. 64 repositories, in one
    ``scope`` or many, are the most; more is 400 saying what to do."""
    with hub.client(ADMIN) as c:
        names = [f"repository:admin/r{i}:pull,push" for i in range(65)]
        for params in [[("scope", s) for s in names], [("scope", " ".join(names))]]:
            r = c.get("/token", params=params)
            assert r.status_code == 400, r.text
            assert "at most 64 repositories" in r.text
        r = c.get("/token", params=[("scope", s) for s in names[:64]])
        assert r.status_code == 200, r.text
        # A repeat counts once.
        r = c.get("/token", params=[("scope", names[0])] * 100)
        assert r.status_code == 200, r.text
