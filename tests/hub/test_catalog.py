"""Hub API /api/v1: search, list, detail; only what the caller may pull; OpenAPI served."""

from __future__ import annotations

import json

from hub_support import OCI_MANIFEST, HubServer, artifact, http


def test_list_search_and_detail(fresh_hub: HubServer) -> None:
    alice = fresh_hub.add_user("alice")
    bob = fresh_hub.add_user("bob")
    with fresh_hub.client(auth=alice) as c:
        base, base_body = artifact(c, "alice/lang-graph", b"base" * 100, tag="base")
        subject = {"mediaType": OCI_MANIFEST, "digest": base, "size": len(base_body)}
        child, child_body = artifact(c, "alice/lang-graph", b"diff", tag="v2", subject=subject)
        artifact(c, "alice/private_one", b"secret", tag="v1")
        for _ in range(3):
            c.get("/v2/alice/lang-graph/manifests/v2")
    with fresh_hub.client(auth=bob) as c:
        artifact(c, "bob/tool", b"tool", tag="v1")
    fresh_hub.public("alice/lang-graph")

    def names(auth: tuple[str, str] | None, **params: str | int) -> list[str]:
        r = http.get(f"{fresh_hub.url}/api/v1/repositories", params=params, auth=auth)
        assert r.status_code == 200, r.text
        return [item["name"] for item in r.json()["items"]]

    assert names(None) == ["alice/lang-graph"]
    assert sorted(names(bob)) == ["alice/lang-graph", "bob/tool"]
    assert sorted(names(alice)) == ["alice/lang-graph", "alice/private_one"]
    assert names(alice, q="private") == ["alice/private_one"]
    assert names(alice, q="%") == []  # LIKE wildcards are literal
    assert names(bob, namespace="bob") == ["bob/tool"]
    assert names(alice, sort="pulls")[0] == "alice/lang-graph"
    r = http.get(
        f"{fresh_hub.url}/api/v1/repositories", params={"per_page": 1, "page": 2}, auth=alice
    )
    assert r.json()["total"] == 2 and len(r.json()["items"]) == 1
    assert http.get(f"{fresh_hub.url}/api/v1/repositories", params={"sort": "x"}).status_code == 400

    # A token narrowed to another namespace sees only public repositories.
    token = fresh_hub.token("alice", "bob:pull")
    assert names(("alice", token)) == ["alice/lang-graph"]

    r = http.get(f"{fresh_hub.url}/api/v1/repositories/alice/lang-graph")
    assert r.status_code == 200
    detail = r.json()
    assert detail["public"] is True and detail["pulls"] == 3
    tags = {t["name"]: t for t in detail["tags"]}
    assert tags["base"]["chain_depth"] == 0 and tags["base"]["parent"] is None
    assert tags["v2"]["chain_depth"] == 1 and tags["v2"]["parent"] == base
    assert tags["v2"]["digest"] == child
    layers = json.loads(child_body)
    expected = len(child_body) + layers["config"]["size"] + layers["layers"][0]["size"]
    assert tags["v2"]["size"] == expected
    assert tags["v2"]["artifact_type"] == "application/vnd.forkd.snapshot.v1"
    assert tags["v2"]["pulls"] == 3 and tags["base"]["pulls"] == 0  # counted per tag too

    for auth in (None, bob):
        r = http.get(f"{fresh_hub.url}/api/v1/repositories/alice/private_one", auth=auth)
        assert r.status_code == 404
    assert (
        http.get(f"{fresh_hub.url}/api/v1/repositories/alice/private_one", auth=alice).status_code
        == 200
    )
    assert http.get(f"{fresh_hub.url}/api/v1/repositories/Bad..Name").status_code == 400


def test_openapi_schema_is_served(hub: HubServer) -> None:
    r = http.get(f"{hub.url}/api/schema/openapi.json")
    assert r.status_code == 200
    paths = r.json()["paths"]
    assert "/api/v1/repositories" in paths and "/token" in paths


def test_lineage_of_a_tag(hub: HubServer, user: tuple[str, str]) -> None:
    name = f"{user[0]}/chain"
    with hub.client(auth=user) as c:
        base, base_body = artifact(c, name, b"base", tag="base")

        def child(tag: str, parent: str, body: bytes, payload: bytes) -> tuple[str, bytes]:
            subject = {"mediaType": OCI_MANIFEST, "digest": parent, "size": len(body)}
            return artifact(c, name, payload, tag=tag, subject=subject)

        d1, d1_body = child("d1", base, base_body, b"d1")
        d2, _ = child("d2", d1, d1_body, b"d2")
        s1, _ = child("s1", base, base_body, b"s1")

    url = f"{hub.url}/api/v1/lineage/{name}"
    r = http.get(url, params={"tag": "d1"}, auth=user)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["head"]["digest"] == d1 and body["head"]["parent"] == base
    assert [(a["digest"], a["tags"], a["depth"]) for a in body["ancestors"]] == [
        (base, ["base"], 1)
    ]
    assert [(d["digest"], d["depth"]) for d in body["descendants"]] == [(d2, 1)]

    body = http.get(url, params={"tag": "base"}, auth=user).json()
    assert body["ancestors"] == []
    assert {(d["digest"], d["depth"]) for d in body["descendants"]} == {(d1, 1), (s1, 1), (d2, 2)}

    assert http.get(url, params={"tag": "nope"}, auth=user).status_code == 404
    assert http.get(url, params={"tag": "d1"}).status_code == 404  # private: invisible
    assert http.get(url, params={"tag": "../x"}, auth=user).status_code == 400


def test_token_management_api(hub: HubServer, user: tuple[str, str]) -> None:
    api = f"{hub.url}/api/v1/tokens"
    assert http.get(api).status_code == 401
    r = http.post(api, json={"name": "laptop", "scopes": [f"{user[0]}:pull"]}, auth=user)
    assert r.status_code == 201, r.text
    created = r.json()
    secret = created["token"]
    assert secret.startswith("fkd_") and created["scopes"] == [f"{user[0]}:pull"]
    listed = http.get(api, auth=user).json()
    assert [t["name"] for t in listed] == ["laptop"] and "token" not in listed[0]

    # The token works for pulls and cannot mint more tokens.
    assert http.get(f"{hub.url}/v2/", auth=(user[0], secret)).status_code == 200
    r = http.post(api, json={"name": "x", "scopes": ["*:admin"]}, auth=(user[0], secret))
    assert r.status_code == 403
    r = http.post(api, json={"name": "x", "scopes": ["bad scope"]}, auth=user)
    assert r.status_code == 400

    # Someone else cannot revoke it; its owner can, and then it stops working.
    other = hub.add_user(f"{user[0]}r")
    assert http.delete(f"{api}/{created['id']}", auth=other).status_code == 404
    assert http.delete(f"{api}/{created['id']}", auth=user).status_code == 204
    assert http.get(f"{hub.url}/v2/", auth=(user[0], secret)).status_code == 401
    assert http.get(api, auth=user).json() == []


def test_v2_catalog_lists_visible_repositories(fresh_hub: HubServer) -> None:
    carol = fresh_hub.add_user("carol")
    dave = fresh_hub.add_user("dave")
    with fresh_hub.client(auth=carol) as c:
        for name in ("carol/a", "carol/b", "carol/c"):
            artifact(c, name, name.encode(), tag="v1")
    fresh_hub.public("carol/b")
    with fresh_hub.client(auth=carol) as c:
        assert c.get("/v2/_catalog").json() == {"repositories": ["carol/a", "carol/b", "carol/c"]}
        r = c.get("/v2/_catalog", params={"n": 2})
        assert r.json()["repositories"] == ["carol/a", "carol/b"]
        assert r.headers["link"] == '</v2/_catalog?n=2&last=carol%2Fb>; rel="next"'
        r = c.get(r.headers["link"][1 : r.headers["link"].index(">")])
        assert r.json()["repositories"] == ["carol/c"] and "link" not in r.headers
        assert c.delete("/v2/_catalog").status_code == 405
    with fresh_hub.client(auth=dave) as c:
        assert c.get("/v2/_catalog").json() == {"repositories": ["carol/b"]}
    r = http.get(f"{fresh_hub.url}/v2/_catalog")
    assert r.status_code == 401 and 'scope="registry:catalog:*"' in r.headers["www-authenticate"]
