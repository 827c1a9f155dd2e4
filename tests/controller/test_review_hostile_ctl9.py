"""The controller against the eleventh hostile review: where a client's credentials go.

Both SDKs sent the daemon's bearer token (and a password in the URL) over plain
``http://`` to whatever host the URL named: a remote daemon on a LAN (the documented
``http://10.0.0.5:7070``) gave every host on the path the token, and with it every
sandbox of the daemon, their files and the secrets their egress injects. Now such a URL
is the client's InvalidInput, before any byte is sent, saying how to go on (https://, an
SSH tunnel to 127.0.0.1, or the explicit opt-in ``plain_http=True`` / ``plainHttp:
true``); loopback (``127.0.0.0/8``, ``::1``, ``localhost``) and https:// are as before,
and a daemon on this host is reached directly: with ``HTTP_PROXY`` in the environment the
Python client sent ``http://127.0.0.1`` requests, token and all, to that proxy.
The TypeScript SDK connected to whatever socket was at the daemon's default place: a
``$FORKD_RUN`` another local user made first (``/tmp/forkd-UID`` when there is no
``$XDG_RUNTIME_DIR``), or one others may write, answered as the daemon and was sent every
command, file and cell; it now checks the place as the Python client does
(forkd.private), and the socket's owner.

No VM: the real clients (RemoteBackend under the Python SDK, the TypeScript Controller in
Node) against a server on uvicorn, bound to every address of this host or to a Unix
socket, that records the credentials each request brings; a directory another user owns
is made by root (the test skips without it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from net_support import free_port, running

from forkd.controller.client import RemoteBackend
from forkd.controller.sdk import Controller
from forkd.errors import InvalidInput

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript" / "src" / "index.js"
TOKEN = "t" * 43


@dataclass
class Seen:
    """What the recording server was sent: each request's Authorization header."""

    authorizations: list[bytes] = field(default_factory=list)


def recording_app(seen: Seen) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope["headers"])
        seen.authorizations.append(headers.get(b"authorization", b""))
        body = b'{"error": {"type": "NotFound", "message": "nothing here", "exit_code": 2}}'
        await send({"type": "http.response.start", "status": 404,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return app


def this_hosts_other_address() -> str:
    """An address of this host that is not loopback (the one its default route leaves
    from): a URL naming it is a URL of another host, as far as a client can tell."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # nothing is sent: the route is only looked up
        except OSError:
            pytest.skip("this host has no address but loopback")
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.skip("this host has no address but loopback")
    return address


@pytest.fixture
def server() -> Iterator[tuple[int, Seen]]:
    """The recording server on every IPv4 address of this host: its port and what it saw."""
    seen = Seen()
    port = free_port("0.0.0.0")
    config = uvicorn.Config(recording_app(seen), host="0.0.0.0", port=port,
                            log_level="warning", lifespan="off")
    with running(uvicorn.Server(config)):
        yield port, seen


# -- the Python client --------------------------------------------------------------
@pytest.mark.parametrize("userinfo, token", [("", TOKEN), ("forkd:hunter2@", None)])
def test_credentials_are_not_sent_over_plain_http_to_another_host(
        server: tuple[int, Seen], userinfo: str, token: str | None) -> None:
    port, seen = server
    url = f"http://{userinfo}{this_hosts_other_address()}:{port}"
    with pytest.raises(InvalidInput, match="plain_http=True") as refused:
        RemoteBackend(url=url, token=token).snapshots()
    with pytest.raises(InvalidInput, match="plain_http=True"):
        Controller(url=url, token=token).snapshots()
    assert seen.authorizations == []
    assert "hunter2" not in str(refused.value)


def test_plain_http_to_another_host_is_the_callers_choice(server: tuple[int, Seen]) -> None:
    port, seen = server
    url = f"http://{this_hosts_other_address()}:{port}"
    with pytest.raises(Exception, match="nothing here"):
        Controller(url=url, token=TOKEN, plain_http=True).snapshots()
    assert seen.authorizations == [f"Bearer {TOKEN}".encode()]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_plain_http_to_this_host_sends_the_token(server: tuple[int, Seen], host: str) -> None:
    port, seen = server
    with pytest.raises(Exception, match="nothing here"):
        RemoteBackend(url=f"http://{host}:{port}", token=TOKEN).snapshots()
    assert seen.authorizations == [f"Bearer {TOKEN}".encode()]


def test_a_daemon_on_this_host_is_reached_without_the_environments_proxy(
        server: tuple[int, Seen], monkeypatch: pytest.MonkeyPatch) -> None:
    """With HTTP_PROXY set (a corporate proxy, a sandbox's egress proxy), the client sent
    its request for http://127.0.0.1 to the proxy, the token in the clear to another host,
    and the proxy could only reach its own loopback."""
    port, seen = server
    proxy_seen = Seen()
    proxy_port = free_port("0.0.0.0")
    config = uvicorn.Config(recording_app(proxy_seen), host="0.0.0.0", port=proxy_port,
                            log_level="warning", lifespan="off")
    with running(uvicorn.Server(config)):
        proxy = f"http://{this_hosts_other_address()}:{proxy_port}"
        for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
            monkeypatch.setenv(name, proxy)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        with pytest.raises(Exception, match="nothing here"):
            RemoteBackend(url=f"http://127.0.0.1:{port}", token=TOKEN).snapshots()
    assert proxy_seen.authorizations == []
    assert seen.authorizations == [f"Bearer {TOKEN}".encode()]


# -- the TypeScript SDK -------------------------------------------------------------
SEND = """
import { Controller } from "%s";
try {
  const ctl = new Controller(%s);
  await ctl.snapshots();
  console.log(JSON.stringify({sent: true}));
} catch (e) {
  console.log(JSON.stringify({type: e?.type ?? null, message: String(e?.message ?? e)}));
}
"""


def node_send(options: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    """What the TypeScript Controller made of ``options`` (``env`` added to this process's
    environment): ``{"sent": true}`` or the error it raised."""
    from test_typescript_sdk import node

    script = SEND % (SDK.as_uri(), json.dumps(options))
    done = subprocess.run([node(), "--input-type=module", "-e", script], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"the Node process ended: {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_node_the_token_is_not_sent_over_plain_http_to_another_host(
        server: tuple[int, Seen]) -> None:
    port, seen = server
    url = f"http://{this_hosts_other_address()}:{port}"
    got = node_send({"url": url, "token": TOKEN})
    assert got["type"] == "InvalidInput" and "plainHttp: true" in got["message"], got
    assert seen.authorizations == []
    got = node_send({"url": f"http://forkd:hunter2@{url[len('http://'):]}"})
    assert got["type"] == "InvalidInput" and "hunter2" not in got["message"], got
    assert seen.authorizations == []


def test_node_plain_http_is_the_callers_choice_or_this_hosts(server: tuple[int, Seen]) -> None:
    port, seen = server
    other = f"http://{this_hosts_other_address()}:{port}"
    for options in ({"url": other, "token": TOKEN, "plainHttp": True},
                    {"url": f"http://127.0.0.1:{port}", "token": TOKEN},
                    {"url": f"http://[::ffff:127.0.0.1]:{port}", "token": TOKEN}):
        got = node_send(options)
        assert got.get("type") == "NotFound", (options, got)
    assert seen.authorizations == [f"Bearer {TOKEN}".encode()] * 3


# -- the daemon's socket at its default place -----------------------------------------
NOBODY = 65534


@pytest.fixture
def planted(tmp_path: Path) -> Iterator[tuple[Path, Seen]]:
    """A FORKD_RUN another user (``nobody``) made, with a socket of theirs in it where the
    daemon's would be, answered by the recording server: what another local user leaves
    at /tmp/forkd-UID/forkd before forkd ever ran there."""
    if os.geteuid() != 0:
        pytest.skip("planting another user's directory needs root")
    run = tmp_path / "run"
    run.mkdir()
    seen = Seen()
    sock = run / "controller.sock"
    config = uvicorn.Config(recording_app(seen), uds=str(sock), log_level="warning",
                            lifespan="off")
    with running(uvicorn.Server(config)):
        os.chown(sock, NOBODY, NOBODY)
        os.chown(run, NOBODY, NOBODY)
        yield run, seen


def test_node_a_socket_another_user_planted_is_not_the_daemon(
        planted: tuple[Path, Seen]) -> None:
    run, seen = planted
    got = node_send({}, {"FORKD_RUN": str(run)})
    assert got.get("type") == "InvalidInput" and "owned by uid 65534" in got["message"], got
    assert seen.authorizations == []


def test_node_a_socket_in_a_directory_others_may_write_is_not_the_daemon(
        planted: tuple[Path, Seen]) -> None:
    run, seen = planted
    os.chown(run, os.geteuid(), os.getegid())
    os.chown(run / "controller.sock", os.geteuid(), os.getegid())
    run.chmod(0o777)  # anyone could have swapped the socket
    got = node_send({}, {"FORKD_RUN": str(run)})
    assert got.get("type") == "InvalidInput" and "writable by group" in got["message"], got
    assert seen.authorizations == []


def test_the_python_client_refuses_the_same_places(planted: tuple[Path, Seen],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    run, seen = planted
    monkeypatch.setenv("FORKD_RUN", str(run))
    with pytest.raises(InvalidInput, match="owned by uid 65534"):
        Controller(local=False).snapshots()
    assert seen.authorizations == []


def test_node_the_default_socket_of_ones_own_is_the_daemon(planted: tuple[Path, Seen]) -> None:
    run, seen = planted
    os.chown(run, os.geteuid(), os.getegid())
    os.chown(run / "controller.sock", os.geteuid(), os.getegid())
    run.chmod(0o700)
    got = node_send({}, {"FORKD_RUN": str(run)})
    assert got.get("type") == "NotFound", got
    assert seen.authorizations == [b""]
