"""Hostile review 19: what a cache in front of the hub may keep, and for whom.

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
"""

from __future__ import annotations

import json

from hub_support import HubServer, api_token, artifact, browser, http


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
