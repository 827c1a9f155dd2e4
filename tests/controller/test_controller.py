"""The controller daemon and the SDK against real VMs: `forkd serve` in a subprocess."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_support import tcp_daemon

from forkd import Controller, Sandbox
from forkd.controller.client import RemoteBackend
from forkd.errors import Conflict, InvalidInput, NotFound

REPO = Path(__file__).resolve().parents[2]
TINY_TAG = "tiny:ctl"
TOKEN = "test-token-0123456789-0123456789-0123456789"  # >= 32 bytes
pytestmark = pytest.mark.vm


@pytest.fixture(scope="module")
def daemon(env: dict[str, str], tiny: str) -> Iterator[str]:
    with tcp_daemon(env, Path(env["FORKD_HOME"]) / "serve.log") as url:
        yield url
    assert not Path(env["FORKD_RUN"], "controller.sock").exists()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_every_route_needs_the_token_on_tcp(daemon: str):
    routes = [
        ("GET", "/metrics"),
        ("GET", "/v1/snapshots"),
        ("GET", "/v1/snapshots/tiny:ctl"),
        ("DELETE", "/v1/snapshots/tiny:ctl"),
        ("POST", "/v1/compact"),
        ("POST", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes"),
        ("GET", "/v1/sandboxes/x-1"),
        ("DELETE", "/v1/sandboxes/x-1"),
        ("POST", "/v1/sandboxes/x-1/exec"),
        ("POST", "/v1/sandboxes/x-1/eval"),
        ("PUT", "/v1/sandboxes/x-1/files?path=/x"),
        ("GET", "/v1/sandboxes/x-1/files?path=/x"),
        ("POST", "/v1/sandboxes/x-1/branch"),
    ]
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            resp = httpx.request(method, daemon + path, headers=headers, json={})
            assert resp.status_code == 401, (method, path, headers, resp.text)
            assert resp.headers["www-authenticate"].startswith("Bearer")
    assert httpx.get(f"{daemon}/healthz").json()["status"] == "ok"
    assert "openapi" in httpx.get(f"{daemon}/schema/openapi.json").text


def test_rest_round_trip_with_token(daemon: str, env: dict[str, str]):
    with httpx.Client(base_url=daemon, headers=_auth(), timeout=300) as http:
        snaps = http.get("/v1/snapshots").json()
        assert "tiny:ctl" in [s["ref"] for s in snaps]
        info = http.get("/v1/snapshots/tiny:ctl").json()
        assert info["chain"][0]["tag"] == "tiny:ctl"
        assert http.get("/v1/snapshots/nothing:here").status_code == 404
        made = http.post("/v1/sandboxes", json={"tag": "tiny:ctl", "n": 2})
        assert made.status_code == 201, made.text
        ids = [s["id"] for s in made.json()["sandboxes"]]
        assert len(ids) == 2
        listed = {s["id"]: s for s in http.get("/v1/sandboxes").json()}
        assert set(ids) <= set(listed) and listed[ids[0]]["status"] == "running"
        assert http.get(f"/v1/sandboxes/{ids[0]}").json()["ref"] == "tiny:ctl"
        run = http.post(
            f"/v1/sandboxes/{ids[0]}/exec",
            json={
                "argv": ["/bin/sh", "-c", "cat; echo $X"],
                "env": {"X": "y"},
                "stdin_b64": base64.b64encode(b"in-").decode(),
            },
        ).json()
        assert run["exit_code"] == 0 and run["stdout"] == "in-y\n"
        value = http.post(f"/v1/sandboxes/{ids[0]}/eval", json={"code": "WARM['recipe']"})
        assert value.json()["value"] == "tiny"
        put = http.put(
            f"/v1/sandboxes/{ids[1]}/files", params={"path": "/tmp/f"}, content=b"\x00\x01data"
        )
        assert put.status_code == 204
        got = http.get(f"/v1/sandboxes/{ids[1]}/files", params={"path": "/tmp/f"})
        assert got.content == b"\x00\x01data"
        missing = http.get(f"/v1/sandboxes/{ids[0]}/files", params={"path": "/tmp/f"})
        assert missing.status_code == 404, missing.text  # isolated
        assert missing.json()["error"]["type"] == "NotFound"
        branched = http.post(f"/v1/sandboxes/{ids[1]}/branch", json={"tag": "tiny:branched"})
        assert branched.status_code == 201, branched.text
        assert branched.json()["depth"] == 1
        compacted = http.post("/v1/compact", json={"ref": "tiny:branched", "to": "tiny:flat"})
        assert compacted.status_code == 201 and compacted.json()["depth"] == 0
        refused = http.delete("/v1/snapshots/tiny:ctl")
        assert refused.status_code == 409 and "cascade" in refused.json()["error"]["message"]
        assert (
            http.delete("/v1/snapshots/tiny:flat").json()["removed"] == ["tiny:flat:latest"]
            or http.get("/v1/snapshots/tiny:flat").status_code == 404
        )
        for sid in ids:
            assert http.delete(f"/v1/sandboxes/{sid}").status_code == 200
        assert http.get(f"/v1/sandboxes/{ids[0]}").status_code == 404
        assert http.post("/v1/sandboxes", json={"tag": "tiny:ctl", "n": 0}).status_code == 400
        assert http.post("/v1/sandboxes", json={"tag": "ghost"}).status_code == 404
        metrics = http.get("/metrics").text
        assert "forkd_controller_sandboxes_spawned_total 2.0" in metrics
    audit = Path(env["FORKD_HOME"], "controller-audit.log").read_text()
    assert '"action":"sandbox.create"' in audit and '"result":"denied"' in audit
    creates = [json.loads(line) for line in audit.splitlines() if '"sandbox.create"' in line]
    assert all(e["actor"] == "tcp" and e["ip"].startswith("127.0.0.1:") for e in creates)


def test_sdk_over_the_daemon(daemon: str):
    ctl = Controller(url=daemon, token=TOKEN)
    assert ctl.remote
    sandboxes = ctl.spawn_sandboxes("tiny:ctl", 2)
    try:
        a, b = sandboxes
        assert a.eval("import os; os.urandom(16).hex()") != b.eval(
            "import os; os.urandom(16).hex()"
        )
        result = a.commands.run("echo hello >&2; exit 3")
        assert (result.exit_code, result.stderr) == (3, "hello\n")
        a.files.write("/tmp/note", "from the sdk")
        assert a.files.read("/tmp/note") == b"from the sdk"
        assert result.status == "exited" and result.duration is not None and result.duration > 0
        with pytest.raises(NotFound):
            a.files.read("/tmp/no-such-file")
        branch = ctl.branch_sandbox(a.id, "tiny:sdk-branch")
        assert branch.depth == 1
        with pytest.raises(Conflict):
            a.branch("tiny:sdk-branch")
        assert a.branch("tiny:sdk-branch", force=True).ref.startswith("tiny:sdk-branch")
        with Sandbox("tiny:sdk-branch", controller=ctl) as child:
            assert child.files.read("/tmp/note") == b"from the sdk"
            gone = child.id
        assert gone not in [s.id for s in ctl.sandboxes()]
    finally:
        for sb in sandboxes:
            sb.kill()
    with pytest.raises(NotFound):
        Sandbox(controller=ctl, sandbox_id="nope-1").eval("1")
    with pytest.raises(InvalidInput):
        ctl.spawn_sandboxes("tiny:ctl", 0)


def test_sdk_without_a_daemon_runs_locally(env: dict[str, str], tiny: str, tmp_path: Path):
    ctl = Controller(socket=tmp_path / "none.sock")
    assert not ctl.remote
    with Sandbox(tiny, controller=ctl) as sb:
        assert sb.eval("1 + 1") == 2
        assert sb.commands.run(["/bin/echo", "x"]).stdout == "x\n"


def test_cli_talks_to_the_unix_socket(daemon: str, env: dict[str, str]):
    backend = RemoteBackend(socket=Path(env["FORKD_RUN"]) / "controller.sock")
    try:
        assert backend.alive()
        assert any(
            s.ref == "tiny:ctl:latest" or s.ref == "tiny:ctl" for s in backend.snapshots()
        )
    finally:
        backend.close()


def test_cli_goes_through_a_running_daemon(daemon: str, env: dict[str, str]):
    run_env = {**os.environ, **env}
    proc = subprocess.run(
        ["forkd", "fork", "tiny:ctl", "-n", "1", "--json"],
        env=run_env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    child = json.loads(proc.stdout)["children"][0]["id"]
    listed = subprocess.run(
        ["forkd", "ls", "--json"],
        env=run_env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert child in [c["id"] for c in json.loads(listed.stdout)]
    out = subprocess.run(
        ["forkd", "exec", child, "--", "cat", "/etc/forkd-recipe"],
        env=run_env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert out.stdout == "tiny\n"
    killed = subprocess.run(
        ["forkd", "kill", child],
        env=run_env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )
    assert killed.returncode == 0, killed.stderr
    audit = Path(env["FORKD_HOME"], "controller-audit.log").read_text().splitlines()
    entries = [json.loads(line) for line in audit]
    mine = [e for e in entries if child in (e["target"], *e.get("ids", []))]
    assert {e["action"] for e in mine} >= {"sandbox.create", "sandbox.exec", "sandbox.delete"}
    assert all(e["actor"] == "unix-socket" for e in mine)


def test_streamed_output_arrives_while_the_command_runs(daemon: str):
    """The command waits for a file that the test writes only once it has seen the first
    line: with output held back until the end it would time out instead."""
    ctl = Controller(url=daemon, token=TOKEN)
    with Sandbox(TINY_TAG, controller=ctl) as sb:
        seen: list[str] = []
        errors: list[str] = []

        def on_stdout(text: str) -> None:
            seen.append(text)
            if "ready" in text:
                sb.files.write("/tmp/go", "")  # a second request while the first runs

        result = sb.commands.run(
            "echo ready; while [ ! -e /tmp/go ]; do sleep 0.1; done; echo done >&2; exit 4",
            timeout=120,
            on_stdout=on_stdout,
            on_stderr=errors.append,
        )
        assert (result.status, result.exit_code, result.timed_out) == ("exited", 4, False)
        assert "".join(seen) == "ready\n" and "".join(errors) == "done\n"
        # the REST stream itself: NDJSON frames, the last one the result
        body = {"argv": ["sh", "-c", "echo one; echo two >&2"]}
        with httpx.Client(base_url=daemon, headers=_auth(), timeout=120) as http, http.stream(
            "POST", f"/v1/sandboxes/{sb.id}/exec/stream", json=body
        ) as resp:
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            frames = [json.loads(line) for line in resp.iter_lines() if line]
        assert frames[-1]["result"]["exit_code"] == 0
        assert "".join(f.get("stdout", "") for f in frames) == "one\n"
        assert "".join(f.get("stderr", "") for f in frames) == "two\n"
        bad = httpx.post(f"{daemon}/v1/sandboxes/nope-1/exec/stream", headers=_auth(),
                         json={"argv": ["true"]})
        assert bad.status_code == 404


def test_a_command_longer_than_the_client_timeout_completes_through_the_daemon(daemon: str):
    """RemoteBackend(timeout=2): a 4 s command with its own 60 s timeout still completes
    (the client waits the command's timeout + api.ANSWER_GRACE_S), streamed or not."""
    with Sandbox(TINY_TAG, controller=Controller(url=daemon, token=TOKEN)) as spawned:
        short = Controller(url=daemon, token=TOKEN)
        short.backend = RemoteBackend(url=daemon, token=TOKEN, timeout=2.0)
        sb = Sandbox(controller=short, sandbox_id=spawned.id)
        done = sb.commands.run("sleep 4; echo slept", timeout=60)
        assert (done.exit_code, done.stdout) == (0, "slept\n")
        assert done.duration is not None and done.duration >= 4
        streamed: list[str] = []
        done = sb.commands.run("sleep 4; echo slept", on_stdout=streamed.append)
        assert done.exit_code == 0 and streamed == ["slept\n"]
