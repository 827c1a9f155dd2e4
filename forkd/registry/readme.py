"""Set a pack's README (and description) on a forkd hub, after or apart from a push.

``forkd push --readme FILE`` calls ``set_readme`` once the manifests are up. The
hub's ``PUT /api/v1/readme/NS/NAME`` takes the same credentials as ``/v2/``: the
client answers its token challenge with the ``repository:NS/NAME:pull,push``
scope, so a push token is reused. Other OCI registries have no README API; they
answer 404 and ``set_readme`` raises ``RegistryNotFound``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from forkd.errors import InvalidInput
from forkd.names import validate_name
from forkd.registry.client import RegistryClient, json_answer

README_MAX = 256 * 1024


def read_readme(path: Path) -> str:
    """A README file's text: UTF-8, at most 256 KiB."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InvalidInput(f"cannot read README {path}: {exc.strerror or exc}") from exc
    if len(data) > README_MAX:
        raise InvalidInput(
            f"README {path} is {len(data)} bytes; the hub takes at most {README_MAX}"
        )
    try:
        return data.decode()
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"README {path} is not UTF-8 text") from exc


def set_readme(
    client: RegistryClient, repo: str, text: str | None, description: str | None = None
) -> dict[str, Any]:
    """Replace the README of ``repo`` (``NS/NAME``) with ``text``; set the description too when
    given. Returns the hub's answer (name, description, readme)."""
    validate_name(repo)
    body: dict[str, Any] = {}
    if text is not None:
        if len(text.encode()) > README_MAX:
            raise InvalidInput(f"README is over {README_MAX} bytes")
        body["readme"] = text
    if description is not None:
        body["description"] = description
    resp = client.request(
        "PUT", f"/api/v1/readme/{repo}", client.push_scope(repo), ok=(200,), json=body
    )
    return json_answer(resp, f"{client.hub}: README answer")
