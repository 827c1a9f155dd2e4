"""`forkd serve` refuses to run with a guessable token or in a run directory another user
could have planted, and its audit log tells TCP callers from Unix-socket callers.

Real daemons in subprocesses (no VM is started); the run-directory tests chown to uid
65534, so they need root like the other controller tests."""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from daemon_support import tcp_daemon
from net_support import free_port

from forkd.controller.app import MIN_TOKEN_BYTES, create_app, token_matches
from forkd.errors import InvalidInput
from forkd.private import create_private_file, private_dir, read_private_file

OTHER_UID = 65534  # nobody
GOOD_TOKEN = secrets.token_urlsafe(32)  # 43 bytes


@dataclass
class Place:
    home: Path
    run: Path
    env: dict[str, str]


@pytest.fixture
def place(tmp_path: Path) -> Place:
    if os.geteuid() != 0:
        pytest.skip("the run-directory tests chown to another uid: they need root")
    env = {k: v for k, v in os.environ.items() if k != "FORKD_CONTROLLER_TOKEN"}
    env |= {"FORKD_HOME": str(tmp_path / "home"), "FORKD_RUN": str(tmp_path / "run")}
    return Place(tmp_path / "home", tmp_path / "run", env)


@dataclass
class Outcome:
    started: bool
    returncode: int | None
    stderr: str


def _serve(place: Place, *args: str, port: int | None = None, **env: str) -> Outcome:
    """Run `forkd serve --listen` until it either exits (refused) or answers /healthz
    (started; then it is stopped again)."""
    port = port or free_port()
    err = place.home.parent / f"serve-{port}.err"
    with err.open("wb") as log:
        proc = subprocess.Popen(
            ["forkd", "serve", "--listen", f"127.0.0.1:{port}", *args],
            env={**place.env, **env},
            stdout=subprocess.DEVNULL,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    try:
        deadline = time.monotonic() + 60
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    return Outcome(True, None, err.read_text())
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "forkd serve neither started nor exited"
            time.sleep(0.1)
        return Outcome(False, proc.returncode, err.read_text())
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(15)


def _refused(outcome: Outcome, *words: str) -> None:
    assert not outcome.started, "forkd serve started; it must refuse"
    assert outcome.returncode == 2, outcome.stderr
    for word in words:
        assert word in outcome.stderr, outcome.stderr


def _private_token_file(path: Path, text: str) -> Path:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, text.encode())
    os.close(fd)
    return path


# -- the token ----------------------------------------------------------------
@pytest.mark.parametrize("content", ["", "\n", "x" * (MIN_TOKEN_BYTES - 1) + "\n"])
def test_empty_or_short_default_token_file_refuses_to_start(place: Place, content: str):
    token = _private_token_file(place.run / "controller.token", content)
    _refused(_serve(place), str(token), "bytes", "remove it")
    assert token.read_text() == content  # not replaced: a client may have been given it


@pytest.mark.parametrize("content", ["", "short\n", "x" * (MIN_TOKEN_BYTES - 1)])
def test_empty_or_short_token_file_option_refuses_to_start(place: Place, content: str):
    token = _private_token_file(place.home.parent / "given.token", content)
    _refused(_serve(place, "--token-file", str(token)), str(token), "bytes")


@pytest.mark.parametrize("value", ["", " ", "x" * (MIN_TOKEN_BYTES - 1), "a b" * 20, "é" * 40])
def test_empty_short_or_unsendable_token_variable_refuses_to_start(place: Place, value: str):
    _refused(_serve(place, FORKD_CONTROLLER_TOKEN=value), "$FORKD_CONTROLLER_TOKEN")


def test_token_of_exactly_the_minimum_length_starts(place: Place):
    assert _serve(place, FORKD_CONTROLLER_TOKEN="y" * MIN_TOKEN_BYTES).started


def test_made_token_file_is_private_and_reused(place: Place):
    assert _serve(place).started
    token = place.run / "controller.token"
    st = token.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert len(token.read_text().strip()) >= MIN_TOKEN_BYTES
    assert sorted(p.name for p in place.run.iterdir() if "token" in p.name) == ["controller.token"]
    first = token.read_text()
    assert _serve(place).started and token.read_text() == first


@pytest.fixture
def daemon(place: Place) -> Iterator[str]:
    with tcp_daemon({**place.env, "FORKD_CONTROLLER_TOKEN": GOOD_TOKEN},
                    place.home.parent / "daemon.err", timeout=60) as url:
        yield url


ROUTES = [("GET", "/v1/snapshots"), ("GET", "/v1/sandboxes"), ("GET", "/metrics")]
ROUTES += [("DELETE", "/v1/sandboxes/x-1"), ("DELETE", "/v1/snapshots/ghost:v1")]
ROUTES += [("DELETE", "/v1/pools/ghost:v1")]


def test_empty_or_wrong_bearer_gets_401_on_get_and_delete(daemon: str):
    wrong_same_length = GOOD_TOKEN[:-1] + ("A" if GOOD_TOKEN[-1] != "A" else "B")
    refused = [
        "Bearer ",
        "Bearer",
        "Bearer  ",
        f"Bearer {wrong_same_length}",
        f"Bearer {GOOD_TOKEN[:-1]}",
        f"Bearer {GOOD_TOKEN}x",
        f"Basic {GOOD_TOKEN}",
        GOOD_TOKEN,
    ]
    port = int(daemon.rsplit(":", 1)[1])
    for method, path in ROUTES:
        for header in refused:  # raw: httpx would not send a value with trailing spaces
            assert _status(port, method, path, header) == 401, (method, path, header)
        assert _status(port, method, path, f"Bearer {GOOD_TOKEN}") in (200, 404), (method, path)


def _status(port: int, method: str, path: str, authorization: str) -> int:
    request = f"{method} {path} HTTP/1.1\r\nHost: forkd\r\nConnection: close\r\n"
    request += f"Authorization: {authorization}\r\n\r\n"
    return int(_raw_request(port, request)[1].split(" ", 2)[1])


def test_an_empty_token_never_matches_and_is_never_served():
    assert not token_matches(b"", b"")
    assert not token_matches(b"", b"x" * MIN_TOKEN_BYTES)
    assert token_matches(b"x" * MIN_TOKEN_BYTES, b"x" * MIN_TOKEN_BYTES)
    with pytest.raises(InvalidInput):
        create_app(None, None, None, b"")
    with pytest.raises(InvalidInput):
        create_app(None, None, None, b"x" * (MIN_TOKEN_BYTES - 1))


# -- the audit log ------------------------------------------------------------
def _raw_request(port: int, request: str) -> tuple[int, str]:
    """Send one HTTP/1.1 request from a socket whose port we know; (client port, answer)."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(request.encode())
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        client_port: int = s.getsockname()[1]
    return client_port, answer.decode(errors="replace")


def _audit(place: Place) -> list[dict[str, str]]:
    lines = (place.home / "controller-audit.log").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_audit_log_records_tcp_callers_with_address_and_socket_callers_with_uid(
    place: Place, daemon: str
):
    port = int(daemon.rsplit(":", 1)[1])
    delete = "DELETE /v1/sandboxes/{id} HTTP/1.1\r\nHost: forkd\r\nConnection: close\r\n{auth}\r\n"
    granted_port, answer = _raw_request(
        port, delete.format(id="tcp-1", auth=f"Authorization: Bearer {GOOD_TOKEN}\r\n")
    )
    assert " 404 " in answer.splitlines()[0], answer
    denied_port, answer = _raw_request(
        port, delete.format(id="tcp-2", auth="Authorization: Bearer \r\n")
    )
    assert " 401 " in answer.splitlines()[0], answer
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(place.run / "controller.sock"))) as c:
        assert c.delete("http://forkd/v1/sandboxes/unix-1").status_code == 404
    entries = _audit(place)
    tcp = [e for e in entries if e["target"] == "/v1/sandboxes/tcp-1"]
    assert [(e["actor"], e["ip"]) for e in tcp] == [("tcp", f"127.0.0.1:{granted_port}")]
    denied = [e for e in entries if e["target"] == "/v1/sandboxes/tcp-2"]
    assert [(e["ip"], e["result"]) for e in denied] == [(f"127.0.0.1:{denied_port}", "denied")]
    unix = [e for e in entries if e["target"] == "/v1/sandboxes/unix-1"]
    assert [(e["actor"], e["ip"]) for e in unix] == [
        ("unix-socket", f"uid={os.geteuid()} pid={os.getpid()}")
    ]


# -- the run directory --------------------------------------------------------
def test_run_dir_owned_by_another_user_is_refused(place: Place):
    place.run.mkdir(mode=0o700)
    os.chown(place.run, OTHER_UID, OTHER_UID)
    _refused(_serve(place), str(place.run), f"owned by uid {OTHER_UID}")
    assert list(place.run.iterdir()) == []  # no socket, no token written into it


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_run_dir_writable_by_group_or_others_is_refused(place: Place, mode: int):
    place.run.mkdir()
    _private_token_file(place.run / "controller.token", "planted-" * 8)  # a planted token
    place.run.chmod(mode)
    _refused(_serve(place), str(place.run), "writable by group or others")


def test_run_dir_symlink_is_refused(place: Place):
    real = place.home.parent / "elsewhere"
    real.mkdir(mode=0o700)
    place.run.symlink_to(real)
    _refused(_serve(place), str(place.run), "symlink")
    assert list(real.iterdir()) == []


def test_run_dir_under_a_directory_another_user_owns_is_refused(place: Place):
    theirs = place.home.parent / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER_UID, OTHER_UID)
    place.env["FORKD_RUN"] = str(theirs / "run")
    _refused(_serve(place), str(theirs), "could replace")
    assert not (theirs / "run").exists()


def test_run_dir_levels_are_made_0700(place: Place):
    place.env["FORKD_RUN"] = str(place.home.parent / "a" / "b" / "run")
    assert _serve(place).started
    for level in ("a", "a/b", "a/b/run"):
        assert stat.S_IMODE((place.home.parent / level).lstat().st_mode) == 0o700, level


def _run_dir_as(uid: int) -> int:
    """run_dir() in a forked child that became user ``uid``, with FORKD_RUN and
    XDG_RUNTIME_DIR unset (the /tmp/forkd-UID fallback): 0 made, 2 refused, 3 other."""
    from forkd.engine.paths import run_dir  # before dropping root: /root is not readable

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            os.environ.pop("FORKD_RUN", None)
            os.environ.pop("XDG_RUNTIME_DIR", None)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            code = 0 if run_dir() == Path(f"/tmp/forkd-{uid}/forkd") else 3
        except InvalidInput:
            code = 2
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def fallback_dir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    top = Path(f"/tmp/forkd-{OTHER_UID}")
    if os.path.lexists(top):
        pytest.skip(f"{top} exists already (a real user's run directory?)")
    try:
        yield top
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", str(top)], check=True)


def test_tmp_fallback_pre_created_by_another_user_is_refused(fallback_dir: Path):
    fallback_dir.mkdir(mode=0o777)
    fallback_dir.chmod(0o777)  # root "plants" it for uid 65534
    (fallback_dir / "forkd").mkdir(mode=0o777)
    assert _run_dir_as(OTHER_UID) == 2


def test_tmp_fallback_made_by_forkd_is_private(fallback_dir: Path):
    assert _run_dir_as(OTHER_UID) == 0
    for level in (fallback_dir, fallback_dir / "forkd"):
        st = level.lstat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (OTHER_UID, 0o700), level
    assert _run_dir_as(OTHER_UID) == 0  # its own directory is accepted the next time


# -- the token file -----------------------------------------------------------
def test_symlinked_default_token_file_is_refused(place: Place):
    target = _private_token_file(place.home.parent / "real.token", GOOD_TOKEN)
    place.run.mkdir(mode=0o700)
    (place.run / "controller.token").symlink_to(target)
    _refused(_serve(place), "symlink")


def test_symlinked_token_file_option_is_refused(place: Place):
    target = _private_token_file(place.home.parent / "real.token", GOOD_TOKEN)
    link = place.home.parent / "link.token"
    link.symlink_to(target)
    _refused(_serve(place, "--token-file", str(link)), "symlink")


def test_dangling_symlink_as_token_file_is_not_written_through(place: Place):
    place.run.mkdir(mode=0o700)
    target = place.home.parent / "victim"
    (place.run / "controller.token").symlink_to(target)
    _refused(_serve(place), "symlink")
    assert not target.exists()


def test_token_file_others_may_read_or_another_user_owns_is_refused(place: Place):
    token = _private_token_file(place.home.parent / "given.token", GOOD_TOKEN)
    token.chmod(0o644)
    _refused(_serve(place, "--token-file", str(token)), "chmod 600")
    token.chmod(0o600)
    os.chown(token, OTHER_UID, OTHER_UID)
    _refused(_serve(place, "--token-file", str(token)), f"owned by uid {OTHER_UID}")


def test_socket_path_that_is_not_a_socket_is_left_alone(place: Place):
    victim = place.home.parent / "not-a-socket"
    victim.write_text("keep me")
    _refused(_serve(place, "--socket", str(victim)), "not a socket")
    assert victim.read_text() == "keep me"


# -- forkd.private directly ---------------------------------------------------
def test_create_private_file_never_replaces_or_follows(tmp_path: Path):
    path = tmp_path / "secret"
    assert create_private_file(path, b"one")
    assert not create_private_file(path, b"two")
    assert read_private_file(path, 16) == b"one"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "target")
    assert not create_private_file(dangling, b"x")
    assert not (tmp_path / "target").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "secret"]  # no tmp left
    with pytest.raises(InvalidInput, match="over 2 bytes"):
        read_private_file(path, 2)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InvalidInput, match="not a regular file"):
        read_private_file(fifo, 16)  # and does not block


def test_private_dir_refuses_a_file_in_the_way(tmp_path: Path):
    (tmp_path / "run").write_text("")
    with pytest.raises(InvalidInput, match="not a directory"):
        private_dir(tmp_path / "run")


# -- the token guard is app-wide -------------------------------------------------
def _filled(path: str) -> str:
    """A route's path template with every parameter filled in (``{id:str}`` → ``x-1``)."""
    return re.sub(r"\{[^}]+\}", "x-1", path)


def test_every_route_but_liveness_and_the_schema_needs_the_token(
    place: Place, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Enumerated from the app itself, so a route added later without thinking of the
    token is caught here: the guard is app-wide and only /healthz and the schema are open."""
    from litestar.routes import HTTPRoute
    from litestar.testing import TestClient

    from forkd.audit import AuditLog
    from forkd.controller.app import ControllerMetrics
    from forkd.controller.backend import LocalBackend
    from forkd.store.store import Store

    monkeypatch.setenv("FORKD_HOME", str(place.home))
    monkeypatch.setenv("FORKD_RUN", str(place.run))
    backend = LocalBackend(Store.open())
    app = create_app(backend, AuditLog(place.home / "audit.log"), ControllerMetrics(),
                     GOOD_TOKEN.encode())
    asked = 0
    with TestClient(app) as client:
        for route in app.routes:
            if not isinstance(route, HTTPRoute):
                continue
            for method in sorted(route.methods - {"OPTIONS", "HEAD"}):
                url = _filled(route.path)
                public = url == "/healthz" or url == "/schema" or url.startswith("/schema/")
                for headers in ({}, {"Authorization": "Bearer " + "x" * 43}):
                    answer = client.request(method, url, headers=headers, json={})
                    asked += 1
                    if public:
                        assert answer.status_code != 401, (method, url)
                    else:
                        assert answer.status_code == 401, (method, url, answer.text)
        assert asked > 60
        for sneaky in ("/schema/../v1/sandboxes", "/schema/%2e%2e/v1/sandboxes",
                       "/healthz/../v1/sandboxes", "//v1/sandboxes", "/v1/sandboxes/"):
            answer = client.get(sneaky)
            assert answer.status_code in (401, 404), (sneaky, answer.status_code)
        ok = client.get("/v1/sandboxes", headers={"Authorization": f"Bearer {GOOD_TOKEN}"})
        assert ok.status_code == 200 and ok.json() == []


# -- revoking the token ------------------------------------------------------------
def _replace_private_file(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    _private_token_file(tmp, text)
    tmp.replace(path)


def test_a_replaced_token_file_revokes_the_old_token_without_a_restart(place: Place) -> None:
    """The daemon read its token file once: a token taken away by replacing the file kept
    working until the daemon restarted. Now the file is read again when it changes, and a
    file that is gone or invalid refuses every request (it never falls back)."""
    first, second, third = (secrets.token_urlsafe(32) for _ in range(3))
    token = _private_token_file(place.home.parent / "given.token", first + "\n")

    def status(url: str, given: str) -> int:
        answer = httpx.get(f"{url}/v1/sandboxes", headers={"Authorization": f"Bearer {given}"})
        return answer.status_code

    with tcp_daemon(place.env, place.home.parent / "revoke.err", "--token-file", str(token),
                    timeout=60) as url:
        assert status(url, first) == 200
        _replace_private_file(token, second + "\n")
        assert (status(url, first), status(url, second)) == (401, 200)
        token.unlink()
        assert (status(url, first), status(url, second)) == (401, 401)
        _replace_private_file(token, "short\n")
        assert (status(url, second), status(url, "short")) == (401, 401)
        _replace_private_file(token, third)
        assert (status(url, second), status(url, third)) == (401, 200)
        token.chmod(0o644)  # others may read it now: not a private file, refused
        assert status(url, third) == 401


def test_refused_requests_cannot_flood_the_audit_log(place: Place, daemon: str):
    """Anyone who reaches the port can send requests without the token: each is audited
    with its path shortened, at most REFUSED_PER_MINUTE a minute (the rest counted), and a
    request head past h11's bound is a 400 the app never sees (httptools buffered a URL
    of any length)."""
    from forkd.audit import MAX_TARGET
    from forkd.controller.app import REFUSED_PER_MINUTE

    port = int(daemon.rsplit(":", 1)[1])
    huge = "/v1/snapshots/" + "B" * 1024 * 1024  # more than one read: h11 stops at 16 KiB
    answer = b""
    with socket.create_connection(("127.0.0.1", port)) as s:
        try:  # the daemon answers 400 and closes while the line is still coming
            s.sendall(f"GET {huge} HTTP/1.1\r\nHost: forkd\r\n\r\n".encode())
            while chunk := s.recv(65536):
                answer += chunk
        except (BrokenPipeError, ConnectionResetError):
            pass
    assert answer == b"" or answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert not any("B" * 100 in e["target"] for e in _audit(place))
    long_path = "/v1/snapshots/" + "A" * 8000
    for _ in range(REFUSED_PER_MINUTE + 30):
        assert _status(port, "GET", long_path, "Bearer wrong") == 401
    refused = [e for e in _audit(place) if e["action"] == "auth"]
    assert len(refused) == REFUSED_PER_MINUTE // 2  # one client's share of the budget
    assert all(len(e["target"]) <= MAX_TARGET for e in refused)
    assert not any("B" * 100 in e["target"] for e in _audit(place))
    assert _status(port, "GET", "/v1/sandboxes", f"Bearer {GOOD_TOKEN}") == 200
