"""push/pull against a real OCI registry: Debian's docker-registry (CNCF distribution 2.8)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import bcrypt
import pytest
from registry_support import REGISTRY, mkdir, start_registry

from forkd.errors import IntegrityError, InvalidInput
from forkd.registry import credentials
from forkd.registry.client import AuthError, RegistryClient
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store
from forkd.synthetic import write_diff

pytestmark = pytest.mark.skipif(
    REGISTRY is None and not os.environ.get("CI"),
    reason="docker-registry not installed (scripts/install-deps.sh --test installs it)",
)


def test_push_pull_round_trip_and_resume(
    store: Store, chain: list[str], images: list[Path], registry: Hub, tmp_path: Path
):
    remote = parse_remote(f"{registry}/team/app:v1")
    with RegistryClient(registry) as client:
        first = push(store, "d3", remote, client)
        assert first.layers == 4 and first.blobs_sent > 0 and first.blobs_skipped == 0
        again = push(store, "d3", remote, client)
        assert again.blobs_sent == 0 and again.blobs_skipped == first.blobs_sent

        other = Store(tmp_path / "other")
        got = pull(other, remote, client)
        assert got.ref == "team/app:v1" and got.digest == store.resolve("d3")
        assert other.assemble("team/app:v1").memory.read_bytes() == images[3].read_bytes()
        assert pull(other, remote, client).blobs_sent == 0

        # A new layer on a chain the registry has: only the delta travels.
        nxt = tmp_path / "d4.mem"
        write_diff(images[3], nxt, share=0.05, seed=99)
        info = store.import_layer("d4", memory=nxt, parent="d3")
        delta = push(store, "d4", parse_remote(f"{registry}/team/app:v2"), client)
        assert delta.blobs_sent == len(store.manifest(info.digest).blobs())
        assert delta.bytes_sent <= info.stored_bytes * 1.1 + 16384


class _Flaky(RegistryClient):
    """A real client that breaks off after ``budget`` blob transfers (an interrupted run)."""

    def __init__(self, hub: Hub, budget: int) -> None:
        super().__init__(hub)
        self.budget = budget

    def _spend(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise ConnectionError("connection reset (simulated interruption)")

    def get_blob(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._spend()
        return super().get_blob(*args, **kwargs)

    def put_blob(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._spend()
        return super().put_blob(*args, **kwargs)


def test_interrupted_push_and_pull_resume(
    store: Store, chain: list[str], images: list[Path], registry: Hub, tmp_path: Path
):
    remote = parse_remote(f"{registry}/team/resume:v1")
    with _Flaky(registry, budget=5) as flaky, pytest.raises(ConnectionError):
        push(store, "d3", remote, flaky, workers=1)
    with RegistryClient(registry) as client:
        result = push(store, "d3", remote, client)
        assert result.blobs_skipped >= 5  # finished blobs were not sent again

    other = Store(tmp_path / "other")
    with _Flaky(registry, budget=6) as flaky, pytest.raises(ConnectionError):
        pull(other, remote, flaky, workers=1)
    assert other.tags.read() == {}  # nothing tagged by the broken pull
    assert not list(other.blobs.tmp.iterdir())
    with RegistryClient(registry) as client:
        result = pull(other, remote, client)
    assert result.blobs_skipped >= 6
    assert other.assemble("team/resume:v1").memory.read_bytes() == images[3].read_bytes()


def test_tampered_registry_blob_is_refused(
    store: Store, chain: list[str], registry: Hub, tmp_path: Path
):
    remote = parse_remote(f"{registry}/team/bad:v1")
    with RegistryClient(registry) as client:
        push(store, "d3", remote, client)
    victim = store.manifest(store.resolve("d2")).chunks[0].digest.split(":")[1]
    data = next((tmp_path / "registry" / "data").rglob(f"blobs/sha256/{victim[:2]}/{victim}/data"))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(raw)
    other = Store(tmp_path / "other")
    with RegistryClient(registry) as client, pytest.raises(IntegrityError, match="layer 1"):
        pull(other, remote, client)
    assert other.tags.read() == {}


def test_missing_remote_tag(store: Store, registry: Hub):
    with RegistryClient(registry) as client, pytest.raises(Exception, match="MANIFEST_UNKNOWN"):
        pull(store, parse_remote(f"{registry}/team/none:v1"), client)


def test_basic_auth_login_push_pull(
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
):
    root = mkdir(tmp_path / "authreg")
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    (root / "htpasswd").write_text(f"alice:{hashed}\n")
    auth = f"auth:\n  htpasswd:\n    realm: forkd-test\n    path: {root}/htpasswd\n"
    monkeypatch.setenv("FORKD_CREDENTIALS", str(tmp_path / "creds.json"))
    for hub in start_registry(root, auth):
        remote = parse_remote(f"{hub}/team/private:v1")
        with RegistryClient(hub) as anonymous, pytest.raises(AuthError, match="forkd login"):
            push(store, "d1", remote, anonymous)
        with (
            RegistryClient(hub, credentials.Credential("alice", "wrong")) as bad,
            pytest.raises(AuthError),
        ):
            bad.ping()
        env = {**os.environ, "FORKD_HOME": str(store.home)}
        proc = subprocess.run(
            ["forkd", "login", str(hub), "-u", "alice", "--password-stdin"],
            input="s3cret\n",
            text=True,
            capture_output=True,
            env=env,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        assert (tmp_path / "creds.json").stat().st_mode & 0o777 == 0o600
        proc = subprocess.run(
            ["forkd", "push", "d1", f"{hub}/team/private:v1", "--json"],
            text=True,
            capture_output=True,
            env=env,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        assert proc.returncode == 0, proc.stderr
        other = tmp_path / "other-home"
        proc = subprocess.run(
            ["forkd", "pull", f"{hub}/team/private:v1", "--tag", "mine"],
            text=True,
            capture_output=True,
            stdin=subprocess.DEVNULL,
            env={**env, "FORKD_HOME": str(other)},
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert Store(other).assemble("mine").memory.read_bytes() == images[1].read_bytes()


@pytest.mark.parametrize(
    "text,hub,name,tag",
    [
        ("localhost:5000/a/b", "localhost:5000", "a/b", "latest"),
        (
            "hub.example.com/deeplethe/langgraph-react:v2",
            "hub.example.com",
            "deeplethe/langgraph-react",
            "v2",
        ),
        ("http://10.0.0.1:80/ns/n:t", "10.0.0.1:80", "ns/n", "t"),
    ],
)
def test_remote_references(text: str, hub: str, name: str, tag: str):
    ref = parse_remote(text)
    assert (ref.hub.host, ref.name, ref.tag) == (hub, name, tag)


def test_default_hub_and_bad_references(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.delenv("FORKD_HUB", raising=False)
    monkeypatch.setenv("FORKD_CREDENTIALS", str(tmp_path / "creds.json"))  # no default hub
    with pytest.raises(InvalidInput, match="FORKD_HUB"):
        parse_remote("deeplethe/langgraph-react")
    monkeypatch.setenv("FORKD_HUB", "127.0.0.1:7000")
    ref = parse_remote("deeplethe/langgraph-react")
    assert ref.hub == Hub("127.0.0.1:7000", "http") and ref.tag == "latest"
    assert parse_remote("hub.io/x/y").hub.scheme == "https"
    for bad in ["hub.io/../x", "hub.io/X/Y", "bad host/x", "hub.io/x:\x00"]:
        with pytest.raises(InvalidInput):
            parse_remote(bad)


def test_cli_pull_checks_compat_metadata(
    store: Store, images: list[Path], registry: Hub, tmp_path: Path
):
    from forkd.pack.config import Compat

    alien = Compat(
        vmm="firecracker",
        vmm_version="1.7.0",
        machine="fc",
        cpu_model="host",
        accelerators=["kvm"],
        vcpus=2,
        memory_mib=8,
        kernel_digest=None,
        agent_protocol=99,
    )
    store.import_layer("alien", memory=images[0], compat=alien)
    with RegistryClient(registry) as client:
        push(store, "alien", parse_remote(f"{registry}/team/alien:v1"), client)
    env = {**os.environ, "FORKD_HOME": str(tmp_path / "other")}
    proc = subprocess.run(
        ["forkd", "pull", f"{registry}/team/alien:v1", "--json"],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    problems = json.loads(proc.stdout)["host_problems"]
    assert any("firecracker" in p for p in problems)
    assert any("protocol 99" in p for p in problems)
    text = subprocess.run(
        ["forkd", "pull", f"{registry}/team/alien:v1"],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
    assert "warning: this host cannot fork team/alien:v1" in text.stderr
