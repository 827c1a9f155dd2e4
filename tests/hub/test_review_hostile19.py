"""Hostile review 19: what a cache in front of the hub may keep, what one credential does
to its account's others, and what text others read.

- Answers for one caller were cacheable by anyone's cache. A private repository's
  manifests, blobs, tag list and referrers, ``_catalog``, and every ``/api/v1`` answer
  (the caller's listings, a private README, an organisation's members, the caller's
  tokens' names and scopes) carried no ``Cache-Control``: a caching proxy in front of the
  hub (nginx with ``proxy_cache_valid``, a CDN: keyed by URL, not by who asked) kept
  what one member pulled and handed it to the next client of that URL, anonymous or of
  another organisation, without asking the hub. Now every answer to a request with
  credentials (``Authorization``, or cookies) that sets no ``Cache-Control`` of its own
  is ``private, no-cache`` (``hub/headers.py``, one middleware); an anonymous answer
  (public repositories only) stays cacheable. And ``X-Content-Type-Options: nosniff``,
  set by the blob and manifest routes only, is on every answer (the referrers index and
  the JSON routes carry text a pusher wrote).
- A registry bearer token listed none of the private repositories it was granted
  (``_catalog``, ``/api/v1/repositories``, a repository's detail and lineage: 404) while
  it pulled them: the listing filter asked the bearer's own namespace roles (none).
- The browser sessions an account keeps were counted per account: whoever held one of
  its API tokens (a pull-only CI token) signed in with it 20 times and ended every
  session its owner had opened with the password. Now counted per credential.
- An API token's name and a pack's description were stored as sent: a newline and tabs
  forged lines in ``forkd hub token list``, ``ESC ] 52`` wrote the operator's clipboard,
  U+202E reordered the page. Now refused (``forkd.names.validate_line``). A manifest's
  ``artifactType`` and descriptors' ``mediaType`` must be media types (RFC 6838), and a
  pack config's one-line texts (compat values ``forkd pull`` prints) hold none either.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from hub_support import (
    OCI_MANIFEST,
    HubServer,
    api_token,
    artifact,
    browser,
    csrf_of,
    error_code,
    http,
    push_blob,
)

from forkd.errors import IntegrityError, InvalidInput, NotFound
from forkd.pack.config import Compat
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import pull
from forkd.store.store import Store
from forkd.synthetic import write_base


def test_answers_for_a_caller_are_private_to_caches(hub: HubServer, user: tuple[str, str]) -> None:
    repo = f"{user[0]}/cached"
    with hub.client(user) as c:
        digest, body = artifact(c, repo, b"private bytes", tag="v1")
        assert c.put(f"/api/v1/readme/{repo}", json={"readme": "# mine"}).status_code == 200
    layer = json.loads(body)["layers"][0]["digest"]
    bearer = http.get(
        f"{hub.url}/token", params={"scope": f"repository:{repo}:pull"}, auth=user
    ).json()["token"]
    private = [
        f"/v2/{repo}/manifests/v1",
        f"/v2/{repo}/manifests/{digest}",
        f"/v2/{repo}/blobs/{layer}",
        f"/v2/{repo}/tags/list",
        f"/v2/{repo}/referrers/{digest}",
        "/v2/_catalog",
        "/api/v1/repositories",
        f"/api/v1/repositories/{repo}",
        f"/api/v1/readme/{repo}",
        f"/api/v1/lineage/{repo}?tag=v1",
        f"/api/v1/orgs/{user[0]}/members",
        f"/api/v1/namespaces/{user[0]}/quota",
        "/api/v1/tokens",
    ]
    for path in private:
        for how in ({"auth": user}, {"headers": {"Authorization": f"Bearer {bearer}"}}):
            r = http.get(f"{hub.url}{path}", **how)  # type: ignore[arg-type]
            # A registry bearer token manages nothing, and /api/v1 answers it apart: what
            # it is answered (200, 403, 404) is its own all the same.
            if not (path.startswith("/api/v1/") and "headers" in how):
                assert r.status_code == 200, (path, r.status_code, r.text[:200])
            assert r.headers.get("cache-control") == "private, no-cache", (path, r.headers)
            assert r.headers.get("x-content-type-options") == "nosniff", (path, r.headers)
        anonymous = http.get(f"{hub.url}{path}")  # what a cache must not answer with
        assert anonymous.status_code in (200, 401, 403, 404), (path, anonymous.status_code)
        assert anonymous.status_code != 200 or repo not in anonymous.text, path
    with browser(hub, *user) as b:  # the UI's pages keep their own (private, no-store)
        assert b.get(f"/{repo}").headers["cache-control"] == "private, no-cache"
        assert b.get("/-/settings/tokens").headers["cache-control"] == "no-store"


def test_public_answers_to_anonymous_clients_stay_cacheable(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """A CDN in front of public packs still works: an anonymous pull of a public
    repository is not marked private (and still never sniffed)."""
    repo = f"{user[0]}/open"
    with hub.client(user) as c:
        digest, _ = artifact(c, repo, b"public bytes", tag="v1")
    hub.public(repo)
    token = http.get(f"{hub.url}/token", params={"scope": f"repository:{repo}:pull"}).json()
    for path in (f"/v2/{repo}/manifests/{digest}", f"/v2/{repo}/tags/list"):
        anonymous = http.get(f"{hub.url}{path}")
        assert anonymous.status_code == 200, anonymous.text
        assert "cache-control" not in anonymous.headers
        assert anonymous.headers["x-content-type-options"] == "nosniff"
        with_token = http.get(
            f"{hub.url}{path}", headers={"Authorization": f"Bearer {token['token']}"}
        )
        assert with_token.headers["cache-control"] == "private, no-cache"  # a credential


def test_a_registry_token_lists_what_it_may_pull(hub: HubServer, user: tuple[str, str]) -> None:
    """A registry bearer token granted pull on a private repository pulled it, and every
    listing and catalog route answered as if it could not see it (``_catalog`` without
    it, the repository's detail and lineage 404): the listing filter asked the bearer's
    role on the namespace, which is none (a token manages nothing), not its subject's.
    Now the token lists exactly what it may pull: its subject's view, narrowed to its
    grant."""
    repo, other = f"{user[0]}/granted", f"{user[0]}/not-granted"
    with hub.client(user) as c:
        artifact(c, repo, b"granted", tag="v1")
        artifact(c, other, b"other", tag="v1")
    bearer = http.get(
        f"{hub.url}/token", params={"scope": f"repository:{repo}:pull"}, auth=user
    ).json()["token"]
    auth = {"Authorization": f"Bearer {bearer}"}
    assert http.get(f"{hub.url}/v2/{repo}/manifests/v1", headers=auth).status_code == 200
    assert http.get(f"{hub.url}/v2/_catalog", headers=auth).json()["repositories"] == [repo]
    listed = http.get(f"{hub.url}/api/v1/repositories", headers=auth).json()["items"]
    assert [item["name"] for item in listed] == [repo]
    for path in (f"/api/v1/repositories/{repo}", f"/api/v1/lineage/{repo}?tag=v1"):
        assert http.get(f"{hub.url}{path}", headers=auth).status_code == 200, path
    for path in (f"/api/v1/repositories/{other}", f"/v2/{other}/manifests/v1"):
        assert http.get(f"{hub.url}{path}", headers=auth).status_code in (401, 403, 404), path


def test_a_token_s_sign_ins_do_not_end_the_password_s_sessions(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """The sessions one account keeps (``SESSIONS_PER_USER``) were counted for the
    account: whoever held any of its API tokens, a pull-only CI token, signed in with it
    ``SESSIONS_PER_USER`` times and ended every browser session its owner had opened with
    the password. Now each credential (the password, one token) has its own count."""
    from forkd.hub.ui.account import SESSIONS_PER_USER

    secret, _ = api_token(hub, user, f"{user[0]}:pull")
    with browser(hub, *user) as owner:
        assert owner.get("/-/settings/tokens").status_code == 200
        for _ in range(SESSIONS_PER_USER + 1):
            with browser(hub, user[0], secret) as holder:
                assert holder.get("/-/settings/tokens").status_code == 200
        page = owner.get("/-/settings/tokens", follow_redirects=False)
        assert page.status_code == 200, page.headers  # still signed in with the password


ESCAPES = (
    "ci\n42\tdeploy\t*:admin",
    "ci\x1b]52;c;cm0gLXJmIH4K\x07",
    "ci\x1b[2J",
    "ci\u202eevil",
    "ci\x9b31m",
)


def test_text_others_read_as_a_line_holds_no_escape_or_line_break(
    hub: HubServer, user: tuple[str, str]
) -> None:
    """An API token's name (listed to its owner, a robot's managers and the operator by
    ``forkd hub token list``) and a pack's description were stored as sent: a name with a
    newline and tabs printed a forged ``42 deploy *:admin`` line in the operator's
    listing, and one with ``ESC ] 52`` wrote the operator's clipboard (OSC 52), ``ESC [``
    drove their terminal, U+202E reordered the page. Now both are refused (400) on every
    surface that stores them, and the operator's listing shows a name stored before with
    its escapes visible."""
    repo = f"{user[0]}/lines"
    with hub.client(user) as c:
        artifact(c, repo, b"lines", tag="v1")
        for text in ESCAPES:
            r = c.post("/api/v1/tokens", json={"name": text, "scopes": [f"{user[0]}:pull"]})
            assert r.status_code == 400, (text, r.status_code, r.text)
            r = c.put(f"/api/v1/readme/{repo}", json={"description": text})
            assert r.status_code == 400, (text, r.status_code, r.text)
        assert c.get("/api/v1/tokens").json() == []
        assert c.get(f"/api/v1/readme/{repo}").json()["description"] == ""
        ok = c.post("/api/v1/tokens", json={"name": "ci · 日本", "scopes": [f"{user[0]}:pull"]})
        assert ok.status_code == 201, ok.text  # printable text of any script
    with browser(hub, *user) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        for text in ESCAPES:
            r = b.post("/-/settings/tokens", data={"csrf": csrf, "name": text, "scopes": ""})
            assert r.status_code == 400, (text, r.status_code)
            r = b.post(f"/-/edit/{repo}", data={"csrf": csrf, "description": text.strip()})
            assert r.status_code == 400, (text, r.status_code)
    # A name stored before the check (by hand here): the operator sees its escapes.
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute("UPDATE api_tokens SET name = ? WHERE name = ?", (ESCAPES[1], "ci · 日本"))
    listed = hub.cli("token", "list", "--user", user[0])
    assert "\x1b" not in listed and "\\x1b]52" in listed, listed


def test_media_types_of_a_manifest_are_media_types(hub: HubServer, user: tuple[str, str]) -> None:
    """A manifest's ``artifactType`` and its descriptors' ``mediaType`` were any string of
    up to 255 characters: stored, listed by the referrers API and the catalog API, and
    printed by registry clients (``oras discover``) with the pusher's escape sequences
    and line breaks. Now each must be a media type (RFC 6838; parameters in printable
    ASCII): 400 ``MANIFEST_INVALID``."""
    repo = f"{user[0]}/types"
    with hub.client(user) as c:
        _, body = artifact(c, repo, b"types", tag="v1")
        doc = json.loads(body)
        wrong = [
            ("artifactType", "application/x\x1b[2Jevil"),
            ("artifactType", "application/x\nforged: line"),
            ("artifactType", "not a media type"),
            ("config", "application/x\u202e"),
        ]
        for field, value in wrong:
            bad = json.loads(body)
            if field == "config":
                bad["config"]["mediaType"] = value
            else:
                bad[field] = value
            r = c.put(
                f"/v2/{repo}/manifests/bad",
                content=json.dumps(bad).encode(),
                headers={"Content-Type": OCI_MANIFEST},
            )
            assert r.status_code == 400 and error_code(r) == "MANIFEST_INVALID", (value, r.text)
        fine = dict(doc, artifactType="application/vnd.dev.sigstore.bundle+json;version=0.3")
        r = c.put(
            f"/v2/{repo}/manifests/fine",
            content=json.dumps(fine).encode(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert r.status_code == 201, r.text


def test_a_pulled_pack_s_config_holds_no_escape(
    hub: HubServer, user: tuple[str, str], tmp_path: Path
) -> None:
    """A pack is anyone's: its config's compat values are printed by ``forkd pull`` (the
    warning that this host cannot fork it: ``it needs machine M/cpu C``) and by ``forkd
    inspect``, its description on the hub's pages. They were read as sent, so a pusher's
    ``cpu_model`` with ``ESC ] 52`` wrote the clipboard of whoever pulled the pack. Now
    a config whose one-line texts hold an escape, a control character or a line break is
    not a valid config (``SnapshotConfig.validate``): the pulled pack does not load."""
    repo = f"{user[0]}/escapes"
    store = Store.open(tmp_path / "store")
    image = tmp_path / "base.mem"
    write_base(image, 1 << 20, seed=5)
    qemu = Compat("qemu", "8.2.2", "pc-q35-8.2", "max", ["kvm"], 1, 1, None, 1)
    store.import_layer("good", memory=image, compat=qemu)
    with pytest.raises(InvalidInput, match="description"):  # refused when made, too
        store.import_layer("bad", memory=image, compat=qemu, description="one\ntwo")
    with pytest.raises(NotFound):
        store.resolve("bad")
    hub.push(store, "good", f"{repo}:v1", user)
    with hub.client(user) as c:
        doc = c.get(f"/v2/{repo}/manifests/v1", headers={"Accept": OCI_MANIFEST}).json()
        config = c.get(f"/v2/{repo}/blobs/{doc['config']['digest']}").json()
        config["compat"]["cpu_model"] = "max\x1b]52;c;cm0gLXJmIH4K\x07"
        hostile = json.dumps(config).encode()
        doc["config"] = dict(doc["config"], digest=push_blob(c, repo, hostile), size=len(hostile))
        r = c.put(
            f"/v2/{repo}/manifests/evil",
            content=json.dumps(doc).encode(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert r.status_code == 201, r.text
    puller = Store.open(tmp_path / "puller")
    with hub.forkd_client(user) as client:
        clean = pull(puller, parse_remote(f"{hub.address}/{repo}:v1"), client)
        assert puller.config(clean.digest).compat == qemu
        with pytest.raises(IntegrityError, match="cpu_model"):
            result = pull(puller, parse_remote(f"{hub.address}/{repo}:evil"), client)
            puller.config(result.digest)  # what forkd pull and forkd inspect print
