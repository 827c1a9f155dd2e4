"""Egress for one child: what a fork asks for, the proxy process on the host side of the
child's network namespace, and what the guest is given (docs/agents.md, "In a child").

The lifecycle (engine/lifecycle.py) starts the proxy with ``start_proxy`` and ends it with
``stop_proxy``; children.py gives the guest its environment and the CA with
``configure_guest``. Host configuration (read by the process that forks):

- ``FORKD_SECRETS``: the secret store (secrets.py; default ``~/.config/forkd/secrets``);
- ``FORKD_EGRESS_AUDIT``: the egress audit log (default ``$FORKD_HOME/egress-audit.log``);
- ``FORKD_EGRESS_UPSTREAM_CA``: a PEM bundle trusted for upstreams besides the system
  store (e.g. a corporate or test CA);
- ``FORKD_EGRESS_PINS``: ``HOST=ADDR,HOST=ADDR``, names the proxy connects to at that
  address instead of asking DNS (operator configuration: a pinned address may be
  loopback).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from forkd.addresses import reaches_this_host
from forkd.engine import netns
from forkd.engine.egress.netns_listen import DEFAULT_PROXY_PORT, REFUSAL_PORT
from forkd.engine.egress.policy import MAX_ENTRIES, EgressPolicy, parse_destination
from forkd.engine.egress.secrets import SecretStore, guest_environment, secrets_dir
from forkd.engine.errors import HostError
from forkd.engine.qemu import pid_alive, pid_matches, qemu_environment
from forkd.errors import InvalidInput
from forkd.names import inert
from forkd.store.store import default_home

if TYPE_CHECKING:
    from forkd.engine.egress.ca import EgressCA

MODULE = "forkd.engine.egress.serve"  # the proxy process (serve.py)
PROXY_URL = f"http://{netns.GW_IP}:{DEFAULT_PROXY_PORT}"
GUEST_CA_FILE = "/etc/forkd/egress-ca.pem"  # the forkd egress CA (public certificate)
GUEST_BUNDLE = "/etc/forkd/ca-bundle.pem"  # the guest's roots + the forkd CA
SYSTEM_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"  # Debian's, when ca-certificates is in
LOCAL_CA = "/usr/local/share/ca-certificates/forkd-egress.crt"  # update-ca-certificates keeps it
NO_PROXY = "localhost,127.0.0.1,::1"
READY_FILE, LOG_FILE = "egress.ready", "egress.log"
PROXY_START_S = 30.0
MAX_PINS = 256


@dataclass(frozen=True)
class EgressSettings:
    """One child's egress: its policy entries and the host's configuration for its proxy,
    recorded in the child's record so a resume starts the same proxy again."""

    allow: tuple[str, ...]
    secrets: str
    audit: str
    upstream_ca: str | None = None
    pins: tuple[tuple[str, str], ...] = ()
    with_secrets: bool = True  # the host's secrets are bound (False: a recipe's defaults)

    @classmethod
    def resolve(cls, entries: Sequence[str], env: Mapping[str, str] | None = None,
                with_secrets: bool = True) -> EgressSettings:
        """Validated settings for a child allowed ``entries``, from this host's configuration
        (InvalidInput naming what is wrong). with_secrets=False: the host's secrets are
        bound to none of them (the destinations a snapshot's recipe names by default: a
        pack pulled from a hub is anyone's, and would get to use this host's keys)."""
        env = os.environ if env is None else env
        policy = parse_policy(entries)
        audit = env.get("FORKD_EGRESS_AUDIT") or str(default_home() / "egress-audit.log")
        upstream = env.get("FORKD_EGRESS_UPSTREAM_CA") or None
        if upstream is not None and not Path(upstream).is_file():
            raise InvalidInput(f"FORKD_EGRESS_UPSTREAM_CA={upstream!r} is not a file; "
                               "give a PEM bundle of CA certificates")
        settings = cls(allow=tuple(str(e) for e in policy.entries),
                       secrets=str(secrets_dir()), audit=audit, upstream_ca=upstream,
                       pins=parse_pins(env.get("FORKD_EGRESS_PINS", "")),
                       with_secrets=with_secrets)
        if settings.bound_secrets():  # made once here, not by N proxies starting at once
            load_ca(settings)
        return settings

    def record(self) -> dict[str, Any]:
        return {"allow": list(self.allow), "secrets": self.secrets, "audit": self.audit,
                "upstream_ca": self.upstream_ca, "pins": [list(p) for p in self.pins],
                "with_secrets": self.with_secrets}

    @classmethod
    def from_record(cls, doc: Mapping[str, Any]) -> EgressSettings:
        try:
            pins = tuple((str(h), str(a)) for h, a in doc.get("pins", []))
            return cls(allow=tuple(str(e) for e in doc["allow"]), secrets=str(doc["secrets"]),
                       audit=str(doc["audit"]), upstream_ca=doc.get("upstream_ca"), pins=pins,
                       with_secrets=doc.get("with_secrets", True) is not False)
        except (KeyError, TypeError, ValueError) as e:
            raise HostError(f"a child record's egress settings are malformed ({e})") from e

    def policy(self) -> EgressPolicy:
        return EgressPolicy.parse(self.allow)

    def bound_secrets(self) -> list[Any]:
        """The secrets bound to a destination this policy allows (the only ones its proxy
        uses and its guest sees a placeholder of); none without ``with_secrets``."""
        if not self.with_secrets:
            return []
        policy = self.policy()
        return [s for s in SecretStore(Path(self.secrets)).all()
                if any(policy.allowing(b) is not None for b in s.bindings)]


def load_ca(settings: EgressSettings) -> EgressCA:
    from forkd.engine.egress.ca import EgressCA  # cryptography: only when a secret is bound

    return EgressCA.load_or_create(Path(settings.secrets) / "ca")


def parse_policy(entries: object) -> EgressPolicy:
    if isinstance(entries, (str, bytes)) or not isinstance(entries, (list, tuple)):
        raise InvalidInput(f"egress must be a list of HOST[:PORT] entries, got {entries!r:.80}")
    if len(entries) > MAX_ENTRIES:
        raise InvalidInput(f"an egress policy holds at most {MAX_ENTRIES} destinations")
    if not all(isinstance(e, str) for e in entries):
        raise InvalidInput("egress entries must be strings: HOST[:PORT]")
    policy = EgressPolicy.parse(entries)
    if not policy.entries:
        raise InvalidInput("egress needs at least one HOST[:PORT] entry")
    for entry in policy.entries:
        reached = reaches_this_host(entry.host) if entry.kind == "ip" else None
        if reached is not None:
            raise InvalidInput(
                f"egress entry {entry} reaches {reached}: the proxy connects from this host, "
                "so a sandbox (or a recipe's egress) naming it would reach the host's own "
                "services or the cloud's credentials; to let sandboxes reach a service of "
                "this host on purpose, the host's operator pins a name to it "
                "(FORKD_EGRESS_PINS=NAME=ADDRESS) and the entry names NAME")
    return policy


def parse_pins(text: str) -> tuple[tuple[str, str], ...]:
    """``HOST=ADDR,HOST=ADDR`` (FORKD_EGRESS_PINS) as validated pairs."""
    pins: dict[str, str] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        host, sep, addr = item.partition("=")
        if not sep:
            raise InvalidInput(f"FORKD_EGRESS_PINS: {item[:80]!r} is not HOST=ADDR")
        dest = parse_destination(host.strip(), wildcard_ok=False)
        if dest.kind != "name":
            raise InvalidInput(f"FORKD_EGRESS_PINS: {host[:80]!r} is not a hostname")
        try:
            pins[dest.host] = str(ipaddress.ip_address(addr.strip()))
        except ValueError:
            raise InvalidInput(f"FORKD_EGRESS_PINS: {addr[:80]!r} is not an IP address") from None
    if len(pins) > MAX_PINS:
        raise InvalidInput(f"FORKD_EGRESS_PINS holds at most {MAX_PINS} pins")
    return tuple(sorted(pins.items()))


# -- the proxy process -------------------------------------------------------------------


def proxy_argv(settings: EgressSettings, child_id: str, ns: str, d: Path) -> list[str]:
    argv = [sys.executable, "-P", "-m", MODULE, "--child", child_id, "--netns", ns,
            "--ready", str(d / READY_FILE), "--audit", settings.audit]
    if settings.with_secrets:
        argv += ["--secrets", settings.secrets]
    if settings.upstream_ca:
        argv += ["--upstream-ca", settings.upstream_ca]
    for host, addr in settings.pins:
        argv += ["--pin", f"{host}={addr}"]
    return [*argv, "--", *settings.allow]


def start_proxy(settings: EgressSettings, child_id: str, ns: str, d: Path) -> int:
    """Start the child's proxy process (detached, like its QEMU: it outlives the command
    that forked the child); its pid. ``wait_ready`` waits until it listens."""
    (d / READY_FILE).unlink(missing_ok=True)
    netns.redirect_stray_tcp(ns, DEFAULT_PROXY_PORT, REFUSAL_PORT)
    with (d / LOG_FILE).open("ab") as log:
        proc = subprocess.Popen(proxy_argv(settings, child_id, ns, d), cwd="/",
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                close_fds=True, env=qemu_environment(), start_new_session=True)
    return proc.pid


def proxy_matches(pid: int, d: Path) -> bool:
    """pid is the egress proxy of the child in directory d (guards against pid reuse)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return MODULE.encode() in cmd and pid_matches(pid, d)


def wait_ready(pid: int, d: Path, timeout: float = PROXY_START_S) -> None:
    """Return once the proxy listens; HostError with its log when it exits or is slow."""
    deadline = time.monotonic() + timeout
    while not (d / READY_FILE).exists():
        if not (pid_alive(pid) and proxy_matches(pid, d)):
            raise HostError(f"the egress proxy exited before listening:\n{log_tail(d)}")
        if time.monotonic() > deadline:
            raise HostError(f"the egress proxy did not listen within {timeout:.0f} s:\n"
                            f"{log_tail(d)}")
        time.sleep(0.01)


def stop_proxy(pid: int, d: Path, timeout: float = 3.0) -> None:
    """SIGTERM → wait ≤ timeout → SIGKILL → wait, if pid is still d's proxy."""
    if not proxy_matches(pid, d):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.01)
    if pid_alive(pid) and proxy_matches(pid, d):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        while pid_alive(pid):
            _reap(pid)
            time.sleep(0.01)
    _reap(pid)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def log_tail(d: Path, n: int = 12) -> str:
    try:
        lines = (d / LOG_FILE).read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return "(no egress.log)"
    return f"--- {LOG_FILE}:\n" + inert("\n".join(lines))  # names the guest asked for


# -- the guest -----------------------------------------------------------------------------


def guest_env(placeholders: Mapping[str, str], with_ca: bool) -> dict[str, str]:
    """What every process in the guest gets: the proxy, its exceptions, the CA bundle for
    the usual TLS stacks (OpenSSL/Python, requests, curl, Node) and the placeholders."""
    env = {name: PROXY_URL for name in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                        "http_proxy")}
    env |= {"NO_PROXY": NO_PROXY, "no_proxy": NO_PROXY}
    if with_ca:
        env |= {name: GUEST_BUNDLE for name in ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE",
                                                "CURL_CA_BUNDLE")}
        env["NODE_EXTRA_CA_CERTS"] = GUEST_CA_FILE
    return env | dict(placeholders)


# Runs once in the guest agent's warm interpreter (the `eval` op): writes the CA files and
# sets the agent's own environment, which every later `exec` inherits. Names start with
# _forkd_ and are deleted after, so the warm namespace is left as it was.
_SETUP = """
def _forkd_egress_setup(a):
    import os
    ca = a["ca"]
    if ca:
        os.makedirs(os.path.dirname(a["ca_file"]), exist_ok=True)
        with open(a["ca_file"], "w") as f:
            f.write(ca)
        roots = ""
        if os.path.exists(a["system"]):
            with open(a["system"]) as f:
                roots = f.read()
            if ca not in roots:
                with open(a["system"], "a") as f:
                    f.write("\\n" + ca)
            os.makedirs(os.path.dirname(a["local"]), exist_ok=True)
            with open(a["local"], "w") as f:
                f.write(ca)
        with open(a["bundle"], "w") as f:
            f.write((roots.replace(ca, "").rstrip("\\n") + "\\n" + ca).lstrip("\\n"))
    os.environ.update(a["env"])
_forkd_egress_setup(__import__("json").loads(%r))
del _forkd_egress_setup
"""


class Agent(Protocol):
    def eval(self, code: str, timeout: float = ...) -> dict[str, Any]: ...


def configure_guest(agent: Agent, settings: EgressSettings, timeout: float = 30.0) -> list[str]:
    """Give the guest the proxy environment, the placeholders of the secrets its policy
    reaches and (when there are any) the forkd CA in its trust store; the names of those
    secrets."""
    secrets = settings.bound_secrets()
    ca_pem = ""
    if secrets:
        ca_pem = load_ca(settings).cert_pem.decode()
    args = {"ca": ca_pem, "ca_file": GUEST_CA_FILE, "bundle": GUEST_BUNDLE,
            "system": SYSTEM_BUNDLE, "local": LOCAL_CA,
            "env": guest_env(guest_environment(secrets), bool(ca_pem))}
    r = agent.eval(_SETUP % json.dumps(args), timeout=timeout)
    if r.get("error"):
        err = r["error"]
        raise HostError(f"setting up egress in the guest failed: {err.get('type')}: "
                        f"{err.get('message')}")
    return [s.name for s in secrets]
