"""Big JSON documents are checked and parsed off the hub's event loop.

Checking and parsing a JSON document runs at Python speed on documents of many small
objects (``{},`` repeated: about 0.3 s a MiB here). A manifest PUT of 4 MiB (the default
``manifest_max_bytes``) parsed on the event loop stalled every other request of the
process, pulls and ``/healthz`` included, for a second or more, and anyone with an
account may push to their own namespace. A manifest, or a JSON request body (a README
of up to 512 KiB), bigger than ``jsondoc.INLINE_MAX`` is now parsed in a worker thread
(bench/hub_manifest_stall.py measures what other requests wait).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hub_server import HubServer
from hub_support import artifact

from forkd import jsondoc

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def _recording(
    monkeypatch: pytest.MonkeyPatch, name: str, seen: list[tuple[int, bool]]
) -> None:
    """``jsondoc.NAME`` records (document size, ran on an event loop) of each call."""
    real: Callable[..., Any] = getattr(jsondoc, name)

    def record(data: bytes | str, *args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        seen.append((len(data), on_loop))
        return real(data, *args, **kwargs)

    monkeypatch.setattr(jsondoc, name, record)


def _bulky_manifest(size: int) -> bytes:
    head = b'{"schemaVersion":2,"mediaType":"' + MANIFEST.encode() + b'","annotations":{"a":['
    return head + b"{}," * (size // 3) + b'{}]}}'


def test_a_big_manifest_is_parsed_off_the_event_loop(
    hub: HubServer, user: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, bool]] = []
    _recording(monkeypatch, "loads", seen)
    big = _bulky_manifest(2 << 20)
    with hub.client(user) as c:
        artifact(c, f"{user[0]}/small", b"one layer", tag="v1")  # a small one, inline
        r = c.put(
            f"/v2/{user[0]}/big/manifests/v1", content=big, headers={"Content-Type": MANIFEST}
        )
        assert r.status_code == 400, r.text  # parsed, then refused: no config, no layers
        assert r.json()["errors"][0]["code"] == "MANIFEST_INVALID"
    sizes = {size: on_loop for size, on_loop in seen}
    assert sizes[len(big)] is False, seen
    assert any(on_loop for size, on_loop in seen if size <= jsondoc.INLINE_MAX), seen


def test_a_big_json_body_is_checked_off_the_event_loop(
    hub: HubServer, user: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[int, bool]] = []
    _recording(monkeypatch, "check_body", seen)
    repo = f"{user[0]}/readme"
    with hub.client(user) as c:
        artifact(c, repo, b"layer", tag="v1")
        small = c.put(f"/api/v1/readme/{repo}", json={"readme": "# short"})
        assert small.status_code == 200, small.text
        big = c.put(f"/api/v1/readme/{repo}", json={"readme": "x" * (200 << 10)})
        assert big.status_code == 200, big.text
    assert [on_loop for size, on_loop in seen if size > jsondoc.INLINE_MAX] == [False], seen
    assert [on_loop for size, on_loop in seen if size <= jsondoc.INLINE_MAX] == [True], seen
