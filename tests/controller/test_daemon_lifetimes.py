"""Lifetimes and pause/resume through the daemon: REST timeout/extend/pause/resume, the SDK,
and a deadline the daemon enforces across its own restart (it is in the child's record)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from daemon_support import socket_daemon

from forkd import Controller, Sandbox
from forkd.engine import watchdog

TOKEN = "life-token-0123456789-0123456789-0123456789"  # >= 32 bytes
TINY_TAG = "tiny:life"
pytestmark = pytest.mark.vm


def _until(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _start(env: dict[str, str]) -> subprocess.Popen[bytes]:
    return socket_daemon({**os.environ, **env}, Path(env["FORKD_HOME"]) / "serve.log", 30)


def _client(env: dict[str, str]) -> httpx.Client:
    sock = Path(env["FORKD_RUN"], "controller.sock")
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd",
                        timeout=300)


@pytest.fixture
def daemon(env: dict[str, str], tiny: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = _start(env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)


def _ids(http: httpx.Client) -> dict[str, dict[str, object]]:
    return {s["id"]: s for s in http.get("/v1/sandboxes").json()}


def test_rest_timeout_extend_pause_resume(env: dict[str, str], daemon: object, tiny: str):
    http = _client(env)
    bad = http.post("/v1/sandboxes", json={"tag": tiny, "timeout": 0})
    assert bad.status_code == 400 and "timeout" in bad.json()["error"]["message"]
    bad = http.post("/v1/sandboxes", json={"tag": tiny, "cpus": -1})
    assert bad.status_code == 400
    r = http.post("/v1/sandboxes", json={"tag": tiny, "n": 2, "timeout": 4, "cpus": 1.5})
    assert r.status_code == 201, r.text
    short, kept = (s["id"] for s in r.json()["sandboxes"])
    assert http.post(f"/v1/sandboxes/{kept}/extend", json={"seconds": 600}).status_code == 200
    _until("the daemon's sweeper to kill the short one", lambda: short not in _ids(http), 60)
    assert _ids(http)[kept]["status"] == "running"
    assert _ids(http)[kept]["limits"] == {"cpus": 1.5}
    http.post(f"/v1/sandboxes/{kept}/exec",
              json={"argv": ["sh", "-c", "echo hi > /root/x && sync"]}).raise_for_status()
    p = http.post(f"/v1/sandboxes/{kept}/pause")
    assert p.status_code == 200 and p.json()["status"] == "paused", p.text
    dead = http.post(f"/v1/sandboxes/{kept}/exec", json={"argv": ["true"]})
    assert dead.status_code == 409 and "paused" in dead.json()["error"]["message"], dead.text
    assert dead.json()["error"]["exit_code"] == 15  # ChildDead's, a Conflict
    back = http.post(f"/v1/sandboxes/{kept}/resume").json()
    assert back["status"] == "running"
    assert back["timeout_s"] == 604 and back["time_left_s"] > 590  # the extension is kept
    assert http.post(f"/v1/sandboxes/{kept}/resume").status_code == 409
    out = http.post(f"/v1/sandboxes/{kept}/exec", json={"argv": ["cat", "/root/x"]}).json()
    assert out["stdout"] == "hi\n"
    # the SDK over the same daemon
    ctl = Controller(socket=Path(env["FORKD_RUN"], "controller.sock"))
    assert ctl.remote
    sb = Sandbox(tiny, controller=ctl, timeout=300, pids_max=512)
    left = sb.time_left()
    assert left is not None and 250 < left <= 300
    left = sb.extend(100).time_left_s
    assert left is not None and left > 350
    sb.pause()
    sb.resume()
    assert sb.commands.run("echo ok").stdout == "ok\n"
    sb.kill()
    assert http.delete(f"/v1/sandboxes/{kept}").status_code == 200
    assert not [i for i in _ids(http)]


def test_deadline_is_enforced_across_a_daemon_restart(env: dict[str, str], tiny: str):
    first = _start(env)
    try:
        http = _client(env)
        r = http.post("/v1/sandboxes", json={"tag": tiny, "timeout": 5})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxes"][0]["id"]
        pid = r.json()["sandboxes"][0]["pid"]
    finally:
        first.send_signal(signal.SIGKILL)  # no clean stop: nothing hands the deadline on
        first.wait(30)
    time.sleep(7)  # the deadline passes while no daemon (and no watchdog) runs
    assert watchdog.running_pid() is None
    assert sid in _ids_local()
    second = _start(env)
    try:
        _until("the restarted daemon to kill the expired sandbox",
               lambda: sid not in _ids(_client(env)), 30)
        assert not Path(f"/proc/{pid}").exists() or b"qemu" not in Path(
            f"/proc/{pid}/cmdline").read_bytes()
    finally:
        second.terminate()
        second.wait(30)


def _ids_local() -> set[str]:
    from forkd.engine import children as ch

    return {c.id for c in ch.list_children()}
