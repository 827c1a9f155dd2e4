"""forkd's own client (forkd.registry) against the hub: a chain of packs, lineage, scopes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from hub_support import HubServer

from forkd.errors import Conflict
from forkd.registry.client import RegistryClient, RegistryError
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store


def test_push_pull_chain_through_the_hub(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
) -> None:
    target = Hub(hub.address, "http")
    remote = parse_remote(f"{target}/{user[0]}/app:v1")
    with RegistryClient(target, Credential(*user)) as client:
        first = push(store, "d3", remote, client)
        assert first.layers == 4 and first.blobs_sent > 0
        again = push(store, "d3", remote, client)
        assert again.blobs_sent == 0  # only missing blobs travel
        other = Store(tmp_path / "other")
        got = pull(other, remote, client)
        assert got.digest == store.resolve("d3")
        assert other.assemble(f"{user[0]}/app:v1").memory.read_bytes() == images[3].read_bytes()

    # Lineage: each diff layer's manifest names its parent as subject; the referrers API
    # finds the children of every ancestor.
    with hub.client(auth=user) as c:
        head = json.loads(c.get(f"/v2/{user[0]}/app/manifests/v1").content)
        parent = head["subject"]["digest"]
        r = c.get(f"/v2/{user[0]}/app/referrers/{parent}")
        assert [d["digest"] for d in r.json()["manifests"]] == [store.resolve("d3")]

    # Someone without rights can neither push nor see it (404 NAME_UNKNOWN, not 403).
    stranger = hub.add_user(f"{user[0]}z")
    with (
        RegistryClient(target, Credential(*stranger)) as client,
        pytest.raises(RegistryError, match="NAME_UNKNOWN"),
    ):
        push(store, "d1", parse_remote(f"{target}/{user[0]}/app:v2"), client)


def _forkd(env: dict[str, str], *args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """The `forkd` command as a user runs it."""
    return subprocess.run(["forkd", *args], env=env, input=stdin, capture_output=True, text=True,
                          timeout=120)


def _blob_count(home: Path) -> int:
    return sum(1 for p in (home / "blobs").rglob("*") if p.is_file())


def test_cli_pull_keeps_a_local_tag_that_names_other_content(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    images: list[Path],
    tmp_path: Path,
) -> None:
    target = Hub(hub.address, "http")
    repo = f"{target}/{user[0]}/app"
    # an unrelated flat layer: blobs the pulling store does not have
    store.import_layer("solo", memory=images[2])
    with RegistryClient(target, Credential(*user)) as client:
        push(store, "d3", parse_remote(f"{repo}:v1"), client)
        push(store, "solo", parse_remote(f"{repo}:solo"), client)
    home = tmp_path / "mine"
    env = {**os.environ, "FORKD_HOME": str(home),
           "FORKD_CREDENTIALS": str(tmp_path / "creds.json")}
    login = _forkd(env, "login", str(target), "-u", user[0], "--password-stdin",
                   stdin=user[1] + "\n")
    assert login.returncode == 0, login.stderr
    assert _forkd(env, "pull", f"{repo}:v1").returncode == 0
    local = f"{user[0]}/app:v1"
    mine = Store(home)
    assert mine.resolve(local) == store.resolve("d3")
    again = _forkd(env, "pull", f"{repo}:v1", "--json")  # the same content: a no-op
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["blobs_sent"] == 0

    blobs = _blob_count(home)
    for args in (["pull", f"{repo}:solo", "--tag", local],  # an explicit local tag
                 ["pull", f"{repo}:solo", "--tag", local, "--json"]):
        refused = _forkd(env, *args)
        assert refused.returncode == Conflict.exit_code, refused.stderr
        assert f"tag {local} exists with other content" in refused.stderr
        assert "--force" in refused.stderr and "Traceback" not in refused.stderr
        assert refused.stdout == ""
    assert mine.resolve(local) == store.resolve("d3")  # untouched
    assert _blob_count(home) == blobs  # refused before any blob travelled

    # the hub's tag moved: pulling it by its default local tag is refused as well
    with RegistryClient(target, Credential(*user)) as client:
        push(store, "solo", parse_remote(f"{repo}:v1"), client)
    moved = _forkd(env, "pull", f"{repo}:v1")
    assert moved.returncode == Conflict.exit_code and local in moved.stderr
    assert mine.resolve(local) == store.resolve("d3")

    forced = _forkd(env, "pull", f"{repo}:v1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert mine.resolve(local) == store.resolve("solo")
    assert mine.assemble(local).memory.read_bytes() == images[2].read_bytes()
    assert "--force" in _forkd(env, "pull", "--help").stdout


def test_a_pulled_compacted_layer_is_listed_as_compacted(
    hub: HubServer, user: tuple[str, str], store: Store, chain: list[str], tmp_path: Path
) -> None:
    target = Hub(hub.address, "http")
    store.compact("d3", "flat")
    with RegistryClient(target, Credential(*user)) as client:
        push(store, "flat", parse_remote(f"{target}/{user[0]}/app:flat"), client)
        push(store, "d3", parse_remote(f"{target}/{user[0]}/app:chain"), client)
        mine = Store(tmp_path / "mine")
        pull(mine, parse_remote(f"{target}/{user[0]}/app:flat"), client)
        pull(mine, parse_remote(f"{target}/{user[0]}/app:chain"), client)
    env = {**os.environ, "FORKD_HOME": str(mine.home)}
    rows = json.loads(_forkd(env, "images", "--json").stdout)
    assert {r["ref"]: r["compacted"] for r in rows} == {
        f"{user[0]}/app:flat": True,
        f"{user[0]}/app:chain": False,
    }


def test_pull_refuses_a_tag_set_meanwhile(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    tmp_path: Path,
) -> None:
    target = Hub(hub.address, "http")
    remote = parse_remote(f"{target}/{user[0]}/race:v1")
    other = Store(tmp_path / "other")
    with RegistryClient(target, Credential(*user)) as client:
        push(store, "d1", remote, client)
        pull(other, parse_remote(f"{target}/{user[0]}/race:v1"), client, local="early")
        push(store, "d3", remote, client)

        def meanwhile(_: int) -> None:  # another process tags the target mid-pull
            other.tag("late", "early", force=True)

        with pytest.raises(Conflict, match="late:latest"):
            pull(other, remote, client, local="late", progress=meanwhile)
        assert other.resolve("late") == store.resolve("d1")
        got = pull(other, remote, client, local="late", force=True)
        assert other.resolve("late") == got.digest == store.resolve("d3")
