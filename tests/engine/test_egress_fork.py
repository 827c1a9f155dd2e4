"""Egress wired into `forkd fork` (real VMs under TCG): default deny, the per-child proxy on
the host side of the child's namespace, the guest's CA and placeholder environment, and
the real secret never anywhere in a guest (RAM read from the host, disk, a branch of it,
a fork of that branch).

The upstream is the stand-in model server on a random 127.x.y.z:443 with a certificate
for api.openai.com from a test CA that only the proxy trusts (FORKD_EGRESS_UPSTREAM_CA);
FORKD_EGRESS_PINS points api.openai.com and plain.test at that address. The guest's client
is Python's urllib with its default https:// URL, configured only by the environment
forkd gives it.
"""

from __future__ import annotations

import json
import os
import random
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forkd.engine.egress import EgressCA, SecretStore
from forkd.engine.egress.child import EgressSettings, parse_pins, proxy_matches
from forkd.engine.egress.standin import StandinModel
from forkd.engine.qemu import pid_alive
from forkd.errors import InvalidInput
from forkd.store.store import Store

REAL = f"sk-forkd-test-{secrets.token_hex(24)}"
NEEDLES = (REAL.encode(), REAL[: len(REAL) // 2].encode(), REAL[len(REAL) // 2 :].encode())
POLICY = ["api.openai.com", "plain.test:80"]

GUEST_ROUND_TRIP = r"""
import json, os, socket, urllib.error, urllib.request
out = {"env": {k: os.environ.get(k) for k in ("OPENAI_API_KEY", "HTTPS_PROXY", "SSL_CERT_FILE")}}
key = os.environ["OPENAI_API_KEY"]
body = json.dumps({"model": "standin",
                   "messages": [{"role": "user", "content": "Plan day one in Kyoto."}]}).encode()
req = urllib.request.Request("https://api.openai.com/v1/chat/completions", data=body,
                             headers={"Authorization": "Bearer " + key,
                                      "Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    out["chat"] = json.loads(r.read())
req = urllib.request.Request("http://plain.test/echo", headers={"Authorization": "Bearer " + key})
try:
    urllib.request.urlopen(req, timeout=120)
except urllib.error.HTTPError as e:
    out["plain"] = e.code
try:
    urllib.request.urlopen("https://evil.example/", timeout=120)
    out["evil"] = "reached"
except Exception as e:
    out["evil"] = repr(e)
try:
    socket.getaddrinfo("api.openai.com", 443)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = repr(e)
s = socket.socket()
s.settimeout(30)
try:  # around the proxy, straight to an address
    s.connect(("1.1.1.1", 443))
    s.sendall(b"GET / HTTP/1.0\r\n\r\n")
    out["direct"] = "answered: %r" % s.recv(100) if s.recv(1, socket.MSG_PEEK) else "closed"
except OSError as e:
    out["direct"] = repr(e)
finally:
    s.close()
print(json.dumps(out))
"""

GUEST_NO_NETWORK = r"""
import json, os, socket
out = {"proxy_env": os.environ.get("HTTPS_PROXY")}
for name, addr in (("proxy", ("10.200.0.1", 3128)), ("outside", ("1.1.1.1", 443))):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect(addr)
        out[name] = "connected"
    except OSError as e:
        out[name] = repr(e)
    finally:
        s.close()
try:
    socket.getaddrinfo("example.com", 443)
    out["dns"] = "resolved"
except OSError as e:
    out["dns"] = repr(e)
print(json.dumps(out))
"""


# -- no VM ------------------------------------------------------------------------------


def test_egress_settings_are_validated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_SECRETS", str(tmp_path / "secrets"))
    s = EgressSettings.resolve(["API.openai.com", "plain.test:80"], env={})
    assert s.allow == ("api.openai.com:443", "plain.test:80")
    assert EgressSettings.from_record(s.record()) == s
    for bad in ("api.openai.com", [""], ["*.com"], ["a.example:0"], [], [1]):
        with pytest.raises(InvalidInput):
            EgressSettings.resolve(bad, env={})  # type: ignore[arg-type]
    assert parse_pins("api.openai.com=127.0.0.9, b.test=::1") == (
        ("api.openai.com", "127.0.0.9"), ("b.test", "::1"))
    for bad_pin in ("api.openai.com", "api.openai.com=localhost", "1.2.3.4=1.2.3.4"):
        with pytest.raises(InvalidInput):
            parse_pins(bad_pin)
    with pytest.raises(InvalidInput, match="UPSTREAM_CA"):
        EgressSettings.resolve(POLICY, env={"FORKD_EGRESS_UPSTREAM_CA": str(tmp_path / "no")})


def test_recipe_egress_key() -> None:
    from forkd.engine import recipe

    base = '[recipe]\nname = "r"\n[guest]\n'
    r = recipe.parse(base + 'network = true\negress = ["API.openai.com", "pypi.org:80"]\n')
    assert r.egress == ("api.openai.com:443", "pypi.org:80")
    assert r.to_dict()["egress"] == ["api.openai.com:443", "pypi.org:80"]
    plain = recipe.parse(base + "network = true\n")
    assert "egress" not in plain.to_dict()  # build cache keys of recipes without it stay
    with pytest.raises(InvalidInput, match="network = true"):
        recipe.parse(base + 'egress = ["api.openai.com"]\n')
    with pytest.raises(InvalidInput, match="egress"):
        recipe.parse(base + 'network = true\negress = ["*.com"]\n')
    with pytest.raises(InvalidInput, match="egress"):
        recipe.parse(base + 'network = true\negress = "api.openai.com"\n')


def test_fork_cli_egress_flags_reach_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--egress goes through the backend and the REST body type to children.fork, which
    checks it before it touches the snapshot; --egress with --no-egress is refused."""
    from click.testing import CliRunner

    from forkd.cli.main import cli

    for k, v in {"FORKD_HOME": tmp_path / "home", "FORKD_RUN": tmp_path / "run",
                 "FORKD_SECRETS": tmp_path / "secrets"}.items():
        monkeypatch.setenv(k, str(v))
    runner = CliRunner()
    out = runner.invoke(cli, ["fork", "nothing:here", "--egress", "*.com"])
    assert out.exit_code != 0 and "wildcard needs at least two labels" in out.output, out.output
    out = runner.invoke(cli, ["fork", "nothing:here", "--egress", "a.example", "--no-egress"])
    assert out.exit_code != 0 and "not both" in out.output, out.output
    out = runner.invoke(cli, ["fork", "nothing:here", "--egress", "api.openai.com"])
    assert out.exit_code != 0 and "no tag nothing:here" in out.output, out.output


# -- real VMs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_net(store: Store, tiny_recipe: Path) -> str:
    from forkd.engine import netns, recipe
    from forkd.engine.build import build

    why = netns.available()
    if why:
        pytest.skip(why)
    text = tiny_recipe.read_text().replace("vcpus = 1\n", "vcpus = 1\nnetwork = true\n", 1)
    return build(store, recipe.parse(text, src="tiny+network"), "tiny-net:test").ref


@pytest.fixture(scope="module")
def upstream(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The stand-in model (HTTPS, wants REAL) and a plain HTTP service, on 127.x.y.z, and the
    host configuration that points the proxies at them; the secret bound to the model."""
    if os.geteuid() != 0:
        pytest.skip("needs root (port 443 on loopback, netns)")
    base = tmp_path_factory.mktemp("egress")
    addr = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}.{random.randint(1, 250)}"
    test_ca = EgressCA.load_or_create(base / "upstream-ca")
    (base / "upstream-ca.pem").write_bytes(test_ca.cert_pem)
    env = {"FORKD_SECRETS": str(base / "secrets"), "FORKD_EGRESS_AUDIT": str(base / "audit.log"),
           "FORKD_EGRESS_UPSTREAM_CA": str(base / "upstream-ca.pem"),
           "FORKD_EGRESS_PINS": f"api.openai.com={addr},plain.test={addr}"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    secret = SecretStore().set("OPENAI_API_KEY", REAL, ["api.openai.com"])
    model = StandinModel(api_key=REAL, tls=test_ca.leaf_context("api.openai.com"), host=addr,
                         port=443).start()
    plain = StandinModel(host=addr, port=80).start()
    try:
        yield {"model": model, "plain": plain, "placeholder": secret.placeholder,
               "audit": base / "audit.log"}
    finally:
        model.stop()
        plain.stop()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def guest_json(child_id: str, script: str) -> dict[str, Any]:
    from forkd.engine import children as ch

    r = ch.exec_in(child_id, ["python3", "-c", script], timeout=300)
    assert r["exit_code"] == 0, r
    return json.loads(r["stdout"])  # type: ignore[no-any-return]


def assert_nowhere(path: Path, what: str, start: int = 0, size: int | None = None,
                   ) -> None:
    """No needle (the secret, either half of it) in ``size`` bytes of ``path`` from
    ``start`` (a file, or /proc/PID/mem), read in pieces that overlap."""
    piece, overlap = 8 << 20, len(REAL)
    end = start + size if size is not None else path.stat().st_size
    with path.open("rb", buffering=0) as f:
        pos, tail = start, b""
        while pos < end:
            f.seek(pos)
            data = f.read(min(piece, end - pos))
            if not data:
                break
            window = tail + data
            for needle in NEEDLES:
                assert needle not in window, f"the secret is in {what} near offset {pos}"
            tail = window[-overlap:]
            pos += len(data)
        assert pos == end, f"read {pos - start} of {end - start} bytes of {what}"


def assert_not_in_ram(info: Any) -> None:
    """Read all guest RAM from the host: the QEMU mappings of the memory image (MAP_PRIVATE:
    what the guest wrote is in those pages), through /proc/PID/mem."""
    spans = []
    for line in Path(f"/proc/{info.pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == info.memory:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            spans.append((lo, hi - lo))
    assert sum(size for _, size in spans) == info.memory_mib << 20, spans
    for lo, size in spans:
        assert_nowhere(Path(f"/proc/{info.pid}/mem"), f"{info.id}'s RAM", lo, size)


def assert_gone(info: Any) -> None:
    from forkd.engine import netns

    assert info.proxy_pid is not None
    assert not (pid_alive(info.proxy_pid) and proxy_matches(info.proxy_pid, info.path))
    assert info.netns is not None and not netns.exists(info.netns)
    assert not info.path.exists()


@pytest.mark.vm
def test_child_without_egress_has_no_network(
    store: Store, tiny_net: str, upstream: dict[str, Any], cleanup_children: None,
) -> None:
    from forkd.engine import children as ch

    kid = ch.fork(store, tiny_net, 1).children[0]
    assert kid.egress == {} and kid.proxy_pid is None
    out = guest_json(kid.id, GUEST_NO_NETWORK)
    assert out["proxy_env"] is None
    assert "connected" not in (out["proxy"], out["outside"]), out
    assert out["dns"] != "resolved"
    ch.kill(kid.id)


@pytest.mark.vm
def test_round_trip_through_the_proxy_leaves_no_secret_in_any_guest(
    store: Store, tiny_net: str, upstream: dict[str, Any], cleanup_children: None,
) -> None:
    from forkd.engine import children as ch
    from forkd.engine.branch import branch

    model, plain, placeholder = upstream["model"], upstream["plain"], upstream["placeholder"]
    kid = ch.fork(store, tiny_net, 1, egress=POLICY).children[0]
    assert kid.egress["allow"] == ["api.openai.com:443", "plain.test:80"] and kid.proxy_pid

    out = guest_json(kid.id, GUEST_ROUND_TRIP)
    assert out["env"] == {"OPENAI_API_KEY": placeholder, "HTTPS_PROXY": "http://10.200.0.1:3128",
                          "SSL_CERT_FILE": "/etc/forkd/ca-bundle.pem"}
    assert out["chat"]["object"] == "chat.completion"  # the full model round trip
    # the upstream received the real value; the guest only ever held the placeholder
    assert [r.headers["authorization"] for r in model.completions()] == [f"Bearer {REAL}"]
    # an allowed destination the secret is not bound to gets the placeholder, unchanged
    assert out["plain"] == 404
    echo = [r for r in plain.requests if r.path == "/echo"]
    assert [r.headers["authorization"] for r in echo] == [f"Bearer {placeholder}"]
    # a destination outside the policy is refused, and audited with the child id
    assert "403" in out["evil"], out["evil"]
    audit = [json.loads(line) for line in upstream["audit"].read_text().splitlines()]
    denied = [a for a in audit if a["target"] == "evil.example:443"]
    assert denied and all(a["result"] == "denied" and a["child"] == kid.id for a in denied)
    assert any(a["target"] == "api.openai.com:443" and a["tls"] == "terminated"
               and a["child"] == kid.id for a in audit)
    assert out["dns"] != "resolved"  # the guest has no DNS: the proxy resolves
    # a connection around the proxy is refused (reset) and audited with where it was for
    assert "answered" not in out["direct"], out["direct"]
    audit = [json.loads(line) for line in upstream["audit"].read_text().splitlines()]
    direct = [a for a in audit if a["action"] == "egress.direct"]
    assert [(a["target"], a["result"], a["child"]) for a in direct] == [
        ("1.1.1.1:443", "denied", kid.id)]

    # nowhere in the guest: its RAM (all of it, read from the host) and its disk
    assert ch.exec_in(kid.id, ["sync"])["exit_code"] == 0
    info = ch.get(kid.id)
    assert_not_in_ram(info)
    assert_nowhere(info.path / "disk.qcow2", f"{kid.id}'s disk")

    # nor in a branch of it, nor in a fork of that branch (which works through its proxy)
    branch(store, kid.id, "egress-branch:test")
    asm = store.assemble("egress-branch:test")
    assert asm.disk is not None
    assert_nowhere(asm.memory, "the branch's memory image")
    assert_nowhere(asm.disk, "the branch's disk image")
    grandkid = ch.fork(store, "egress-branch:test", 1, egress=POLICY).children[0]
    again = guest_json(grandkid.id, GUEST_ROUND_TRIP)
    assert again["env"]["OPENAI_API_KEY"] == placeholder and again["chat"]["choices"]
    assert [r.headers["authorization"] for r in model.completions()] == [f"Bearer {REAL}"] * 2
    assert ch.exec_in(grandkid.id, ["sync"])["exit_code"] == 0
    ginfo = ch.get(grandkid.id)
    assert_not_in_ram(ginfo)
    assert_nowhere(ginfo.path / "disk.qcow2", f"{grandkid.id}'s disk")

    # kill ends each child's proxy with it (and its namespace, its directory)
    for i in (info, ginfo):
        ch.kill(i.id)
        assert_gone(i)


@pytest.mark.vm
def test_pause_resume_and_sweep_keep_one_proxy_per_child(
    store: Store, tiny_net: str, upstream: dict[str, Any], cleanup_children: None,
) -> None:
    from forkd.engine import children as ch
    from forkd.engine import pause

    kid = ch.fork(store, tiny_net, 1, egress=POLICY).children[0]
    first = kid.proxy_pid
    assert first is not None and proxy_matches(first, kid.path)
    paused = pause.pause(store, kid.id)
    assert paused.proxy_pid is None and not pid_alive(first)  # a pause frees the proxy too
    back = pause.resume(store, kid.id)
    assert back.proxy_pid is not None and back.proxy_pid != first
    assert proxy_matches(back.proxy_pid, back.path)
    out = guest_json(kid.id, GUEST_ROUND_TRIP)  # the resumed child reaches out again
    assert out["chat"]["object"] == "chat.completion"
    assert out["env"]["OPENAI_API_KEY"] == upstream["placeholder"]
    ch.kill(kid.id)
    assert_gone(back)
