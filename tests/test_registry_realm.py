"""forkd's registry client sends credentials only to the registry's own origin or a token
realm the user trusts (issue 10 item 13a). The registry is a peer here (an httpx mock
transport answering like one); the client under test is the real one."""

from __future__ import annotations

import httpx
import pytest

from forkd.errors import InvalidInput
from forkd.registry.client import TRUSTED_REALMS_ENV, AuthError, RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub

REGISTRY = Hub("registry.example", "https")


class Peer:
    """A registry at https://registry.example whose challenge names ``realm``; every
    request it or any realm receives is recorded."""

    def __init__(self, realm: str) -> None:
        self.realm = realm
        self.seen: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append(request)
        if request.url.path == "/token":
            return httpx.Response(200, json={"token": "t0k"})
        if request.headers.get("authorization") == "Bearer t0k":
            return httpx.Response(200, json={})
        challenge = f'Bearer realm="{self.realm}",service="reg",scope="repository:a/b:pull"'
        return httpx.Response(401, headers={"WWW-Authenticate": challenge})

    def token_requests(self) -> list[httpx.Request]:
        return [r for r in self.seen if r.url.path == "/token"]


def _client(peer: Peer, credential: Credential | None, **kwargs: object) -> RegistryClient:
    client = RegistryClient(REGISTRY, credential, **kwargs)  # type: ignore[arg-type]
    client.http.close()
    client.http = httpx.Client(base_url=REGISTRY.url, transport=httpx.MockTransport(peer))
    return client


CREDENTIAL = Credential("alice", "alice-secret")


@pytest.mark.parametrize(
    "realm",
    [
        "https://evil.example/token",  # another host
        "https://registry.example.evil.example/token",
        "https://registry.example:8443/token",  # another port
        "http://registry.example/token",  # https → http downgrade
        "ftp://registry.example/token",
    ],
)
def test_credentials_never_go_to_another_origin(
    realm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRUSTED_REALMS_ENV, raising=False)
    peer = Peer(realm)
    with _client(peer, CREDENTIAL) as client, pytest.raises(AuthError) as refused:
        client.request("GET", "/v2/a/b/tags/list", "repository:a/b:pull")
    assert peer.token_requests() == []  # nothing was sent to the realm
    assert all("authorization" not in r.headers for r in peer.seen)
    message = str(refused.value)
    assert "refusing" in message or "not an http(s) URL" in message
    if realm.startswith("http"):
        assert TRUSTED_REALMS_ENV in message


@pytest.mark.parametrize(
    "realm", ["https://registry.example/token", "https://REGISTRY.example:443/token", "/token"]
)
def test_the_registrys_own_realm_gets_the_credentials(
    realm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(TRUSTED_REALMS_ENV, raising=False)
    peer = Peer(realm)
    with _client(peer, CREDENTIAL) as client:
        client.request("GET", "/v2/a/b/tags/list", "repository:a/b:pull")
    (token_request,) = peer.token_requests()
    assert token_request.headers["authorization"].startswith("Basic ")


def test_a_trusted_realm_gets_the_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    peer = Peer("https://auth.example/token")
    monkeypatch.setenv(TRUSTED_REALMS_ENV, "https://other.example, https://auth.example")
    with _client(peer, CREDENTIAL) as client:
        client.request("GET", "/v2/a/b/tags/list", "repository:a/b:pull")
    assert peer.token_requests()[0].url.host == "auth.example"
    monkeypatch.delenv(TRUSTED_REALMS_ENV)
    peer = Peer("https://auth.example:444/token")
    with _client(peer, CREDENTIAL, trusted_realms=("https://auth.example:444",)) as client:
        client.request("GET", "/v2/a/b/tags/list", "repository:a/b:pull")
    assert "authorization" in peer.token_requests()[0].headers


def test_without_credentials_any_realm_gives_an_anonymous_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(TRUSTED_REALMS_ENV, raising=False)
    peer = Peer("https://auth.example/token")
    with _client(peer, None) as client:
        client.request("GET", "/v2/a/b/tags/list", "repository:a/b:pull")
    (token_request,) = peer.token_requests()
    assert "authorization" not in token_request.headers


def test_a_malformed_trusted_realm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRUSTED_REALMS_ENV, "auth.example")
    with pytest.raises(InvalidInput, match=TRUSTED_REALMS_ENV):
        RegistryClient(REGISTRY, CREDENTIAL)
