"""Server-side compaction on a real hub: a flat tag from the blobs the hub holds, nothing
uploaded, the same assembled bytes, provenance in lineage, push needed, the retention rule;
on every blob backend (filesystem and S3: compaction_support)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compaction_support import (  # noqa: F401  (s3_compaction_hub: a fixture)
    BACKENDS,
    on_backend,
    on_every_backend,
    s3_compaction_hub,
)
from hub_support import ADMIN, TIMEOUT, HubServer, http
from s3_hub_support import s3_settings
from s3_support import MotoServer

from forkd.errors import Conflict, InvalidInput
from forkd.hub.settings import HubSettings, load_config
from forkd.registry import credentials
from forkd.registry.client import AuthError, RegistryClient, RegistryError, RegistryNotFound
from forkd.registry.compaction import compact_remote
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store


def _metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def _uploads(server: HubServer) -> tuple[float, float]:
    """(upload requests, blob bytes received) so far, from the hub's /metrics."""
    text = http.get(f"{server.url}/metrics", auth=ADMIN).text
    return (
        _metric(text, "forkd_hub_requests_total", route="blobs/uploads"),
        _metric(text, "forkd_hub_blob_bytes_received_total"),
    )


def _audit(server: HubServer) -> list[dict[str, Any]]:
    lines = (server.data_dir / "audit.log").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _lineage(server: HubServer, repo: str, tag: str, auth: tuple[str, str]) -> dict[str, Any]:
    r = http.get(f"{server.url}/api/v1/lineage/{repo}", params={"tag": tag}, auth=auth)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


@pytest.fixture
def hub(request: pytest.FixtureRequest, hub: HubServer) -> HubServer:
    """The session's filesystem hub, or (parametrized "s3") one whose blobs are in S3."""
    return on_backend(request, hub)


@pytest.fixture
def creds_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "credentials.json"
    monkeypatch.setenv("FORKD_CREDENTIALS", str(path))
    yield path


@on_every_backend
def test_compact_on_the_hub_uploads_nothing_and_keeps_the_bytes(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
) -> None:
    target = Hub(hub.address, "http")
    repo = f"{user[0]}/app"
    remote = parse_remote(f"{target}/{repo}:v1")
    with RegistryClient(target, Credential(*user)) as client:
        pushed = push(store, "d2", remote, client)  # base ← d1 ← d2: three layers
        assert pushed.layers == 3
        head = pushed.digest
        uploads_before = _uploads(hub)
        audit_before = len(_audit(hub))

        result = compact_remote(client, repo, "v1", "flat")

        assert _uploads(hub) == uploads_before  # no upload request, no byte received
        entries = _audit(hub)[audit_before:]
        assert not [e for e in entries if e["action"].startswith("blob.")]
        [done] = [e for e in entries if e["action"] == "manifest.compact"]
        assert done["actor"] == user[0] and done["result"] == "ok"
        assert done["digest"] == result["digest"] and done["source"] == f"v1@{head}"

        assert result["repository"] == repo and result["tag"] == "flat"
        assert result["depth"] == 0 and result["stored_bytes"] > 0
        assert result["compacted_from"] == {
            "from_tag": f"{repo}:v1",
            "from_digest": head,
            "from_depth": 2,
            "reason": "manual",
        }

        # Pull the flat tag into a fresh store: one layer, byte-identical memory.
        other = Store(tmp_path / "fresh")
        got = pull(other, parse_remote(f"{target}/{repo}:flat"), client)
        assert got.digest == result["digest"] and got.layers == 1
        assert other.config(got.digest).depth == 0
        assert other.config(got.digest).compacted_from is not None
        flat_memory = other.assemble(f"{repo}:flat").memory.read_bytes()
        assert flat_memory == store.assemble("d2").memory.read_bytes()
        assert flat_memory == images[2].read_bytes()

        # Lineage shows where the flat layer came from; the catalog shows depth 0.
        lineage = _lineage(hub, repo, "flat", user)
        assert lineage["head"]["compacted_from"] == f"{repo}:v1@{head}"
        assert lineage["head"]["parent"] is None and lineage["ancestors"] == []
        detail = http.get(f"{hub.url}/api/v1/repositories/{repo}", auth=user).json()
        depths = {t["name"]: t["chain_depth"] for t in detail["tags"]}
        assert depths == {"v1": 2, "flat": 0}

        # An existing target is refused without force, replaced with it.
        with pytest.raises(Conflict, match="exists"):
            compact_remote(client, repo, "v1", "flat")
        again = compact_remote(client, repo, "v1", "flat", force=True)
        assert again["depth"] == 0  # the same digest within one second (created_at), or new
        assert _lineage(hub, repo, "flat", user)["head"]["digest"] == again["digest"]
        tags = http.get(f"{hub.url}/v2/{repo}/tags/list", auth=user).json()["tags"]
        assert sorted(tags) == ["flat", "v1"]

        assert not list(hub.data_dir.glob(".compact-*"))  # scratch stores are removed

        # Unknown tag: 404, nothing created.
        with pytest.raises(RegistryNotFound, match="MANIFEST_UNKNOWN"):
            compact_remote(client, repo, "nope", "x")


@on_every_backend
def test_compact_needs_push(hub: HubServer, store: Store, chain: list[str], tmp_path: Path) -> None:
    stamp = time.monotonic_ns() % 1_000_000
    owner = hub.add_user(f"own{stamp}")
    reader = hub.add_user(f"read{stamp}")
    stranger = hub.add_user(f"str{stamp}")
    org = f"org{stamp}"
    hub.cli("org", "add", org, "--member", f"{owner[0]}=push", "--member", f"{reader[0]}=pull")
    target = Hub(hub.address, "http")
    repo = f"{org}/app"
    with RegistryClient(target, Credential(*owner)) as client:
        push(store, "d1", parse_remote(f"{target}/{repo}:v1"), client)
    with (
        RegistryClient(target, Credential(*reader)) as client,
        pytest.raises(AuthError, match="403"),
    ):
        compact_remote(client, repo, "v1", "flat")
    with (
        RegistryClient(target, Credential(*stranger)) as client,
        pytest.raises(RegistryNotFound, match="NAME_UNKNOWN"),
    ):
        compact_remote(client, repo, "v1", "flat")
    # Anonymous: the token challenge, then refused.
    r = http.post(f"{hub.url}/api/v1/compact/{repo}", json={"tag": "v1", "to": "flat"})
    assert r.status_code == 401 and "Bearer" in r.headers["www-authenticate"]
    tags = http.get(f"{hub.url}/v2/{repo}/tags/list", auth=owner).json()["tags"]
    assert tags == ["v1"]
    # Bad input is 400 before anything else.
    r = http.post(f"{hub.url}/api/v1/compact/{repo}", json={"tag": "v1", "to": "../x"}, auth=owner)
    assert r.status_code == 400


@on_every_backend
def test_compact_reads_no_other_repository(hub: HubServer, store: Store, chain: list[str]) -> None:
    """A pushed subject may name any digest: a layer whose parent lives only in another
    (private) repository is refused, so compaction cannot leak that repository's memory."""
    stamp = time.monotonic_ns() % 1_000_000
    victim, thief = hub.add_user(f"vic{stamp}"), hub.add_user(f"thf{stamp}")
    target = Hub(hub.address, "http")
    with RegistryClient(target, Credential(*victim)) as client:
        push(store, "d1", parse_remote(f"{target}/{victim[0]}/secret:v1"), client)
    d2 = store.resolve("d2")  # its subject is d1, now only in the victim's repository
    repo = f"{thief[0]}/steal"
    with RegistryClient(target, Credential(*thief)) as client:
        for d in store.manifest(d2).blobs():
            data = store.blobs.read(d.digest, d.size)
            client.put_blob(repo, d.digest, d.size, lambda off, n, b=data: b[off : off + n])
        client.put_manifest(repo, "v", store.blobs.read(d2, 1 << 22))
        with pytest.raises(RegistryError, match="400 MANIFEST_BLOB_UNKNOWN"):
            compact_remote(client, repo, "v", "flat")
    r = http.post(f"{hub.url}/api/v1/compact/{repo}", json={"tag": "v", "to": "f"}, auth=thief)
    assert r.status_code == 400
    assert f"is not in {repo}" in r.json()["errors"][0]["detail"]
    tags = http.get(f"{hub.url}/v2/{repo}/tags/list", auth=thief).json()["tags"]
    assert tags == ["v"]


def test_retention_setting_is_checked(tmp_path: Path) -> None:
    config = tmp_path / "hub.toml"
    config.write_text("compact_deeper_than = 3\n")
    settings = HubSettings.from_env(tmp_path, base=load_config(config))
    assert settings.compact_deeper_than == 3
    for bad in (-1, 65):
        with pytest.raises(InvalidInput, match="compact_deeper_than"):
            HubSettings(tmp_path, compact_deeper_than=bad).validated()
    # Compaction works on every blob backend, so the rule does too.
    s3 = HubSettings(tmp_path, compact_deeper_than=2, blob_backend="s3", s3_bucket="b")
    assert s3.validated().compact_deeper_than == 2


@on_every_backend
def test_forkd_compact_remote_command(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    home: Path,
    creds_file: Path,
) -> None:
    target = Hub(hub.address, "http")
    repo = f"{user[0]}/cli"
    credentials.save(target.host, Credential(*user))
    with RegistryClient(target, Credential(*user)) as client:
        head = push(store, "d3", parse_remote(f"{target}/{repo}:v3"), client).digest
    env = {**os.environ, "FORKD_HOME": str(home), "FORKD_CREDENTIALS": str(creds_file)}

    def forkd(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["forkd", *args],
            env=env,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=TIMEOUT,
        )

    proc = forkd("compact", "--remote", f"{target}/{repo}:v3", "--to", "flat", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["depth"] == 0 and out["compacted_from"]["from_digest"] == head
    assert out["compacted_from"]["from_depth"] == 3
    proc = forkd("compact", "--remote", f"{target}/{repo}:v3", "--to", "flat")
    assert proc.returncode == Conflict.exit_code, proc.stderr
    assert "--force" in proc.stderr
    proc = forkd("compact", "--remote", f"{target}/{repo}:v3", "--to", "flat", "--force")
    assert proc.returncode == 0, proc.stderr
    assert "nothing uploaded" in proc.stdout
    assert _lineage(hub, repo, "flat", user)["head"]["compacted_from"] == f"{repo}:v3@{head}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_retention_rule_compacts_deep_chains(
    request: pytest.FixtureRequest,
    backend: str,
    tmp_path: Path,
    store: Store,
    chain: list[str],
    images: list[Path],
) -> None:
    settings: dict[str, Any] = {"compact_deeper_than": 1}
    if backend == "s3":
        moto: MotoServer = request.getfixturevalue("moto_server")
        settings.update(s3_settings(moto, moto.new_bucket()))
    server = HubServer(tmp_path / "hub", settings).start()
    try:
        user = server.add_user("ret")
        target = Hub(server.address, "http")
        repo = "ret/app"
        with RegistryClient(target, Credential(*user)) as client:
            shallow = push(store, "d1", parse_remote(f"{target}/{repo}:shallow"), client)
            deep = push(store, "d2", parse_remote(f"{target}/{repo}:deep"), client)
            deadline = time.monotonic() + TIMEOUT
            while True:
                r = http.get(f"{server.url}/v2/{repo}/tags/list", auth=user)
                if "deep-flat" in r.json()["tags"]:
                    break
                assert time.monotonic() < deadline, "the retention rule did not compact"
                time.sleep(0.1)
            assert sorted(r.json()["tags"]) == ["deep", "deep-flat", "shallow"]
            # The pushed tag is left where the client put it.
            assert (
                server.client(auth=user)
                .head(f"/v2/{repo}/manifests/deep")
                .headers["docker-content-digest"]
                == deep.digest
            )
            lineage = _lineage(server, repo, "deep-flat", user)
            assert lineage["head"]["compacted_from"] == f"{repo}:deep@{deep.digest}"
            # The flat layer's blobs are GC roots like any pushed manifest's.
            server.cli("gc", "--grace-minutes", "0")
            got = pull(
                Store(tmp_path / "fresh"), parse_remote(f"{target}/{repo}:deep-flat"), client
            )
            assert got.layers == 1
            fresh = Store(tmp_path / "fresh")
            assert fresh.assemble(f"{repo}:deep-flat").memory.read_bytes() == images[2].read_bytes()
            assert fresh.config(got.digest).compacted_from.reason == "auto-depth"  # type: ignore[union-attr]
        # The background compaction writes its record after the tag is registered (what
        # the loop above waited for): wait for the record itself.
        deadline = time.monotonic() + TIMEOUT
        while not (done := [e for e in _audit(server) if e["action"] == "manifest.compact"]):
            assert time.monotonic() < deadline, "the retention compaction was not audited"
            time.sleep(0.1)
        [entry] = done
        assert entry["actor"] == "(retention)" and entry["reason"] == "auto-depth"
        assert entry["source"] == f"deep@{deep.digest}"
        assert shallow.digest != deep.digest
    finally:
        server.stop()
