"""A real forkd pack (a 3-layer chain) between the hub and standard OCI tools, byte-identical:
skopeo copies it hub → docker-registry → hub, oras downloads its blobs from the hub, and
forkd pulls it back at each step."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import oras.provider  # type: ignore[import-untyped]
import pytest
from hub_support import ADMIN, HubServer

from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

SIZE = 8 << 20


def _skopeo() -> str:
    path = shutil.which("skopeo")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("skopeo is missing: apt-get install -y skopeo")
        pytest.skip("skopeo not installed")
    return path


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Store, list[Path]]:
    store = Store(tmp_path / "home")
    images = [tmp_path / "l0.mem"]
    write_base(images[0], SIZE, seed=3)
    store.import_layer("p0", memory=images[0])
    for i in (1, 2):
        images.append(tmp_path / f"l{i}.mem")
        write_diff(images[i - 1], images[i], share=0.05, seed=i)
        store.import_layer(f"p{i}", memory=images[i], parent=f"p{i - 1}")
    return store, images


def test_skopeo_moves_a_forkd_chain_hub_to_docker_registry_and_back(
    hub: HubServer, registry: Hub, chain: tuple[Store, list[Path]], tmp_path: Path
) -> None:
    skopeo = _skopeo()
    store, images = chain
    hub_ref = Hub(hub.address, "http")
    with RegistryClient(hub_ref, Credential(*ADMIN)) as client:
        push(store, "p2", parse_remote(f"{hub.address}/admin/pack:v1"), client)
    layers = store.chain(store.resolve("p2"))  # head first

    def copy(src: str, dst: str, creds: list[str]) -> None:
        proc = subprocess.run(
            [
                skopeo,
                "--insecure-policy",
                "copy",
                "--src-tls-verify=false",
                "--dest-tls-verify=false",
                *creds,
                src,
                dst,
            ],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr

    hub_creds = ["--src-creds", f"{ADMIN[0]}:{ADMIN[1]}"]
    # Every layer's manifest, ancestors first, keeps its digest: the subject edges still hold.
    for i, link in reversed(list(enumerate(layers))):
        copy(
            f"docker://{hub.address}/admin/pack@{link.digest}",
            f"docker://{registry}/mirror/pack:l{i}",
            hub_creds,
        )
    via_registry = Store(tmp_path / "via-registry")
    with RegistryClient(registry) as client:
        got = pull(via_registry, parse_remote(f"{registry}/mirror/pack:l0"), client)
    assert got.digest == layers[0].digest
    assert via_registry.assemble(got.ref).memory.read_bytes() == images[2].read_bytes()

    back_creds = ["--dest-creds", f"{ADMIN[0]}:{ADMIN[1]}"]
    for i in reversed(range(len(layers))):
        copy(
            f"docker://{registry}/mirror/pack:l{i}",
            f"docker://{hub.address}/admin/back:l{i}",
            back_creds,
        )
    home_again = Store(tmp_path / "home-again")
    with RegistryClient(hub_ref, Credential(*ADMIN)) as client:
        back = pull(home_again, parse_remote(f"{hub.address}/admin/back:l0"), client)
    assert back.digest == layers[0].digest
    assert home_again.assemble(back.ref).memory.read_bytes() == images[2].read_bytes()


def test_oras_downloads_a_forkd_pack_from_the_hub(
    hub: HubServer, chain: tuple[Store, list[Path]], tmp_path: Path
) -> None:
    store, _ = chain
    with RegistryClient(Hub(hub.address, "http"), Credential(*ADMIN)) as client:
        push(store, "p2", parse_remote(f"{hub.address}/admin/orasp:v1"), client)
    hub.public("admin/orasp")
    registry = oras.provider.Registry(hostname=hub.address, insecure=True)
    target = f"{hub.address}/admin/orasp:v1"
    manifest = registry.get_manifest(target)
    head = store.manifest(store.resolve("p2"))
    assert manifest["artifactType"] == "application/vnd.forkd.snapshot.v1"
    assert manifest["subject"]["digest"] == head.subject.digest  # type: ignore[union-attr]
    wanted = [manifest["config"], *manifest["layers"]]
    assert {d["digest"] for d in wanted} == {d.digest for d in head.blobs()}
    out = tmp_path / "oras"
    out.mkdir()
    for d in wanted:
        path = out / d["digest"].split(":")[1]
        registry.download_blob(target, d["digest"], str(path))
        data = path.read_bytes()
        assert "sha256:" + hashlib.sha256(data).hexdigest() == d["digest"]
        assert data == store.blobs.path(d["digest"]).read_bytes()  # byte-identical
