"""The egress proxy against the fourth review: what a policy a client or a snapshot names
may reach, and use. No VM.

A name was kept from this host and its cloud (round 3: loopback, link-local, this host's
own addresses are never used for a name), but an IP literal entry was used as it was:
a client of the daemon (a spawn's ``egress``), or a recipe (``[guest] egress``, in a pack
pulled from a hub), naming ``127.0.0.1:7070``, ``[::ffff:127.0.0.1]:5432``,
``0.0.0.0:22``, ``169.254.169.254:80`` or the host's own public address let the guest
reach, through its proxy (which connects from the host), the daemon's and the hub's
ports, the host's databases and the cloud's metadata service with the host's
credentials. Such an entry is now refused where a policy is admitted
(egress.child.parse_policy: a spawn, `forkd fork --egress`, a recipe), with a message
saying why and how an operator lets sandboxes reach a service of this host on purpose
(a pinned name, FORKD_EGRESS_PINS). An address of another host (a LAN's ``10.0.0.5``,
a global one) is allowed as before.

A snapshot's recipe (``[guest] egress``, the default of forks that name none) bound every
secret of the host to the destinations it named: a pack pulled from a hub is anyone's,
and its recipe naming ``api.openai.com`` made the host's key usable by that guest (the
account's files and models read with it, and sent on to a second host the recipe
names). A recipe's egress now gives its destinations only; the real proxy process started
with those settings puts no value in (before: the upstream got the host's value).

A reply echoing the key was scrubbed in its raw, JSON and percent-encoded spellings only:
Go's encoding/json (``\\u003c`` ``\\u003e`` ``\\u0026``), a form's ``+`` for a space and
an HTML error page's entities reached the guest as the value; they are scrubbed too.

The real daemon app (Litestar, LocalBackend on a real store; every spawn here is refused
before a VM would be reached), the engine's fork, the recipe parser, and the real proxy
process in a network namespace (root) with a stand-in TLS model upstream.
"""

from __future__ import annotations

import json
import secrets
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar.testing import TestClient
from test_egress import audit_path, proxy_ca, store, test_ca
from test_egress_review import assert_spellings_scrubbed
from test_egress_serve import CHAT

from forkd.audit import AuditLog
from forkd.controller.app import ControllerMetrics, create_app
from forkd.controller.backend import LocalBackend
from forkd.engine import children as ch
from forkd.engine import netns, recipe
from forkd.engine.egress import EgressCA, SecretStore
from forkd.engine.egress.child import (
    PROXY_URL,
    EgressSettings,
    proxy_argv,
    start_proxy,
    stop_proxy,
    wait_ready,
)
from forkd.engine.egress.standin import StandinModel
from forkd.errors import InvalidInput
from forkd.pack.config import SnapshotConfig
from forkd.store.assembly import Assembled
from forkd.store.store import Store

__all__ = ["audit_path", "proxy_ca", "store", "test_ca"]  # fixtures, used by name


def this_hosts_other_address() -> str | None:
    """This host's address on its default route (not loopback), if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("203.0.113.1", 9))  # nothing is sent: the route is only looked up
        except OSError:
            return None
        address = str(probe.getsockname()[0])
    return None if address.startswith("127.") else address


HOSTS_OWN = [
    "127.0.0.1:7070",  # the daemon's --listen, the hub, anything on loopback
    "127.9.9.9:5432",
    "[::1]:7071",
    "[::ffff:127.0.0.1]:5432",  # loopback wrapped in IPv6
    "0.0.0.0:22",  # a connection to 0.0.0.0 reaches loopback
    "169.254.169.254:80",  # the cloud's metadata service: the host's credentials
    "[fd00:ec2::254]:80",
    "100.100.100.200:80",
    "168.63.129.16:80",
]
OTHERS = ["10.0.0.5:8000", "192.168.1.20:8080", "8.8.8.8:443", "api.openai.com", "localhost:80"]


@pytest.fixture
def secrets_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FORKD_SECRETS", str(tmp_path / "secrets"))
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    return tmp_path / "secrets"


@pytest.fixture
def http(secrets_dir: Path, tmp_path: Path) -> Iterator[TestClient[Any]]:
    app = create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "audit.log"),
                     ControllerMetrics(), None)
    with TestClient(app) as client:
        yield client


def own_entries() -> list[str]:
    own = this_hosts_other_address()
    return [*HOSTS_OWN, *([f"{own}:80"] if own else [])]


def test_a_spawn_naming_this_host_is_refused_before_any_vm(http: TestClient[Any]) -> None:
    for entry in own_entries():
        answer = http.post("/v1/sandboxes", json={"tag": "ghost", "egress": [entry]})
        assert answer.status_code == 400, (entry, answer.text)
        error = answer.json()["error"]
        assert error["type"] == "InvalidInput" and "FORKD_EGRESS_PINS" in error["message"], error


def test_a_spawn_naming_another_host_goes_on(http: TestClient[Any]) -> None:
    for entry in OTHERS:  # past the policy: the tag is what is missing
        answer = http.post("/v1/sandboxes", json={"tag": "ghost", "egress": [entry]})
        assert answer.status_code == 404, (entry, answer.text)


def test_the_engine_and_a_recipe_refuse_an_entry_reaching_this_host(secrets_dir: Path) -> None:
    base = '[recipe]\nname = "r"\n[guest]\nnetwork = true\n'
    for entry in own_entries():
        with pytest.raises(InvalidInput, match="reaches"):
            ch.fork(Store.open(), "ghost", 1, egress=[entry])
        with pytest.raises(InvalidInput, match="reaches"):
            recipe.parse(base + f'egress = ["{entry}"]\n')
    for entry in OTHERS:
        assert EgressSettings.resolve([entry], env={}).allow
        assert recipe.parse(base + f'egress = ["{entry}"]\n').egress


# -- a recipe's egress binds none of the host's secrets ---------------------------------
def recipe_snapshot(entries: list[str]) -> Assembled:
    """A snapshot's images as a fork sees them, its recipe naming ``entries`` as egress (a
    pack pulled from a hub carries the recipe of whoever built it)."""
    config = SnapshotConfig(tag="hub.example/someone/agent:latest", parent_tag=None,
                            parent_digest=None, depth=0, memory_size=1 << 20,
                            disk_size=None, page_size=4096, compat=None,
                            created_at="2026-01-01T00:00:00Z",
                            recipe={"name": "agent", "egress": entries})
    return Assembled("sha256:" + "0" * 64, config, Path("/nonexistent"), None, None)


def test_a_recipes_egress_binds_none_of_the_hosts_secrets(secrets_dir: Path) -> None:
    key = SecretStore(secrets_dir).set("OPENAI_API_KEY", "sk-host-" + "k" * 24,
                                       ["api.openai.com"])
    settings = ch.recipe_egress(recipe_snapshot(["api.openai.com", "exfil.example"]))
    assert settings is not None and settings.allow == ("api.openai.com:443", "exfil.example:443")
    assert settings.bound_secrets() == []
    assert EgressSettings.from_record(settings.record()).bound_secrets() == []  # a resume
    assert "--secrets" not in proxy_argv(settings, "c1", "forkd-x", secrets_dir)
    named = EgressSettings.resolve(["api.openai.com"], env={})  # the caller named it
    assert [s.name for s in named.bound_secrets()] == [key.name]
    assert "--secrets" in proxy_argv(named, "c1", "forkd-x", secrets_dir)


@pytest.fixture
def namespace() -> Iterator[str]:
    why = netns.available()
    if why:
        pytest.skip(why)
    name = f"{netns.PREFIX}egrev4-{secrets.token_hex(3)}"
    netns.create(name)
    try:
        yield name
    finally:
        netns.remove(name)


def test_the_proxy_of_a_recipes_egress_never_puts_the_secret_in(
        tmp_path: Path, secrets_dir: Path, namespace: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The real proxy process, started with the settings a fork with the recipe's default
    egress gets: a request with the placeholder reaches the upstream as the placeholder
    (the guest's TLS goes through the tunnel end to end), never as the host's value. The
    guest trusts the forkd egress CA too, so a terminating proxy would be answered."""
    upstream_ca = EgressCA.load_or_create(tmp_path / "upstream-ca")
    (tmp_path / "upstream.pem").write_bytes(upstream_ca.cert_pem)
    value = "sk-host-" + secrets.token_hex(12)
    with StandinModel(tls=upstream_ca.leaf_context("model.test")) as model:
        dest = f"model.test:{model.port}"
        secret = SecretStore(secrets_dir).set("OPENAI_API_KEY", value, [dest])
        monkeypatch.setenv("FORKD_EGRESS_AUDIT", str(tmp_path / "audit.log"))
        monkeypatch.setenv("FORKD_EGRESS_UPSTREAM_CA", str(tmp_path / "upstream.pem"))
        monkeypatch.setenv("FORKD_EGRESS_PINS", "model.test=127.0.0.1")
        settings = ch.recipe_egress(recipe_snapshot([dest]))
        assert settings is not None
        forkd_ca = EgressCA.load_or_create(secrets_dir / "ca")
        d = tmp_path / "child"
        d.mkdir()
        pid = start_proxy(settings, "egrev4", namespace, d)
        try:
            wait_ready(pid, d)
            trusted = ssl.create_default_context(
                cadata=(upstream_ca.cert_pem + forkd_ca.cert_pem).decode())
            with netns.entered(namespace), httpx.Client(
                    proxy=PROXY_URL, verify=trusted, trust_env=False, timeout=30) as client:
                r = client.post(f"https://{dest}/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"Bearer {secret.placeholder}"})
            assert r.status_code == 200
        finally:
            stop_proxy(pid, d)
        seen = [q.headers["authorization"] for q in model.completions()]
        assert seen == [f"Bearer {secret.placeholder}"], seen
        assert value not in json.dumps(seen)


# -- the spellings of a value an upstream may echo ---------------------------------------
MARKUP = "sk-a<b>c&d e'f\"g-0123456789"  # what Go's JSON, a form and HTML each escape


def test_the_go_form_and_html_spellings_of_a_value_are_scrubbed(
    test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    """An upstream that echoes the key in an error: Go's encoding/json (most gateways)
    writes ``<`` ``>`` ``&`` as ``\\u003c`` ``\\u003e`` ``\\u0026``, a form writes a
    space as ``+``, an HTML error page writes ``&lt;`` ``&amp;`` ``&#x27;``: each reached
    the guest as the value, which a branch of the sandbox then carried to a hub."""
    assert_spellings_scrubbed(test_ca, proxy_ca, store, audit_path, MARKUP, [
        'sk-a\\u003cb\\u003ec\\u0026d e\'f\\"g-0123456789',  # Go's encoding/json
        "sk-a%3Cb%3Ec%26d+e%27f%22g-0123456789",  # a form (application/x-www-form-urlencoded)
        "sk-a%3cb%3ec%26d+e%27f%22g-0123456789",  # the same, lower-case hex
        "sk-a&lt;b&gt;c&amp;d e&#x27;f&quot;g-0123456789",  # HTML
    ], status=401, in_reason=1, in_header=0)
