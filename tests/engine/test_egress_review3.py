"""The egress proxy against the third review: where an allowed name may lead. No VM.

A name was refused only the addresses that are not global; an address of the host's own
interfaces that is global (a cloud host's public address, on its eth0) was used, and a
guest whose allowed name resolves there (a DNS answer its owner controls, a wildcard
entry over names someone else registers) reached the host's own services: whatever
listens on 0.0.0.0 (the controller's TCP API, the hub, sshd).

The end-to-end test runs in a network and mount namespace of its own (``unshare -mn``,
gone with its process): a veth interface there holds the global addresses 8.8.8.8 and
2606:4700::1111, and /etc/hosts (bind-mounted over, in that namespace only) names
``own.test`` as 8.8.8.8. The proxy resolves through the real resolver (no pin).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from forkd.addresses import this_host
from forkd.engine.egress.proxy import _usable_for_a_name

HERE = Path(__file__).resolve().parent
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("ip") is None,
    reason="needs root, unshare and ip for a network namespace of its own",
)

IN_NAMESPACE = """
set -e
ip link set lo up
ip link add d0 type veth peer name d1
ip addr add 8.8.8.8/32 dev d0
ip -6 addr add 2606:4700::1111/128 dev d0 nodad
ip link set d0 up
ip link set d1 up
mount --bind {hosts} /etc/hosts
exec {python} -P {script}
"""

CHECK = """
import json, sys
sys.path.insert(0, {tests!r})
from pathlib import Path
import httpx
from test_egress import audit_lines, make_proxy
from forkd.addresses import public_enough as _public_enough
from forkd.engine.egress.proxy import _usable_for_a_name
from forkd.engine.egress.standin import StandinModel

out = {{}}
# the old check let them through: they are global
out["global"] = [_public_enough(a) for a in ("8.8.8.8", "2606:4700::1111")]
out["usable"] = {{a: _usable_for_a_name(a) for a in
                 ("8.8.8.8", "2606:4700::1111", "::ffff:8.8.8.8", "8.8.4.4", "1.1.1.1")}}
audit = Path({audit!r})
with StandinModel(host="8.8.8.8") as own:
    proxy = make_proxy([f"own.test:{{own.port}}"], audit, pins=False)
    try:
        with httpx.Client(proxy=proxy.url, timeout=10, trust_env=False) as guest:
            r = guest.get(f"http://own.test:{{own.port}}/v1/models")
        out["status"], out["body"] = r.status_code, r.text
    finally:
        proxy.stop()
    out["reached"] = len(own.requests)
out["audit"] = audit_lines(audit)[-1]
print(json.dumps(out))
"""


@needs_root
def test_a_name_resolving_to_the_hosts_own_global_address_is_not_used(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n8.8.8.8 own.test\n")
    script = tmp_path / "check.py"
    script.write_text(CHECK.format(tests=str(HERE), audit=str(tmp_path / "audit.log")))
    shell = IN_NAMESPACE.format(hosts=hosts, python=sys.executable, script=script)
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(["unshare", "-mn", "sh", "-c", textwrap.dedent(shell)],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["global"] == [True, True]  # what the proxy checked before: it passed
    assert out["usable"] == {"8.8.8.8": False, "2606:4700::1111": False,
                             "::ffff:8.8.8.8": False, "8.8.4.4": True, "1.1.1.1": True}
    assert out["status"] == 502 and "this host's own" in out["body"], out
    assert out["reached"] == 0  # the host's own service got no connection's request
    assert out["audit"]["result"] == "failed"


def test_this_hosts_addresses_are_told_from_others() -> None:
    """In the test's own namespace: loopback is this host's, a global address it does not
    hold is not, and stays usable for a name (the check refuses no more than it should)."""
    assert this_host("127.0.0.1") and this_host("::1") and this_host("::ffff:127.0.0.1")
    assert not this_host("8.8.8.8") and _usable_for_a_name("8.8.8.8")
    assert not _usable_for_a_name("127.0.0.1") and not _usable_for_a_name("::1")
