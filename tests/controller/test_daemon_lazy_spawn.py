"""``lazy`` on the REST spawn and the SDK, through a real `forkd serve` whose store has
never seen the pack, against a real loopback hub (tests/hub_server.py): the sandboxes are
forked lazily (their memory is the lazy server's FUSE file) and answer; a tag that is not
a hub reference, or lazy with prewarm, is a 400 that says what to write instead. The daemon
keeps a spare lazy server waiting (engine/lazy/spare.py, SpareKeeper): the first lazy spawn
takes it, and another comes to wait."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemon_support import socket_daemon
from hub_server import HubServer
from spare_support import end_spares

from forkd import Controller, Sandbox
from forkd.store.store import Store

TINY_TAG = "tiny:lazyctl"
TOKEN = "test-token-lazy-0123456789-0123456789-0123"  # >= 32 bytes
PREFETCH_TIMEOUT = 300.0
pytestmark = pytest.mark.vm


@dataclass
class LazyDaemon:
    http: httpx.Client
    sock: Path
    ref: str  # the pack on the hub, HUB/NS/NAME:TAG
    local: str  # the tag the lazy path gives the chain once it is complete
    fresh: Store  # the daemon's store: it has never seen the pack
    run: Path  # the daemon's run directory


def _sock(run: Path) -> Path:
    return run / "controller.sock"


@pytest.fixture(scope="module")
def lazy_daemon(env: dict[str, str], tiny: str,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[LazyDaemon]:
    """The tiny snapshot pushed to a public repository of a hub of this module, and a
    daemon on an empty store, with no default hub configured and that hub in
    FORKD_LAZY_HUBS."""
    from forkd.engine import children as ch

    base = tmp_path_factory.mktemp("lazyd")
    hub = HubServer(base / "hub").start()
    fresh = Store(base / "fresh")
    daemon_env = {**os.environ, **env, "FORKD_HOME": str(fresh.home),
                  "FORKD_RUN": str(base / "run"), "XDG_CONFIG_HOME": str(base / "config"),
                  "FORKD_LAZY_HUBS": hub.address}  # no default hub, no login: listed
    daemon_env.pop("FORKD_HUB", None)
    proc = None
    try:
        who = hub.add_user("lazyctl")
        hub.push(Store.open(), tiny, "lazyctl/tiny:v1", who)
        hub.public("lazyctl/tiny")
        proc = socket_daemon(daemon_env, base / "serve.log")
        sock = _sock(base / "run")
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd",
                          timeout=300) as http:
            yield LazyDaemon(http, sock, f"{hub.address}/lazyctl/tiny:v1", "lazyctl/tiny:v1", fresh,
                             base / "run")
    finally:
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        ch.kill_all(fresh)
        hub.stop()
    assert end_spares(base / "run") == [], "spare lazy servers left behind"


def _lazy_memory(fresh: Store, info: dict[str, object]) -> None:
    memory = str(info["memory"])
    assert memory.startswith(str(fresh.home / "lazy")), memory  # the FUSE file, not assembled
    assert memory.endswith("/mnt/memory.img"), memory


def _waiting_spare(run: Path, but: int | None = None) -> int:
    """The pid of the spare lazy server waiting in ``run`` (not ``but``)."""
    pid_file = run / "lazy" / "spare.pid"
    deadline = time.monotonic() + 120
    while True:
        try:
            pid = int(pid_file.read_text())
            if pid != but:
                return pid
        except (OSError, ValueError):
            pass
        assert time.monotonic() < deadline, "the daemon keeps no spare lazy server waiting"
        time.sleep(0.1)


def _wait_for_tag(http: httpx.Client, tag: str) -> None:
    deadline = time.monotonic() + PREFETCH_TIMEOUT
    while tag not in [layer["ref"] for layer in http.get("/v1/snapshots").json()]:
        assert time.monotonic() < deadline, f"the prefetch did not tag {tag}"
        time.sleep(0.5)


def test_rest_and_sdk_spawn_lazily(lazy_daemon: LazyDaemon) -> None:
    """REST ``lazy: true`` and the SDK's ``Sandbox(ref, lazy=True)``: forked on the lazy
    server's memory file, they answer; once the prefetch has the whole chain it is a local
    tag, and a lazy spawn of that local tag is refused (no hub to fetch from)."""
    http, fresh = lazy_daemon.http, lazy_daemon.fresh
    spare = _waiting_spare(lazy_daemon.run)
    got = http.post("/v1/sandboxes", json={"tag": lazy_daemon.ref, "lazy": True})
    assert got.status_code == 201, got.text
    (info,) = got.json()["sandboxes"]
    try:
        _lazy_memory(fresh, info)
        (ready,) = (fresh.home / "lazy").glob("*/ready.json")
        assert json.loads(ready.read_text())["pid"] == spare, "the spawn did not take the spare"
        _waiting_spare(lazy_daemon.run, but=spare)  # and the keeper has the next one waiting
        answer = http.post(f"/v1/sandboxes/{info['id']}/eval", json={"code": "6 * 7"})
        assert answer.status_code == 200 and answer.json()["value"] == 42, answer.text
        ctl = Controller(socket=lazy_daemon.sock, local=False)
        with Sandbox(lazy_daemon.ref, controller=ctl, lazy=True) as sb:
            _lazy_memory(fresh, http.get(f"/v1/sandboxes/{sb.id}").json())
            assert sb.eval("6 * 7") == 42
        _wait_for_tag(http, lazy_daemon.local)
        refused = http.post("/v1/sandboxes", json={"tag": lazy_daemon.local, "lazy": True})
        assert refused.status_code == 400, refused.text
        assert "local snapshot tag" in refused.json()["error"]["message"]
    finally:
        http.delete(f"/v1/sandboxes/{info['id']}")


@pytest.mark.parametrize(("body", "said"), [
    ({"tag": "nohub/tiny:v1", "lazy": True}, "names no hub"),
    ({"tag": "nohub:v1", "lazy": True}, "hub reference"),
    ({"tag": "127.0.0.1:9/ns/name:v1", "lazy": True, "prewarm": 2}, "prewarm"),
    ({"tag": "10.9.8.7:5000/ns/name:v1", "lazy": True}, "FORKD_LAZY_HUBS"),  # not listed
])
def test_bad_lazy_spawns_are_a_400(lazy_daemon: LazyDaemon, body: dict[str, object],
                                   said: str) -> None:
    got = lazy_daemon.http.post("/v1/sandboxes", json=body)
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] == "InvalidInput" and said in error["message"], error
