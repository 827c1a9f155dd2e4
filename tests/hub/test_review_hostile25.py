"""Hostile review 25: one rule where there were two.

1. Searches and name filters gave one answer on SQLite and another on PostgreSQL: SQL
   ``LIKE`` ignores the case of A-Z on SQLite and not on PostgreSQL, and the search
   (``/api/v1/repositories?q=``, the UI's ``/-/search`` over names and descriptions) and
   the namespace filters (``?namespace=``) were plain ``LIKE``s. The UI's search for
   ``debian`` found the pack described "Debian Base Image" on SQLite and nothing on
   PostgreSQL; the API's ``q=ACME`` and ``namespace=ACME`` listed ``acme``'s
   repositories on SQLite only. Now LIKE is case-sensitive on both
   (SQLite's connections set ``case_sensitive_like``: every LIKE, present or future), and
   a search that ignores case says so (``db.contains_folded``: A-Z as a-z, other letters
   as they are, on both backends).
"""

from __future__ import annotations

import re

import httpx
from hub_support import ADMIN, HubServer, artifact, browser, unique_name


def _search_ui(c: httpx.Client, q: str) -> set[str]:
    """The pack names the UI's search page lists for ``q``."""
    r = c.get("/-/search", params={"q": q})
    assert r.status_code == 200, r.text
    return set(re.findall(r'href="/([a-z0-9._-]+/[a-z0-9._/-]+)"', r.text))


def test_search_ignores_the_case_of_a_to_z_on_both_backends(backend_hub: HubServer) -> None:
    """Before: on SQLite the UI's search for ``debian`` found a pack described "Debian
    Base Image", and the API's ``q=ACME`` and ``namespace=ACME`` listed acme's packs; on
    PostgreSQL none did. Now the searches ignore the case of A-Z on both backends (names
    and descriptions); the namespace filter is the exact name on both."""
    hub = backend_hub
    org = unique_name("acme")
    with hub.client(ADMIN) as c:
        assert c.post("/api/v1/orgs", json={"name": org}).status_code == 201
        artifact(c, f"{org}/base", b"layer", tag="v1")
        artifact(c, f"{org}/cafe", b"layer 2", tag="v1")
        r = c.put(f"/api/v1/readme/{org}/base", json={"description": "Debian Base Image"})
        assert r.status_code == 200, r.text
        r = c.put(f"/api/v1/readme/{org}/cafe", json={"description": "Le CAFÉ"})
        assert r.status_code == 200, r.text

        def api(**params: str) -> set[str]:
            r = c.get("/api/v1/repositories", params=params)
            assert r.status_code == 200, r.text
            return {item["name"] for item in r.json()["items"]}

        assert api(q=org.upper()) == {f"{org}/base", f"{org}/cafe"}
        assert api(q="BASE") >= {f"{org}/base"}
        assert api(namespace=org) == {f"{org}/base", f"{org}/cafe"}
        assert api(namespace=org.upper()) == set()  # a namespace is its exact name
    with browser(hub, *ADMIN) as b:
        assert f"{org}/base" in _search_ui(b, "debian")
        assert f"{org}/base" in _search_ui(b, "DEBIAN BASE")
        assert f"{org}/cafe" in _search_ui(b, "le caf")
