"""Hostile review 3: answers that must not depend on what a client cannot know, and
states that must not be lost.

* a malformed manifest reference (digest or tag) is the client's error (400) on every
  method, as it is on the blob and referrers routes, never 404 MANIFEST_UNKNOWN;
"""

from __future__ import annotations

import httpx
import pytest
from hub_support import HubServer, artifact, error_code

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
