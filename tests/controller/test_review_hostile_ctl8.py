"""The controller against the tenth hostile review: what a daemon's answer may do to its
clients, the Python client (RemoteBackend, under the CLI, the SDK and `forkd mcp`) and the
TypeScript SDK, and what a request's values are. Whatever answers at the URL (another
server, a proxy, a daemon gone wrong) is read within a bound (an answer, an error, a
streamed line), an answer of another shape is the client's error (never an exception of
its parser, never the end of a Node process), and an error never has a success's exit
code. A request's number is a number as the schema says (``"n": "2"``, ``2.0``,
``?mode=4.2e2``, ``?cascade=1`` were converted leniently, past a proxy that reads them as
text), a streamed command's error frame hides the host's paths as an error answer does,
the daemon's token from its environment reaches no process it starts, and the sandboxes
of a spawn whose client left are killed. No VM: the
real clients over real HTTP against a server on uvicorn that answers what each test makes
it answer, the real daemon app on its Unix socket (a sandbox there is a record whose
"QEMU" is a process the test starts), and `forkd serve`."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from daemon_support import SlowEngine, running
from net_support import free_port, wait_healthy, wait_until

from forkd.audit import AuditLog
from forkd.controller import app, client, server
from forkd.controller.api import ExecRequest
from forkd.controller.backend import LocalBackend
from forkd.controller.client import ControllerError, RemoteBackend
from forkd.engine import children as ch
from forkd.engine.lifecycle import ChildInfo
from forkd.engine.paths import children_dir
from forkd.errors import ForkdError
from forkd.store.store import Store

SDK = Path(__file__).resolve().parents[2] / "sdk" / "typescript" / "src" / "index.js"
BODY_CAP = 24 << 20  # what an endless answer sends at most before it ends on its own
CHUNK = 64 << 10


@dataclass
class Answer:
    """What the hostile server answers every request with: its status and body parts,
    endless (``endless``, up to BODY_CAP, after ``parts``) or not; ``sent`` counts bytes."""

    status: int = 200
    parts: list[bytes] = field(default_factory=list)
    endless: bytes = b""
    sent: int = 0


def hostile_app(answer: Answer) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": answer.status,
                    "headers": [(b"content-type", b"application/json")]})
        for part in answer.parts:
            answer.sent += len(part)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        while answer.endless and answer.sent < BODY_CAP:
            answer.sent += len(answer.endless)
            await send({"type": "http.response.body", "body": answer.endless,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.fixture
def hostile() -> Iterator[tuple[str, Answer]]:
    """A server (its URL) answering every request with the Answer the test fills in."""
    answer = Answer()
    port = free_port()
    config = uvicorn.Config(hostile_app(answer), host="127.0.0.1", port=port,
                            log_level="warning", lifespan="off")
    with running(uvicorn.Server(config)):
        yield f"http://127.0.0.1:{port}", answer


def remote(url: str) -> RemoteBackend:
    return RemoteBackend(url=url, token="t" * 43)


# -- the Python client --------------------------------------------------------------
def test_an_answer_that_is_not_json_is_the_clients_error(
        hostile: tuple[str, Answer]) -> None:
    """A 200 that is not JSON (a web server's page at the URL) raised msgspec's DecodeError
    out of RemoteBackend: no ForkdError, so the CLI ended in a traceback."""
    url, answer = hostile
    answer.parts = [b"<html>not a daemon</html>"]
    with pytest.raises(ControllerError, match="unexpected shape"):
        remote(url).snapshots()


def test_a_streamed_line_that_is_not_a_frame_is_the_clients_error(
        hostile: tuple[str, Answer]) -> None:
    url, answer = hostile
    answer.parts = [b'{"stdout": "a"}\n', b"<html>\n"]
    frames = remote(url).exec_stream("sb-1", ExecRequest(argv=["true"]))
    assert next(frames).stdout == "a"
    with pytest.raises(ControllerError, match="not a frame"):
        next(frames)


@pytest.mark.parametrize("code", [0, 256, -1, 4096])
def test_an_error_never_has_a_success_exit_code(
        hostile: tuple[str, Answer], code: int) -> None:
    """An error answered with exit code 0 (or 256, which a shell reads as 0) made `forkd`
    print the error and exit 0 (cli.errors: sys.exit(exc.exit_code)); a failure's own
    exit code is kept."""
    url, answer = hostile
    answer.status = 500
    for given, kept in ((code, 1), (13, 13)):
        answer.parts = [b'{"error": {"type": "Odd", "message": "m", "exit_code": %d}}' % given]
        with pytest.raises(ControllerError) as failed:
            remote(url).snapshots()
        assert failed.value.exit_code == kept


def test_an_endless_answer_is_read_within_its_bound(
        hostile: tuple[str, Answer], monkeypatch: pytest.MonkeyPatch) -> None:
    """RemoteBackend read an answer whole (httpx's .content), whatever its size: an endless
    one held all of it in the client's memory. Read to MAX_ANSWER_BYTES (made small here)."""
    url, answer = hostile
    monkeypatch.setattr(client, "MAX_ANSWER_BYTES", 1 << 20)
    answer.parts, answer.endless = [b"["], b"0," * (CHUNK // 2)
    with pytest.raises(ControllerError, match="more than 1048576 bytes"):
        remote(url).snapshots()


def test_a_health_check_reads_no_body(hostile: tuple[str, Answer]) -> None:
    """RemoteBackend.alive (the SDK's and `forkd serve`'s check for a daemon) read the
    /healthz answer whole: an endless one (BODY_CAP here) was all held in memory. Its
    status is what it asks; the body is not read."""
    import tracemalloc

    url, answer = hostile
    answer.parts, answer.endless = [b"ok"], b"a" * CHUNK
    tracemalloc.start()
    try:
        assert remote(url).alive()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < BODY_CAP // 4, f"alive() held {peak} bytes of an endless answer"


def test_an_endless_error_is_read_within_its_bound(hostile: tuple[str, Answer]) -> None:
    url, answer = hostile
    answer.status = 500
    answer.parts, answer.endless = [b'{"error": {"message": "'], b"a" * CHUNK
    with pytest.raises(ControllerError, match=f"more than {client.MAX_ERROR_BYTES} bytes"):
        remote(url).snapshots()


def test_a_streamed_line_without_end_is_read_within_its_bound(
        hostile: tuple[str, Answer]) -> None:
    """httpx's iter_lines held a line until its end: one without end grew for ever."""
    url, answer = hostile
    answer.parts, answer.endless = [b'{"stdout": "'], b"a" * CHUNK
    frames = remote(url).exec_stream("sb-1", ExecRequest(argv=["true"]))
    with pytest.raises(ControllerError, match=f"more than {client.MAX_FRAME_BYTES} bytes"):
        next(frames)


def test_a_compressed_answer_is_not_inflated(hostile: tuple[str, Answer]) -> None:
    """The client asks for answers as they are (Accept-Encoding: identity) and reads them
    so: a 64 KiB gzip answer was 64 MiB once httpx decoded it, past every bound."""
    url, answer = hostile
    import gzip
    answer.parts = [gzip.compress(b"[]")]
    with pytest.raises(ForkdError, match="unexpected shape"):
        remote(url).snapshots()


# -- the TypeScript SDK -------------------------------------------------------------
def run_node(url: str, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` (its top-level await's ``ctl`` a Controller of ``url``) in Node."""
    from test_typescript_sdk import node

    prelude = (f'import {{ Controller, Sandbox, ForkdError }} from "{SDK.as_uri()}";\n'
               f'const ctl = new Controller({{ url: "{url}", token: "{"t" * 43}" }});\n')
    return subprocess.run([node(), "--input-type=module", "-e", prelude + script],
                          capture_output=True, text=True, timeout=120)


REJECTION = """
try {
  await %s;
  console.log("resolved");
} catch (e) {
  console.log(JSON.stringify({forkd: e instanceof ForkdError, exit: e?.exitCode ?? null,
                              message: String(e?.message ?? e)}));
}
"""


def rejection(url: str, call: str) -> dict[str, Any]:
    done = run_node(url, REJECTION % call)
    assert done.returncode == 0, f"the Node process ended: {done.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("body", [b'{"detail": "bad gateway"}', b"{}"])
def test_node_an_error_of_another_shape_is_a_rejection(
        hostile: tuple[str, Answer], body: bytes) -> None:
    """An error body without ``error`` (a proxy's) threw in the answer's "end" handler,
    outside any promise: the whole Node process ended, not the one call."""
    url, answer = hostile
    answer.status, answer.parts = 502, [body]
    got = rejection(url, "ctl.snapshots()")
    assert got["forkd"] and got["exit"] == 1, got


@pytest.mark.parametrize("kind", ["constructor", "toString", "__proto__", "hasOwnProperty"])
def test_node_an_error_type_is_a_family_only_of_its_own(
        hostile: tuple[str, Answer], kind: str) -> None:
    """FAMILIES[type] found Object's own members: "constructor" rejected with a String (not
    an Error), "toString" threw a TypeError in the "end" handler (the process ended)."""
    url, answer = hostile
    answer.status = 400
    answer.parts = [b'{"error": {"type": "%s", "message": "m", "exit_code": 2}}'
                    % kind.encode()]
    got = rejection(url, "ctl.snapshots()")
    assert got == {"forkd": True, "exit": 2, "message": "m"}


@pytest.mark.parametrize("code", [0, 256, -1])
def test_node_an_error_never_has_a_success_exit_code(
        hostile: tuple[str, Answer], code: int) -> None:
    url, answer = hostile
    answer.status = 400
    answer.parts = [b'{"error": {"type": "InvalidInput", "message": "m", "exit_code": %d}}'
                    % code]
    assert rejection(url, "ctl.snapshots()")["exit"] == 1


STREAM = 'Sandbox.connect("sb-1", { controller: ctl }).commands.run("x", { onStdout() {} })'


def test_node_a_streamed_line_that_is_not_json_is_a_rejection(
        hostile: tuple[str, Answer]) -> None:
    """JSON.parse of a streamed line ran in the answer's "data" handler: a line that is not
    JSON ended the Node process."""
    url, answer = hostile
    answer.parts = [b'{"stdout": "a"}\n', b"<html>\n"]
    got = rejection(url, STREAM)
    assert got["forkd"] and "not JSON" in got["message"], got


def test_node_a_streamed_line_without_end_is_read_within_its_bound(
        hostile: tuple[str, Answer]) -> None:
    url, answer = hostile
    answer.parts, answer.endless = [b'{"stdout": "'], b"a" * CHUNK
    got = rejection(url, STREAM)
    assert got["forkd"] and "more than 1048576 bytes" in got["message"], got


def test_node_an_endless_error_is_read_within_its_bound(hostile: tuple[str, Answer]) -> None:
    url, answer = hostile
    answer.status = 500
    answer.parts, answer.endless = [b'{"error": {"message": "'], b"a" * CHUNK
    got = rejection(url, "ctl.snapshots()")
    assert got["forkd"] and "more than 1048576 bytes" in got["message"], got


def test_node_an_answer_that_is_not_json_is_a_forkd_error(
        hostile: tuple[str, Answer]) -> None:
    url, answer = hostile
    answer.parts = [b"<html>not a daemon</html>"]
    got = rejection(url, "ctl.snapshots()")
    assert got["forkd"] and "not JSON" in got["message"], got


# -- the daemon: a request's values of their declared type ---------------------------
@pytest.fixture
def daemon(place: Path, tmp_path: Path) -> Iterator[httpx.Client]:
    """A client of the real daemon app on its Unix socket (no sandbox, no tag)."""
    sock = place / "ctl.sock"
    web = app.create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "a.log"),
                         app.ControllerMetrics(), None)
    config = server.bounded_config(web, server.UnixPeerProtocol, uds=str(sock))
    with running(uvicorn.Server(config)), httpx.Client(
            transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://forkd",
            timeout=30) as http:
        yield http


LENIENT_BODIES = [
    ("/v1/sandboxes", '{"tag": "nope:x", "n": "2"}', '{"tag": "nope:x", "n": 2}', "$.n"),
    ("/v1/sandboxes", '{"tag": "nope:x", "n": 2.0}', '{"tag": "nope:x", "n": 2}', "$.n"),
    ("/v1/sandboxes", '{"tag": "nope:x", "timeout": "1e9"}', '{"tag": "nope:x", "timeout": 9}',
     "$.timeout"),
    ("/v1/sandboxes/abc/extend", '{"seconds": "5"}', '{"seconds": 5}', "$.seconds"),
    ("/v1/sandboxes/abc/exec", '{"argv": ["true"], "timeout": "60"}',
     '{"argv": ["true"], "timeout": 60.5}', "$.timeout"),
    ("/v1/pools", '{"tag": "nope:x", "k": "1"}', '{"tag": "nope:x", "k": 1}', "$.k"),
]


@pytest.mark.parametrize(("route", "lenient", "declared", "where"), LENIENT_BODIES)
def test_a_json_value_of_another_type_is_refused(
        daemon: httpx.Client, route: str, lenient: str, declared: str, where: str) -> None:
    """Litestar converted ``"n": "2"`` and ``"timeout": "1e9"`` to numbers, which a proxy
    or policy in front reading the body as the schema declares it took for text: the
    request went on to spawn (here, a 404 for the missing tag) instead of a 400."""
    headers = {"content-type": "application/json"}
    r = daemon.post(route, content=declared, headers=headers)
    assert r.status_code in (404, 400) and "type docs/api.md" not in r.text, r.text
    r = daemon.post(route, content=lenient, headers=headers)
    assert r.status_code == 400, r.text
    assert where in r.json()["error"]["message"]


@pytest.mark.parametrize(("method", "route", "name", "lenient", "declared"), [
    ("PUT", "/v1/sandboxes/abc/files", "mode", "420.0", "420"),
    ("PUT", "/v1/sandboxes/abc/files", "mode", "4.2e2", "420"),
    ("PUT", "/v1/sandboxes/abc/files", "mode", "-0", "0"),
    ("DELETE", "/v1/snapshots/nope:x", "cascade", "1", "true"),
    ("DELETE", "/v1/snapshots/nope:x", "cascade", "True", "false"),
])
def test_a_query_number_or_flag_is_written_one_way(
        daemon: httpx.Client, method: str, route: str, name: str, lenient: str,
        declared: str) -> None:
    """``?mode=4.2e2`` wrote the file 0644 and ``?cascade=1`` removed what depends on a
    tag, where a proxy or log in front saw text that is not the number or flag."""
    params = {name: declared, **({"path": "/a"} if name == "mode" else {})}
    r = daemon.request(method, route, params=params, content=b"x" if method == "PUT" else None)
    assert r.status_code == 404, r.text  # the request went on: no such sandbox or tag
    params[name] = lenient
    r = daemon.request(method, route, params=params, content=b"x" if method == "PUT" else None)
    assert r.status_code == 400, r.text
    assert f"query parameter '{name}'" in r.json()["error"]["message"]


# -- the daemon: an error said one way, however it is sent ----------------------------
@pytest.fixture
def unreachable(place: Path) -> Iterator[str]:
    """A sandbox whose "QEMU" (a process this test starts) runs and whose agent cannot be
    reached: its relay exits at once, saying so with its directory's path."""
    d = children_dir() / "sb-unreachable"
    d.mkdir(parents=True)
    qemu = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                             str(d / "qmp.sock")], start_new_session=True)
    try:
        ChildInfo(id=d.name, ref="tiny:latest", digest="sha256:" + "0" * 64, pid=qemu.pid,
                  dir=str(d), memory=str(d / "mem"), disk_backing="-", memory_mib=128,
                  created=time.time()).save()
        yield d.name
    finally:
        qemu.kill()
        qemu.wait()


def test_a_streamed_commands_error_hides_the_host_paths_as_an_answer_does(
        daemon: httpx.Client, unreachable: str, place: Path) -> None:
    """POST …/exec answered the failure with $FORKD_RUN for the run directory
    (hidden_host_paths, in error_response); the same failure in …/exec/stream's error
    frame named the host's path (ndjson made its frame without it)."""
    body = {"argv": ["true"]}
    answered = daemon.post(f"/v1/sandboxes/{unreachable}/exec", json=body)
    assert answered.status_code == 409 and "$FORKD_RUN" in answered.text, answered.text
    streamed = daemon.post(f"/v1/sandboxes/{unreachable}/exec/stream", json=body)
    frame = json.loads(streamed.text.strip().splitlines()[-1])
    message = frame["error"]["message"]
    assert "$FORKD_RUN" in message and str(place) not in message, message


# -- the daemon: its token passed on to no process it starts --------------------------
def _environ(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (started from any of its threads)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def test_the_daemons_token_reaches_no_process_it_starts(place: Path) -> None:
    """`forkd serve` starts a spare lazy page server (engine/lazy/spare.py) with its whole
    environment, $FORKD_CONTROLLER_TOKEN in it: a process that serves guests' memory held
    the token of every sandbox of the daemon (and so will a lazy spawn's, the watchdog)."""
    token = "env-token-0123456789-0123456789-0123456789"
    env = {"FORKD_HOME": os.environ["FORKD_HOME"], "FORKD_RUN": os.environ["FORKD_RUN"],
           "FORKD_CONTROLLER_TOKEN": token, "FORKD_MARK": "ctl8"}
    with serving(env, place / "serve.log") as url:
        r = httpx.get(f"{url}/v1/sandboxes", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text  # the token it was given is the one it takes
        daemon = next(int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
                      and _is_this_daemon(int(p.name), url))
        wait_until("the daemon's spare lazy server", lambda: bool(_children(daemon)), 30)
        for child in _children(daemon):
            got = _environ(child)
            assert b"FORKD_MARK=ctl8" in got  # it has the daemon's environment...
            assert not any(e.startswith(b"FORKD_CONTROLLER_TOKEN=") for e in got)  # ...but


@contextlib.contextmanager
def serving(env: dict[str, str], log: Path) -> Iterator[str]:
    """`forkd serve --listen` of this checkout (this interpreter's forkd, whatever `forkd`
    is on PATH) with ``env`` over the environment; its URL once /healthz answers."""
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "forkd.cli", "serve", "--listen",
                                 f"127.0.0.1:{port}"], env={**os.environ, **env}, stdout=out,
                                stderr=out, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, "forkd serve", 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(15)


def _is_this_daemon(pid: int, url: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"serve" in argv and url.rsplit("//", 1)[1].encode() in argv


# -- the daemon: a spawn whose client left ---------------------------------------------
def test_the_sandboxes_of_a_spawn_whose_client_left_are_killed(
        monkeypatch: pytest.MonkeyPatch, daemon: httpx.Client, place: Path) -> None:
    """A spawn whose client went away while its sandboxes started left them running (with
    no timeout: for ever), their ids told to nobody, counted against that client's share
    of the VMs: a client that gave up on a slow spawn (RemoteBackend's deadline, a
    cancelled MCP call) found its share taken by sandboxes it never had."""
    engine = SlowEngine()
    monkeypatch.setattr(ch, "fork", engine.fork)
    monkeypatch.setattr(ch, "list_children", engine.list_children)
    monkeypatch.setattr(ch, "kill", engine.kill)
    body = json.dumps({"tag": "slow:x", "n": 2}).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(str(place / "ctl.sock"))
        conn.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: forkd\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        assert engine.forking.wait(30)
    assert engine.forked.wait(30)
    wait_until("the spawn's request to end", lambda: app.REQUESTS.held == 0, 30)
    assert sorted(engine.killed) == ["sb-1", "sb-2"] and engine.children == []
    assert daemon.get("/v1/sandboxes").json() == []
