"""Compact a tag on a forkd hub, from the blobs the hub already holds (nothing is uploaded).

``forkd compact --remote [HUB/]NS/NAME:TAG --to NEWTAG`` calls ``compact_remote``. The
hub's ``POST /api/v1/compact/NS/NAME`` takes the same credentials as ``/v2/``: the client
answers its token challenge with the ``repository:NS/NAME:pull,push`` scope. Other OCI
registries have no such API; they answer 404 and ``compact_remote`` raises
``RegistryNotFound``.
"""

from __future__ import annotations

from typing import Any

from forkd.errors import Conflict
from forkd.names import validate_name, validate_tag
from forkd.registry.client import RegistryClient, json_answer


def compact_remote(
    client: RegistryClient, repo: str, tag: str, to: str, force: bool = False
) -> dict[str, Any]:
    """Flatten ``repo:tag``'s chain into a new flat tag ``repo:to`` on the hub. Returns the
    hub's answer: repository, tag, digest, depth (0), memory_size, stored_bytes, new_blobs,
    new_bytes, compacted_from {from_tag, from_digest, from_depth, reason}."""
    validate_name(repo)
    validate_tag(tag)
    validate_tag(to)
    resp = client.request(
        "POST",
        f"/api/v1/compact/{repo}",
        client.push_scope(repo),
        ok=(201, 409),
        json={"tag": tag, "to": to, "force": force},
    )
    if resp.status_code == 409:
        raise Conflict(
            f"{client.hub}: tag {repo}:{to} exists; pick another tag or pass --force to replace it"
        )
    return json_answer(resp, f"{client.hub}: compaction answer")
