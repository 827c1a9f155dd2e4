"""Hostile review 21: text read back as stored, and what a narrowed token may create.

1. Text a client stores for others to read as one line (an API token's name, a pack's
   description, a team's glob) is refused with a control character, a line break or a
   bidi override since review 19, but only when written: a row stored before that (by
   an older hub, another tool, or by hand) was shown as stored. ``forkd hub token list``
   kept its newlines and tabs (a name ``ci\\n42\\tdeploy\\t*:admin`` printed a forged token
   line in the operator's listing; ``team list`` printed a glob raw), the UI showed
   U+202E and ESC as they were (a bidi override reordered the token page and the pack's
   description), and the JSON answers (``/api/v1/tokens``, ``/api/v1/readme``, team
   listings, a tag's media types) carried them to whoever prints them. A manifest's
   annotations are never checked (the OCI spec lets them be any string), and the lineage
   API answered a pusher's ``dev.forkd.parent.tag`` as sent. Now every path that shows
   such text writes what a terminal or page acts on as its escape (``\\x1b``, ``\\u202e``;
   in one-line fields ``\\x0a`` and ``\\x09`` too): ``hub/display.py``, the UI templates'
   ``finalize`` (every plain text a page shows), the CLI's listings and those API fields.
   A README's Markdown stays as written (prose; its rendered HTML is sanitised).
2. A site admin's API token narrowed to ``*:push`` (a CI job's, meant to push anywhere)
   created new namespaces by pushing into them, though elsewhere a site admin's token
   acts as one only with ``*:admin`` (``Principal.site_admin``): the namespace it made
   blocks a user or organisation of that name for good (their creation is a 409), and it
   has no admin but the site's. Now a namespace is created by a push only for a site
   admin acting as one (the password, or a token of scope ``*:admin``, also through a
   registry bearer token from it); other tokens get 404 ``NAME_UNKNOWN`` as any pusher
   into a namespace that does not exist.
"""

from __future__ import annotations

import json
import re
import sqlite3

import httpx
from hub_server import ADMIN, HubServer
from hub_support import (
    OCI_MANIFEST,
    api_token,
    artifact,
    browser,
    error_code,
    org_with_pusher,
    push_blob,
    unique_name,
)

from forkd.errors import InvalidInput
from forkd.names import validate_line

# What an older hub stored: a forged line and columns, OSC 52 (the clipboard), a CSI, a
# bidi override, a C1 CSI.
FORGED_NAME = "ci\n42\tdeploy\t*:admin"
HOSTILE = "x\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\u202eevil\x9b31m"
RAW = ("\x1b", "\u202e", "\x9b", "\x07")


def _one_line(text: str | None) -> bool:
    """Whether ``text`` holds nothing ``validate_line`` refuses (None: absent, fine)."""
    if text is None:
        return True
    try:
        validate_line(text, "shown text")
    except InvalidInput:
        return False
    return True


def _raw_in(page: str) -> list[str]:
    return [c for c in RAW if c in page]


def test_token_names_stored_before_the_checks_are_shown_escaped(
    hub: HubServer, user: tuple[str, str]
) -> None:
    _, token_id = api_token(hub, user, f"{user[0]}:pull")
    _, second_id = api_token(hub, user, f"{user[0]}:pull")
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute("UPDATE api_tokens SET name = ? WHERE id = ?", (FORGED_NAME, token_id))
        db.execute("UPDATE api_tokens SET name = ? WHERE id = ?", (HOSTILE, second_id))
    # The operator's listing: one line of four columns per token, whatever its name.
    listed = hub.cli("token", "list", "--user", user[0]).splitlines()
    assert len(listed) == 2, listed
    assert all(len(line.split("\t")) == 4 for line in listed), listed
    assert "ci\\x0a42\\x09deploy\\x09*:admin" in listed[0], listed
    assert not _raw_in("\n".join(listed)), listed
    # The owner's API listing: each name one line, escapes visible.
    with hub.client(user) as c:
        names = [t["name"] for t in c.get("/api/v1/tokens").json()]
    assert names == [
        "ci\\x0a42\\x09deploy\\x09*:admin",
        "x\\x1b]52;c;cm0gLXJmIH4K\\x07\\x1b[2J\\u202eevil\\x9b31m",
    ]
    # The UI's token page.
    with browser(hub, *user) as b:
        page = b.get("/-/settings/tokens").text
    assert not _raw_in(page), _raw_in(page)
    assert "\\u202eevil" in page


def test_robot_token_names_stored_before_the_checks_are_shown_escaped(
    hub: HubServer,
) -> None:
    org, alice, _bob = org_with_pusher(hub)
    robot = unique_name("bot")
    with browser(hub, *alice) as b:
        page = b.get("/-/settings/tokens").text
        csrf = re.search(r'name="csrf" value="([^"]*)"', page)
        assert csrf
        data = {"csrf": csrf.group(1), "namespace": org, "robot": robot, "role": "pull"}
        assert b.post("/-/settings/robots", data=data).status_code == 303
        with sqlite3.connect(hub.data_dir / "hub.db") as db:
            db.execute(
                "UPDATE api_tokens SET name = ? WHERE user_id = "
                "(SELECT id FROM users WHERE name = ?)",
                (HOSTILE, robot),
            )
        page = b.get("/-/settings/tokens").text
    assert robot in page
    assert not _raw_in(page), _raw_in(page)


def test_descriptions_and_globs_stored_before_the_checks_are_shown_escaped(
    hub: HubServer,
) -> None:
    org, alice, _bob = org_with_pusher(hub)
    repo = f"{org}/app"
    with hub.client(alice) as c:
        r = c.put(f"/api/v1/readme/{repo}", json={"readme": "# hello\n\nשלום \u200f!"})
        assert r.status_code == 200, r.text
        r = c.post(
            f"/api/v1/orgs/{org}/teams",
            json={"name": "ops", "role": "pull", "repositories": f"{org}/app-*"},
        )
        assert r.status_code == 201, r.text
    hub.public(repo)
    with sqlite3.connect(hub.data_dir / "hub.db") as db:
        db.execute(
            "UPDATE repositories SET description = ? WHERE name = ?", (HOSTILE + "\nline 2", repo)
        )
        db.execute(
            "UPDATE teams SET repositories = ? WHERE name = 'ops' AND namespace_id = "
            "(SELECT id FROM namespaces WHERE name = ?)",
            (f"{org}/\x1b[2J*\u202e", org),
        )
    with httpx.Client(base_url=hub.url) as anonymous:
        for path in (f"/{repo}", f"/{org}", "/-/search?q=" + org, "/"):
            page = anonymous.get(path).text
            assert not _raw_in(page), (path, _raw_in(page))
        assert "\\u202eevil" in anonymous.get(f"/{repo}").text
        description = anonymous.get(f"/api/v1/readme/{repo}").json()["description"]
        assert _one_line(description) and "\\x1b]52" in description, description
    with hub.client(alice) as c:
        page = c.get(f"/api/v1/orgs/{org}/teams").json()
        globs = [t["repositories"] for t in page]
        assert all(_one_line(g) for g in globs) and globs == [f"{org}/\\x1b[2J*\\u202e"], globs
        assert page[0]["problem"], page  # and it grants nothing, as before
        readme = c.get(f"/api/v1/readme/{repo}").json()["readme"]
        assert readme == "# hello\n\nשלום \u200f!"  # prose stays as written
    with browser(hub, *alice) as b:
        page = b.get(f"/{org}").text  # members and teams shown to a member
        assert "ops" in page and not _raw_in(page), _raw_in(page)
        pack = b.get(f"/{repo}").text
        # The README's source in its edit form is the author's, RTL marks included.
        assert "שלום \u200f!" in pack and not _raw_in(pack), _raw_in(pack)
    listed = hub.cli("team", "list", org)
    assert len(listed.splitlines()) == 1 and not _raw_in(listed), listed


def test_annotations_in_the_lineage_api_are_shown_escaped(
    hub: HubServer, user: tuple[str, str]
) -> None:
    repo = f"{user[0]}/notes"
    with hub.client(user) as c:
        base, _ = artifact(c, repo, b"base layer", tag="v1")
        push_blob(c, repo, b"{}")
        layer = push_blob(c, repo, b"child layer")
        child = {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "artifactType": "application/vnd.forkd.snapshot.v1",
            "config": {
                "mediaType": "application/vnd.oci.empty.v1+json",
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
                "size": 2,
            },
            "layers": [
                {"mediaType": "application/vnd.forkd.vmstate.v1", "digest": layer, "size": 11}
            ],
            "subject": {"mediaType": OCI_MANIFEST, "digest": base, "size": 1},
            "annotations": {
                "dev.forkd.parent.tag": "v1\n\x1b]52;c;cm0gLXJmIH4K\x07\u202e",
                "dev.forkd.compacted.from": "v0\x1b[2J@sha256:" + "0" * 64,
            },
        }
        base_size = len(c.get(f"/v2/{repo}/manifests/v1", headers={"Accept": OCI_MANIFEST}).content)
        child["subject"]["size"] = base_size
        r = c.put(
            f"/v2/{repo}/manifests/v2",
            content=json.dumps(child).encode(),
            headers={"Content-Type": OCI_MANIFEST},
        )
        assert r.status_code == 201, r.text
        lineage = c.get(f"/api/v1/lineage/{repo}", params={"tag": "v2"}).json()
    head = lineage["head"]
    assert head["parent"] == base
    assert head["parent_tag"] == "v1\\x0a\\x1b]52;c;cm0gLXJmIH4K\\x07\\u202e", head
    assert head["compacted_from"] == "v0\\x1b[2J@sha256:" + "0" * 64, head


def test_a_site_admins_narrowed_token_creates_no_namespace(hub: HubServer) -> None:
    pushes_anywhere = hub.token(ADMIN[0], "*:push")
    namespace = unique_name("ns")
    with hub.client((ADMIN[0], pushes_anywhere)) as c:
        r = c.post(f"/v2/{namespace}/app/blobs/uploads/")
        assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN", r.text
        assert "namespace" in r.json()["errors"][0]["detail"], r.text
    # Nothing was made: the name stays free for a user or an organisation.
    user = hub.add_user(namespace)
    with hub.client(user) as c:
        artifact(c, f"{namespace}/mine", b"mine", tag="v1")
    # Through a registry bearer token from the narrowed token: the same.
    namespace = unique_name("ns")
    with httpx.Client(base_url=hub.url, auth=(ADMIN[0], pushes_anywhere)) as c:
        r = c.get("/token", params={"scope": f"repository:{namespace}/app:pull,push"})
        bearer = r.json()["token"]
    with httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {bearer}"}) as c:
        r = c.post(f"/v2/{namespace}/app/blobs/uploads/")
        assert r.status_code == 404 and error_code(r) == "NAME_UNKNOWN", r.text
    # A site admin acting as one still creates namespaces by pushing: with the password,
    # with a token of scope *:admin, and through a bearer token of either.
    acting = hub.token(ADMIN[0], "*:admin")
    for credential in (ADMIN, (ADMIN[0], acting)):
        namespace = unique_name("ns")
        with hub.client(credential) as c:
            artifact(c, f"{namespace}/app", b"by the site admin", tag="v1")
        namespace = unique_name("ns")
        with httpx.Client(base_url=hub.url, auth=credential) as c:
            r = c.get("/token", params={"scope": f"repository:{namespace}/app:pull,push"})
            bearer = r.json()["token"]
        with httpx.Client(base_url=hub.url, headers={"Authorization": f"Bearer {bearer}"}) as c:
            artifact(c, f"{namespace}/app", b"by the site admin's bearer", tag="v1")
