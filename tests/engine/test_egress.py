"""The egress proxy, the secret store, the CA and the stand-in model server, on loopback.

No VM: a "guest" here is an httpx client that reaches the outside only through the proxy
and trusts only what a guest would trust (the proxy's CA for secret-bearing hosts).
Upstreams are stand-in servers on 127.0.0.1 with certificates from a separate test CA
that only the proxy trusts; names such as model.test are pinned to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import socket
import ssl
import stat
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from forkd.audit import AuditLog
from forkd.cli.main import cli
from forkd.engine import netns
from forkd.engine.egress import (
    EgressCA,
    EgressPolicy,
    EgressProxy,
    Secret,
    SecretStore,
    guest_environment,
    parse_destination,
)
from forkd.engine.egress.netns_listen import listen_in_netns
from forkd.engine.egress.proxy import ProxyLimits, StreamReplacer, new_event_loop
from forkd.engine.egress.secrets import PLACEHOLDER_RE
from forkd.engine.egress.standin import Answer, Plan, StandinModel, ToolCall
from forkd.errors import InvalidInput, NotFound

REAL = "sk-real-0123456789abcdef-REAL"
CHILD = "c-7f3a"


# -- fixtures --------------------------------------------------------------------------


class ProxyThread:
    """An EgressProxy served on 127.0.0.1 by an event loop in its own thread (the loop
    the proxy process runs on, serve.py's)."""

    def __init__(self, proxy: EgressProxy, sock: socket.socket | None = None) -> None:
        self.proxy = proxy
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        started = proxy.serve(sock) if sock is not None else proxy.start()
        self.server: asyncio.Server = self._run(started)
        self.port = int(self.server.sockets[0].getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, coro: Any) -> Any:
        future: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return future.result(10)

    def stop(self) -> None:
        async def close() -> None:
            self.server.close()
            await self.proxy.aclose()

        self._run(close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        if not self.thread.is_alive():
            self.loop.close()  # its epoll and wake-up pipe: the suite's descriptors add up


@pytest.fixture
def test_ca(tmp_path: Path) -> EgressCA:
    """The upstreams' CA (stands in for the public web PKI): only the proxy trusts it."""
    return EgressCA.load_or_create(tmp_path / "upstream-ca")


@pytest.fixture
def proxy_ca(tmp_path: Path) -> EgressCA:
    return EgressCA.load_or_create(tmp_path / "secrets" / "ca")


@pytest.fixture
def store(tmp_path: Path) -> SecretStore:
    return SecretStore(tmp_path / "secrets")


def trust(ca: EgressCA) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=ca.cert_pem.decode())


@pytest.fixture
def model(test_ca: EgressCA) -> Iterator[StandinModel]:
    """The model API: requires the real key, serves model.test's certificate."""
    with StandinModel(api_key=REAL, tls=test_ca.leaf_context("model.test")) as server:
        yield server


@pytest.fixture
def tools(test_ca: EgressCA) -> Iterator[StandinModel]:
    """Another HTTPS service, allowed but bound to no secret."""
    with StandinModel(tls=test_ca.leaf_context("tools.test")) as server:
        yield server


@pytest.fixture
def plain() -> Iterator[StandinModel]:
    with StandinModel() as server:
        yield server


@pytest.fixture
def audit_path(tmp_path: Path) -> Path:
    return tmp_path / "audit.log"


def audit_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def make_proxy(
    policy: list[str],
    audit_path: Path,
    secrets: list[Secret] | None = None,
    ca: EgressCA | None = None,
    upstream_ca: EgressCA | None = None,
    pins: bool = True,
    limits: ProxyLimits | None = None,
) -> ProxyThread:
    proxy = EgressProxy(
        EgressPolicy.parse(policy),
        secrets or [],
        AuditLog(audit_path),
        ca,
        child_id=CHILD,
        upstream_trust=trust(upstream_ca) if upstream_ca else None,
        hosts={"model.test": "127.0.0.1", "tools.test": "127.0.0.1", "plain.test": "127.0.0.1"}
        if pins
        else None,
        limits=limits,
    )
    return ProxyThread(proxy)


def guest(proxy: ProxyThread, verify: ssl.SSLContext | bool = True) -> httpx.Client:
    return httpx.Client(proxy=proxy.url, verify=verify, timeout=10, trust_env=False)


def chat(messages: list[dict[str, Any]] | None = None, stream: bool = False) -> dict[str, Any]:
    msgs = messages or [{"role": "user", "content": "Plan day one in Kyoto."}]
    return {"model": "standin", "messages": msgs, "stream": stream}


def raw_request(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


# -- policy ---------------------------------------------------------------------------


def test_policy_grammar_and_matching() -> None:
    policy = EgressPolicy.parse(
        ["API.OpenAI.com", "*.example.com:8443", "10.0.0.5:8000", "[2001:db8::1]"]
    )
    assert [str(e) for e in policy.entries] == [
        "10.0.0.5:8000",
        "[2001:db8::1]:443",
        "api.openai.com:443",
        "*.example.com:8443",
    ]
    assert policy.allowing(parse_destination("api.openai.com:443", wildcard_ok=False))
    assert policy.allowing(parse_destination("API.OPENAI.COM"))
    assert not policy.allowing(parse_destination("api.openai.com:80"))
    assert policy.allowing(parse_destination("a.example.com:8443"))
    assert not policy.allowing(parse_destination("example.com:8443"))  # one label, not zero
    assert not policy.allowing(parse_destination("a.b.example.com:8443"))  # nor two
    assert not policy.allowing(parse_destination("a.example.com"))  # port 443 ≠ 8443
    assert policy.allowing(parse_destination("10.0.0.5:8000"))
    assert policy.allowing(parse_destination("[2001:db8:0::1]:443"))  # canonical form
    assert not policy.allowing(parse_destination("10.0.0.6:8000"))
    assert not EgressPolicy.parse(["localhost"]).allowing(parse_destination("127.0.0.1"))
    assert not EgressPolicy.parse(["127.0.0.1"]).allowing(parse_destination("localhost"))
    assert not EgressPolicy().allowing(parse_destination("api.openai.com"))


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "api.openai.com.",  # trailing dot
        "bücher.de",  # IDNA: write xn--bcher-kva.de
        "xn--bcher-kva.de:0",
        "host:65536",
        "host:0443",
        "host:",
        "2130706433",  # a number a resolver would read as 127.0.0.1
        "0x7f.1",
        "127.1",
        "010.0.0.1",
        "1.2.3.4.5",
        "*.com",
        "*",
        "a.*.example.com",
        "-a.example.com",
        "a_b.example.com",
        "user@host",
        "host/path",
        "host\n",
        "host name",
        "::1",  # IPv6 needs brackets
        "[::1",
        "[fe80::1%eth0]",
        "a" * 64 + ".com",
        ".".join(["a" * 60] * 5),
    ],
)
def test_policy_refuses_bad_entries(bad: str) -> None:
    with pytest.raises(InvalidInput, match="invalid destination"):
        EgressPolicy.parse([bad])


# -- CONNECT and plain HTTP ------------------------------------------------------------


def test_allowed_connect_is_a_raw_tunnel(
    tools: StandinModel, test_ca: EgressCA, audit_path: Path
) -> None:
    proxy = make_proxy([f"tools.test:{tools.port}"], audit_path)
    try:
        # The client trusts only the upstream's CA: the proxy cannot have terminated TLS.
        with guest(proxy, verify=trust(test_ca)) as client:
            r = client.get(f"https://tools.test:{tools.port}/v1/models")
        assert r.status_code == 200
        assert r.json()["data"][0]["id"] == "standin"
    finally:
        proxy.stop()
    [entry] = audit_lines(audit_path)
    assert entry["action"] == "egress.connect" and entry["result"] == "ok"
    assert entry["child"] == CHILD and entry["actor"] == CHILD
    assert entry["target"] == f"tools.test:{tools.port}" and entry["tls"] == "tunnel"


def test_denied_connect_is_refused_and_audited(
    tools: StandinModel, test_ca: EgressCA, audit_path: Path
) -> None:
    proxy = make_proxy([f"tools.test:{tools.port}"], audit_path)
    try:
        with guest(proxy, verify=trust(test_ca)) as client:
            with pytest.raises(httpx.ProxyError, match="403"):
                client.get(f"https://model.test:{tools.port}/")
            with pytest.raises(httpx.ProxyError, match="403"):
                client.get(f"https://127.0.0.1:{tools.port}/")  # an address, not the name
            with pytest.raises(httpx.ProxyError, match="403"):
                client.get(f"https://tools.test:{tools.port + 1}/")  # another port
        reply = raw_request(
            proxy.port,
            b"CONNECT attacker.example:443 HTTP/1.1\r\nHost: attacker.example:443\r\n\r\n",
        )
        assert reply.startswith(b"HTTP/1.1 403 ")
        assert b"not in this child's egress policy" in reply
        reply = raw_request(proxy.port, b"CONNECT *.tools.test:443 HTTP/1.1\r\nHost: x\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 400 ")
    finally:
        proxy.stop()
    denied = [e for e in audit_lines(audit_path) if e["result"] == "denied"]
    assert [e["target"] for e in denied] == [
        f"model.test:{tools.port}",
        f"127.0.0.1:{tools.port}",
        f"tools.test:{tools.port + 1}",
        "attacker.example:443",
        "*.tools.test:443",
    ]
    assert all(e["child"] == CHILD and e["action"] == "egress.connect" for e in denied)
    assert tools.requests == []  # nothing reached the upstream


def test_plain_http_allow_and_deny(plain: StandinModel, audit_path: Path) -> None:
    proxy = make_proxy([f"plain.test:{plain.port}"], audit_path)
    try:
        with guest(proxy) as client:
            r = client.get(f"http://plain.test:{plain.port}/v1/models")
            assert r.status_code == 200 and r.json()["object"] == "list"
            r = client.get(f"http://model.test:{plain.port}/v1/models")
            assert r.status_code == 403
        # origin-form (not a proxy request), https:// without CONNECT, Host mismatch
        assert raw_request(proxy.port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(
            b"HTTP/1.1 400 "
        )
        https = f"GET https://plain.test:{plain.port}/ HTTP/1.1\r\nHost: x\r\n\r\n".encode()
        assert raw_request(proxy.port, https).startswith(b"HTTP/1.1 400 ")
        smuggle = (
            f"GET http://plain.test:{plain.port}/ HTTP/1.1\r\nHost: attacker.example\r\n\r\n"
        ).encode()
        assert raw_request(proxy.port, smuggle).startswith(b"HTTP/1.1 400 ")
    finally:
        proxy.stop()
    assert [r.path for r in plain.requests] == ["/v1/models"]
    entries = audit_lines(audit_path)
    assert [(e["action"], e["result"]) for e in entries[:2]] == [
        ("egress.http", "ok"),
        ("egress.http", "denied"),
    ]
    assert all(e["child"] == CHILD for e in entries)


def test_a_name_resolving_to_loopback_is_not_used(plain: StandinModel, audit_path: Path) -> None:
    proxy = make_proxy([f"localhost:{plain.port}"], audit_path, pins=False)
    try:
        with guest(proxy) as client:
            r = client.get(f"http://localhost:{plain.port}/v1/models")
        assert r.status_code == 502 and b"loopback" in r.content
    finally:
        proxy.stop()
    assert plain.requests == []
    assert audit_lines(audit_path)[-1]["result"] == "failed"


@pytest.mark.parametrize("address", [
    "127.0.0.1", "::1", "0.0.0.0", "::", "169.254.169.254", "fd00:ec2::254", "fe80::1",
    "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.100.100.200", "168.63.129.16",
    "192.0.0.170", "224.0.0.1", "ff02::1", "fd12:3456::1",
    "::ffff:127.0.0.1", "2002:7f00:1::", "64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "::7f00:1",
])
def test_a_name_never_leads_to_an_address_that_is_not_global(address: str) -> None:
    """Loopback, metadata, private, shared, reserved and multicast addresses, bare or
    wrapped in IPv6 (mapped, 6to4, NAT64, compatible): a name resolving to one is refused."""
    from forkd.addresses import public_enough as _public_enough

    assert not _public_enough(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700::1111", "64:ff9b::808:808"])
def test_a_name_may_lead_to_a_global_address(address: str) -> None:
    from forkd.addresses import public_enough as _public_enough

    assert _public_enough(address)


def test_audit_records_are_bounded(audit_path: Path) -> None:
    proxy = make_proxy(["tools.test"], audit_path, limits=ProxyLimits(audit_per_minute=3))
    try:
        long_name = "a" * 60 + "." + "b" * 60 + "." + "c" * 60 + "." + "d" * 60 + ".example"
        for _ in range(6):
            raw_request(proxy.port, f"CONNECT {long_name}:1 HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    finally:
        proxy.stop()
    entries = audit_lines(audit_path)
    assert len(entries) == 3 and all(e["result"] == "denied" for e in entries)
    assert proxy.proxy._audit is not None
    assert proxy.proxy._audit._window[2] == 3  # counted, written as egress.suppressed later


def test_pins_must_be_addresses() -> None:
    with pytest.raises(InvalidInput, match="not an IP address"):
        EgressProxy(EgressPolicy(), hosts={"model.test": "evil.example"})


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="network namespaces need root"
)
def test_proxy_listening_inside_a_netns_reaches_out_from_the_host(
    plain: StandinModel, audit_path: Path
) -> None:
    name = f"egresstest-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        sock = listen_in_netns(name, "127.0.0.1", 3128)
        policy = EgressPolicy.parse([f"plain.test:{plain.port}"])
        proxy = ProxyThread(
            EgressProxy(
                policy,
                audit=AuditLog(audit_path),
                child_id=CHILD,
                hosts={"plain.test": "127.0.0.1"},
            ),
            sock,
        )
        results: dict[str, Any] = {}

        def inside() -> None:  # the "guest": a thread in the namespace
            with netns.entered(name):
                try:
                    socket.create_connection(("127.0.0.1", plain.port), timeout=2).close()
                    results["direct"] = "connected"
                except OSError as exc:
                    results["direct"] = type(exc).__name__
                client = httpx.Client(proxy="http://127.0.0.1:3128", timeout=10, trust_env=False)
                with client:
                    results["allowed"] = client.get(
                        f"http://plain.test:{plain.port}/v1/models"
                    ).status_code
                    results["denied"] = client.get(f"http://tools.test:{plain.port}/").status_code

        try:
            t = threading.Thread(target=inside)
            t.start()
            t.join(30)
        finally:
            proxy.stop()
            sock.close()
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=True)
    assert results == {"direct": "ConnectionRefusedError", "allowed": 200, "denied": 403}
    assert [r.path for r in plain.requests] == ["/v1/models"]


def test_connection_limit(plain: StandinModel, audit_path: Path) -> None:
    proxy = make_proxy(
        [f"plain.test:{plain.port}"], audit_path, limits=ProxyLimits(max_connections=1)
    )
    try:
        held = socket.create_connection(("127.0.0.1", proxy.port))
        try:
            reply = raw_request(proxy.port, b"CONNECT plain.test:1 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert reply.startswith(b"HTTP/1.1 503 ")
        finally:
            held.close()
    finally:
        proxy.stop()


# -- secrets through the proxy ---------------------------------------------------------


@pytest.fixture
def bound(store: SecretStore, model: StandinModel) -> Secret:
    return store.set("OPENAI_API_KEY", REAL, [f"model.test:{model.port}"])


def test_placeholder_is_swapped_for_the_secret_only_at_the_bound_destination(
    bound: Secret,
    model: StandinModel,
    tools: StandinModel,
    proxy_ca: EgressCA,
    test_ca: EgressCA,
    audit_path: Path,
) -> None:
    env = guest_environment([bound])
    placeholder = env["OPENAI_API_KEY"]
    assert REAL not in placeholder and PLACEHOLDER_RE.fullmatch(placeholder)
    headers = {"Authorization": f"Bearer {placeholder}"}
    proxy = make_proxy(
        [f"model.test:{model.port}", f"tools.test:{tools.port}"],
        audit_path,
        [bound],
        proxy_ca,
        test_ca,
    )
    try:
        # The guest trusts only the proxy's CA for the bound host.
        with guest(proxy, verify=trust(proxy_ca)) as client:
            url = f"https://model.test:{model.port}/v1/chat/completions"
            first = client.post(url, json=chat(), headers=headers)
            second = client.post(url, json=chat(stream=True), headers=headers)  # keep-alive
        with guest(proxy, verify=trust(test_ca)) as client:  # raw tunnel: upstream's CA
            unbound = client.post(
                f"https://tools.test:{tools.port}/v1/chat/completions", json=chat(), headers=headers
            )
    finally:
        proxy.stop()
    assert first.status_code == 200, first.text
    assert first.json()["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "attractions", "arguments": '{"city": "Kyoto"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
    ]
    assert second.status_code == 200 and second.text.endswith("data: [DONE]\n\n")
    got = [r.headers["authorization"] for r in model.completions()]
    assert got == [f"Bearer {REAL}", f"Bearer {REAL}"]
    assert all(r.headers["accept-encoding"] == "identity" for r in model.completions())
    assert {r.headers["host"] for r in model.completions()} == {f"model.test:{model.port}"}
    assert REAL not in first.text + second.text
    # allowed but unbound: the placeholder arrives as it was sent
    assert unbound.status_code == 200
    assert [r.headers["authorization"] for r in tools.completions()] == [f"Bearer {placeholder}"]
    terminated = [e for e in audit_lines(audit_path) if e.get("tls") == "terminated"]
    assert terminated and terminated[0]["secrets"] == ["OPENAI_API_KEY"]
    assert REAL not in audit_path.read_text()


def test_a_reflected_secret_comes_back_as_the_placeholder(
    store: SecretStore, test_ca: EgressCA, proxy_ca: EgressCA, audit_path: Path
) -> None:
    # This upstream expects another key and quotes the one it got in its 401.
    with StandinModel(
        api_key="sk-another-key-entirely", tls=test_ca.leaf_context("model.test")
    ) as m:
        secret = store.set("OPENAI_API_KEY", REAL, [f"model.test:{m.port}"])
        proxy = make_proxy([f"model.test:{m.port}"], audit_path, [secret], proxy_ca, test_ca)
        try:
            with guest(proxy, verify=trust(proxy_ca)) as client:
                r = client.post(
                    f"https://model.test:{m.port}/v1/chat/completions",
                    json=chat(),
                    headers={
                        "Authorization": f"Bearer {secret.placeholder}",
                        "X-Echo": secret.placeholder,
                    },
                )
        finally:
            proxy.stop()
        assert m.completions()[0].headers["authorization"] == f"Bearer {REAL}"
    assert r.status_code == 401
    assert REAL not in r.text and secret.placeholder in r.json()["error"]["message"]


def test_a_terminated_connection_serves_only_its_connect_host(
    bound: Secret,
    model: StandinModel,
    tools: StandinModel,
    proxy_ca: EgressCA,
    test_ca: EgressCA,
    audit_path: Path,
) -> None:
    proxy = make_proxy(
        [f"model.test:{model.port}", f"tools.test:{tools.port}"],
        audit_path,
        [bound],
        proxy_ca,
        test_ca,
    )
    try:
        with guest(proxy, verify=trust(proxy_ca)) as client:
            r = client.get(
                f"https://model.test:{model.port}/v1/models",
                headers={
                    "Host": f"tools.test:{tools.port}",
                    "Authorization": f"Bearer {bound.placeholder}",
                },
            )
    finally:
        proxy.stop()
    assert r.status_code == 421
    assert model.requests == [] and tools.requests == []
    assert audit_lines(audit_path)[-1]["result"] == "denied"


def test_a_second_host_header_is_refused(
    bound: Secret, model: StandinModel, proxy_ca: EgressCA, test_ca: EgressCA, audit_path: Path
) -> None:
    proxy = make_proxy([f"model.test:{model.port}"], audit_path, [bound], proxy_ca, test_ca)
    try:
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as raw:
            authority = f"model.test:{model.port}"
            raw.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
            assert raw.recv(4096).startswith(b"HTTP/1.1 200 ")
            with trust(proxy_ca).wrap_socket(raw, server_hostname="model.test") as tls:
                tls.sendall(
                    f"GET /v1/models HTTP/1.1\r\nHost: {authority}\r\nHost: evil.example\r\n"
                    f"Authorization: Bearer {bound.placeholder}\r\n\r\n".encode()
                )
                reply = tls.recv(4096)
    finally:
        proxy.stop()
    assert reply.startswith(b"HTTP/1.1 400 ") and b"Host" in reply  # h11's check and ours
    assert model.requests == []


def test_an_untrusted_upstream_gets_no_secret(
    bound: Secret, model: StandinModel, proxy_ca: EgressCA, audit_path: Path
) -> None:
    # The proxy trusts the system store here, which does not know the test CA.
    proxy = make_proxy([f"model.test:{model.port}"], audit_path, [bound], proxy_ca)
    try:
        with guest(proxy, verify=trust(proxy_ca)) as client, pytest.raises(httpx.ProxyError):
            client.get(f"https://model.test:{model.port}/v1/models")
    finally:
        proxy.stop()
    assert model.requests == []
    assert "certificate" in audit_lines(audit_path)[-1]["reason"]


def test_stream_replacer_across_every_split() -> None:
    old, new = b"SECRET-VALUE", b"placeholder-longer-than-it"
    text = b"a SECRET-VALUE b SECRET-VALUESECRET-VALUE c SECRET-VALU"
    want = text.replace(old, new)
    rng = random.Random(5)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, 12)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        r = StreamReplacer(old, new)
        assert b"".join(r.feed(p) for p in pieces) + r.flush() == want


# -- the secret store and `forkd secret` -------------------------------------------------


def test_secret_files_are_private(store: SecretStore) -> None:
    secret = store.set("OPENAI_API_KEY", REAL, ["api.openai.com", "api.openai.com:443"])
    path = store.root / "OPENAI_API_KEY.json"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(store.root).st_mode) == 0o700
    assert [str(b) for b in secret.bindings] == ["api.openai.com:443"]
    assert REAL not in repr(secret)
    replaced = store.set("OPENAI_API_KEY", REAL + "-2", ["api.openai.com"])
    assert replaced.placeholder == secret.placeholder  # rotation keeps the guest's env valid
    assert store.get("OPENAI_API_KEY").value == REAL + "-2"
    assert sorted(os.listdir(store.root)) == ["OPENAI_API_KEY.json"]
    os.chmod(path, 0o644)
    with pytest.raises(InvalidInput, match="chmod 600"):
        store.get("OPENAI_API_KEY")
    os.unlink(path)
    os.symlink("/etc/hostname", path)
    with pytest.raises(InvalidInput, match="symlink"):
        store.get("OPENAI_API_KEY")
    store.remove("OPENAI_API_KEY")
    with pytest.raises(NotFound):
        store.remove("OPENAI_API_KEY")


def test_ca_key_is_private_and_kept(tmp_path: Path) -> None:
    ca = EgressCA.load_or_create(tmp_path / "ca")
    assert stat.S_IMODE(os.stat(tmp_path / "ca" / "ca-key.pem").st_mode) == 0o600
    assert b"PRIVATE" not in ca.cert_pem
    again = EgressCA.load_or_create(tmp_path / "ca")
    assert again.cert_pem == ca.cert_pem


@pytest.mark.parametrize(
    ("name", "value", "bindings", "match"),
    [
        ("../x", REAL, ["api.openai.com"], "invalid secret name"),
        ("1KEY", REAL, ["api.openai.com"], "invalid secret name"),
        ("KEY-DASH", REAL, ["api.openai.com"], "invalid secret name"),
        ("K" * 65, REAL, ["api.openai.com"], "invalid secret name"),
        ("KEY", "short", ["api.openai.com"], "8 to 4096"),
        ("KEY", "x" * 4097, ["api.openai.com"], "8 to 4096"),
        ("KEY", "sk-abc\r\nX-Evil: 1", ["api.openai.com"], "control characters"),
        ("KEY", "sk-abcdefgh\x00", ["api.openai.com"], "control characters"),
        ("KEY", " sk-abcdefgh", ["api.openai.com"], "control characters"),
        ("KEY", "sk-ключ-abcdef", ["api.openai.com"], "control characters"),
        ("KEY", REAL, [], "at least one destination"),
        ("KEY", REAL, ["*.openai.com"], "wildcard is not allowed"),
        ("KEY", REAL, ["api.openai.com:99999"], "invalid destination"),
        ("KEY", REAL, ["api.openai.com/v1"], "invalid destination"),
    ],
)
def test_bad_secrets_are_refused(
    store: SecretStore, name: str, value: str, bindings: list[str], match: str
) -> None:
    with pytest.raises(InvalidInput, match=match):
        store.set(name, value, bindings)
    assert os.listdir(store.root) == []


def test_secret_cli_never_prints_values(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_SECRETS", str(tmp_path / "s"))
    runner = CliRunner()
    out = runner.invoke(
        cli, ["secret", "set", "OPENAI_API_KEY", "--bind", "api.openai.com"], input=REAL + "\n"
    )
    assert out.exit_code == 0, out.output
    assert REAL not in out.output and "forkd-secret-placeholder-OPENAI_API_KEY-" in out.output
    assert SecretStore(tmp_path / "s").get("OPENAI_API_KEY").value == REAL  # newline dropped
    for args in (["secret", "ls"], ["secret", "ls", "--json"]):
        out = runner.invoke(cli, args)
        assert out.exit_code == 0 and "OPENAI_API_KEY" in out.output
        assert REAL not in out.output
    shown = json.loads(runner.invoke(cli, ["secret", "ls", "--json"]).output)
    assert shown[0]["bindings"] == ["api.openai.com:443"] and "value" not in shown[0]
    bad = runner.invoke(cli, ["secret", "set", "bad/name", "--bind", "x.com"], input=REAL)
    assert bad.exit_code == 2 and "invalid secret name" in bad.output
    bad = runner.invoke(cli, ["secret", "set", "K", "--bind", "bücher.de"], input=REAL)
    assert bad.exit_code == 2 and "xn--" in bad.output
    assert runner.invoke(cli, ["secret", "rm", "OPENAI_API_KEY"]).exit_code == 0
    assert runner.invoke(cli, ["secret", "rm", "OPENAI_API_KEY"]).exit_code == 3


# -- the stand-in model server ----------------------------------------------------------


def test_standin_follows_its_plan_and_the_steering_hint() -> None:
    plan = Plan(
        steps=(ToolCall("weather", {"city": "Kyoto"}), Answer("base plan: {last_tool}")),
        variants={"budget": (Answer("cheap plan"),), "minimalist": (Answer("tiny plan"),)},
    )
    history: list[dict[str, Any]] = [{"role": "user", "content": "plan a day"}]
    with StandinModel(plan) as m, httpx.Client(base_url=m.url) as client:
        first = client.post("/v1/chat/completions", json=chat(history)).json()
        call = first["choices"][0]["message"]["tool_calls"][0]
        assert call["function"]["name"] == "weather"
        history += [
            first["choices"][0]["message"],
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny"},
        ]
        base = client.post("/v1/chat/completions", json=chat(history)).json()
        assert base["choices"][0]["message"]["content"] == "base plan: sunny"
        steered = {
            hint: client.post(
                "/v1/chat/completions",
                json=chat([*history, {"role": "user", "content": f"Steering hint: {hint}"}]),
            ).json()["choices"][0]["message"]["content"]
            for hint in ("budget", "minimalist")
        }
        assert steered == {"budget": "cheap plan", "minimalist": "tiny plan"}
        assert len(m.completions()) == 4
