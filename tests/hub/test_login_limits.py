"""Failed-login limiting that hands nobody a lockout of someone else (issue 10, item 7):
counted per client address, X-Forwarded-For believed only from configured proxies, API
tokens never throttled by the password limiter."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hub_support import TIMEOUT, HubServer

LIMIT = 3
PROXY = "127.0.0.4"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[HubServer]:
    server = HubServer(
        tmp_path / "hub", {"login_fail_limit": LIMIT, "trusted_proxies": f"{PROXY}/32"}
    ).start()
    try:
        yield server
    finally:
        server.stop()


def _from(hub: HubServer, source: str) -> httpx.Client:
    """A client whose connections come from the loopback address ``source``."""
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=hub.url, transport=transport, timeout=TIMEOUT)


def test_an_attacker_cannot_lock_out_someone_else(hub: HubServer) -> None:
    name, password = hub.add_user("victim")
    token = hub.token("victim", "victim:pull")
    with _from(hub, "127.0.0.2") as attacker:
        for i in range(LIMIT + 3):  # rotating X-Forwarded-For, from an untrusted peer
            r = attacker.get(
                "/token", auth=(name, f"guess-{i}xx"), headers={"X-Forwarded-For": f"203.0.113.{i}"}
            )
            assert r.status_code == (401 if i < LIMIT else 429), (i, r.status_code)
        # The header did not help the attacker: its own address is what is limited ...
        assert attacker.get("/token", auth=(name, password)).status_code == 429
        # ... and the victim's API token works even from there.
        assert attacker.get("/token", auth=(name, token)).status_code == 200
        assert attacker.get("/v2/", auth=(name, token)).status_code == 200
    with _from(hub, "127.0.0.3") as victim:  # the victim, elsewhere, signs in as ever
        assert victim.get("/token", auth=(name, password)).status_code == 200


def test_bad_tokens_are_refused_but_not_counted(hub: HubServer) -> None:
    name, password = hub.add_user("tokenuser")
    with _from(hub, "127.0.0.5") as c:
        for _ in range(LIMIT + 2):
            assert c.get("/v2/", auth=(name, "fkd_" + "x" * 43)).status_code == 401
        assert c.get("/v2/", auth=(name, password)).status_code == 200


def test_forwarded_for_is_believed_from_a_trusted_proxy_only(hub: HubServer) -> None:
    name, _ = hub.add_user("proxied")
    with _from(hub, PROXY) as proxy:
        for i in range(LIMIT):
            r = proxy.get(
                "/v2/", auth=(name, f"wrong-{i}xxx"),
                headers={"X-Forwarded-For": "198.51.100.7, 127.0.0.4"},
            )  # fmt: skip
            assert r.status_code == 401
        # 198.51.100.7 is limited; another client behind the same proxy is not.
        limited = {"X-Forwarded-For": "198.51.100.7"}
        assert proxy.get("/v2/", auth=(name, "again-xxx"), headers=limited).status_code == 429
        other = {"X-Forwarded-For": "198.51.100.8"}
        assert proxy.get("/v2/", auth=(name, "again-xxx"), headers=other).status_code == 401
        # A client cannot prepend its own "proxy chain": the nearest untrusted hop counts.
        spoof = {"X-Forwarded-For": "198.51.100.9, 198.51.100.7"}
        assert proxy.get("/v2/", auth=(name, "again-xxx"), headers=spoof).status_code == 429


def test_invalid_trusted_proxies_are_refused(tmp_path: Path) -> None:
    from forkd.errors import InvalidInput
    from forkd.hub.settings import HubSettings

    with pytest.raises(InvalidInput, match="invalid trusted proxy 'not-an-ip'"):
        HubSettings(tmp_path, trusted_proxies="10.0.0.1,not-an-ip").validated()
