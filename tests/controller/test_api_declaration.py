"""forkd.controller.api is the one declaration of the controller API: the REST routes, the
Backend protocol, LocalBackend, RemoteBackend and the SDK follow from it (no VM needed).
docs/openapi-controller.json is checked by test_api_docs.py, the TypeScript types by
test_typescript_sdk.py."""

from __future__ import annotations

import inspect
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any, get_type_hints

import msgspec
import pytest
import uvicorn
from litestar.params import RawBody
from litestar.testing import TestClient

from forkd.audit import AuditLog
from forkd.controller import api, app, backend, client, sdk
from forkd.controller.api import OPERATIONS, ExecFrame, ExecRequest, ExecResult
from forkd.engine.lifecycle import ChildInfo
from forkd.errors import InvalidInput, NotFound

BACKENDS = [backend.LocalBackend, client.RemoteBackend]


def _route(op: api.Operation) -> Any:
    """The app's handler of op (Litestar's path syntax ``{x:str}`` read as ``{x}``)."""
    for handler in app.ROUTES:
        for path in handler.paths:
            plain = re.sub(r"\{(\w+):\w+\}", r"{\1}", path)
            if plain == op.path and op.method in handler.http_methods:
                return handler
    raise AssertionError(f"no route {op.method} {op.path} for api.OPERATIONS {op.name!r}")


@pytest.mark.parametrize("op", OPERATIONS, ids=[op.name for op in OPERATIONS])
def test_every_operation_is_a_route_with_the_declared_types(op: api.Operation) -> None:
    handler = _route(op)
    hints = get_type_hints(handler.fn, include_extras=False, globalns=vars(app))
    assert handler.status_code == op.status, op.name
    if op.stream:
        streamed = "application/octet-stream" if op.answer is bytes else "application/x-ndjson"
        assert handler.media_type == streamed, op.name
    elif op.answer is None:
        assert hints["return"] is type(None)
    else:
        assert hints["return"] == op.answer, (op.name, hints["return"])
    body = hints.get("data") if op.body is not bytes else hints.get("body")
    if op.body is None:
        assert "data" not in hints and "body" not in hints, op.name
    elif op.body is bytes:
        assert body is RawBody
    else:
        assert getattr(body, "__args__", (body,))[0] == op.body, (op.name, body)
    for name in op.query:
        assert name in hints, (op.name, name)
    for name in re.findall(r"\{(\w+)\}", op.path):
        assert name in hints, (op.name, name)


def test_every_route_is_an_operation() -> None:
    declared = {(op.method, op.path) for op in OPERATIONS}
    for handler in app.ROUTES:
        for path in handler.paths:
            plain = re.sub(r"\{(\w+):\w+\}", r"{\1}", path)
            if plain in ("/healthz", "/metrics"):
                continue
            for method in handler.http_methods:
                assert (method, plain) in declared, f"{method} {plain} is not in api.OPERATIONS"


def _signature(cls: type, name: str) -> tuple[list[tuple[str, Any, Any]], Any]:
    fn = getattr(cls, name)
    hints = get_type_hints(fn)
    params = [
        (p.name, hints.get(p.name), p.default)
        for p in inspect.signature(fn).parameters.values()
        if p.name != "self"
    ]
    return params, hints.get("return")


@pytest.mark.parametrize("op", OPERATIONS, ids=[op.name for op in OPERATIONS])
def test_every_backend_has_the_declared_method(op: api.Operation) -> None:
    protocol = backend.PoolBackend
    params, answer = _signature(protocol, op.name)
    expected = backend.Transfer[op.answer] if op.stream else op.answer
    expected = type(None) if expected is None else expected
    assert answer == expected, (op.name, answer, expected)
    names = [n for n, _, _ in params]
    wanted = re.findall(r"\{(\w+)\}", op.path) + list(op.query)
    if op.body is bytes:
        wanted.append("data")
    elif op.body is not None:
        wanted.append("req")
        assert dict((n, t) for n, t, _ in params)["req"] == op.body
    assert sorted(names) == sorted(wanted), (op.name, names, wanted)
    for cls in BACKENDS:
        assert _signature(cls, op.name) == (params, answer), (cls.__name__, op.name)


def test_a_sandbox_answer_has_every_field_of_the_engine_record() -> None:
    record = {f.name for f in fields(ChildInfo)}
    declared = set(api.SandboxInfo.__struct_fields__)
    assert record <= declared, f"add {sorted(record - declared)} to api.SandboxInfo"


def test_sdk_spawn_options_are_the_spawn_request() -> None:
    req = sdk.spawn_request("tiny", 2, {"cpus": 0.5, "timeout": 30, "on_timeout": "pause"})
    assert (req.n, req.cpus, req.timeout, req.on_timeout) == (2, 0.5, 30, "pause")
    with pytest.raises(InvalidInput, match="memory_limit_mib"):
        sdk.spawn_request("tiny", 1, {"memory_limit": 512})


def test_requests_refuse_unknown_and_mistyped_fields(tmp_path: Path) -> None:
    with TestClient(_app(object(), tmp_path)) as http:
        for body, said in [
            ({"tag": "x", "nn": 2}, "unknown field `nn`"),
            ({"tag": "x", "n": "two"}, "Expected `int`"),
            ({"tag": "x", "cpus": [1]}, "Expected `float | null`"),
            ({"tag": "x", "on_timeout": "later"}, "Invalid enum value"),
            ({"n": 1}, "missing required field `tag`"),
        ]:
            r = http.post("/v1/sandboxes", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "InvalidInput" and said in r.text, r.text
        r = http.post("/v1/sandboxes/x/exec", json={"argv": ["true"], "stdin_b64": "%%"})
        assert r.status_code == 400 and "base64" in r.text


def _app(the_backend: Any, tmp_path: Path) -> Any:
    return app.create_app(the_backend, AuditLog(tmp_path / "audit.log"), app.ControllerMetrics(),
                          None)


class SlowCommands:
    """A daemon backend whose commands take ``seconds`` (to test the client's deadlines
    without a VM or a real 600 s wait)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def sandbox(self, sandbox_id: str) -> Any:
        if sandbox_id != "slow-1":
            raise NotFound(f"no child {sandbox_id!r}")
        return {"id": sandbox_id}

    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        time.sleep(self.seconds)
        return ExecResult(status="exited", exit_code=0, stdout="done\n", duration=self.seconds)

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Iterator[ExecFrame]:
        yield ExecFrame(stdout="start\n")
        time.sleep(self.seconds)
        yield ExecFrame(result=self.exec(sandbox_id, ExecRequest(argv=["true"])))


@pytest.fixture
def slow_daemon(tmp_path: Path) -> Iterator[Path]:
    """The real app and uvicorn on a Unix socket, with SlowCommands (2.5 s per command)."""
    sock = tmp_path / "slow.sock"
    config = uvicorn.Config(_app(SlowCommands(2.5), tmp_path), uds=str(sock), log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield sock
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_command_longer_than_the_client_timeout_completes(
    slow_daemon: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = client.RemoteBackend(socket=slow_daemon, timeout=1.0)  # requests: 1 s
    try:
        done = remote.exec("slow-1", ExecRequest(argv=["sleep"], timeout=30))
        assert done.stdout == "done\n" and done.duration == 2.5
        done = remote.exec("slow-1", ExecRequest(argv=["sleep"]))  # no timeout: no deadline
        assert done.exit_code == 0
        # and the mechanism is the command's own timeout: a shorter one is given up on
        monkeypatch.setattr(api, "ANSWER_GRACE_S", 0.5)
        with pytest.raises(client.ControllerError, match="did not answer in time"):
            remote.exec("slow-1", ExecRequest(argv=["sleep"], timeout=1.0))
    finally:
        remote.close()


def test_a_quiet_stream_gets_heartbeats_and_outlives_the_client_timeout(
    slow_daemon: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(api, "HEARTBEAT_S", 0.5)  # the daemon's and the client's
    remote = client.RemoteBackend(socket=slow_daemon, timeout=1.0)
    try:
        frames = list(remote.exec_stream("slow-1", ExecRequest(argv=["sleep"])))
    finally:
        remote.close()
    assert frames[0].stdout == "start\n"
    heartbeats = [f for f in frames if f == ExecFrame()]
    assert len(heartbeats) >= 3, frames  # 2.5 s quiet, one each 0.5 s
    last = frames[-1].result
    assert last is not None and last.stdout == "done\n"
    with pytest.raises(NotFound):
        remote = client.RemoteBackend(socket=slow_daemon)
        list(remote.exec_stream("nope-1", ExecRequest(argv=["x"])))


def test_frames_are_one_json_object_per_line() -> None:
    line = msgspec.json.encode(ExecFrame(stdout="a\nb"))
    assert b"\n" not in line and msgspec.json.decode(line, type=ExecFrame).stdout == "a\nb"


def test_the_backend_protocols_declare_and_do_not_implement() -> None:
    """Every Backend/PoolBackend method is a stub (``...``): an implementation there would
    be what a backend that forgot the method silently inherits."""
    for op in OPERATIONS:
        source = inspect.getsource(getattr(backend.PoolBackend, op.name)).strip()
        assert source.endswith("..."), f"Backend.{op.name} has a body:\n{source}"


class Flood:
    """A backend whose command writes FRAMES frames of 64 KiB as fast as it can."""

    FRAMES = 2000

    def __init__(self) -> None:
        self.produced = 0
        self.closed = threading.Event()

    def sandbox(self, sandbox_id: str) -> Any:
        return {"id": sandbox_id}

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Iterator[ExecFrame]:
        chunk = "x" * (64 << 10)
        try:
            for _ in range(self.FRAMES):
                self.produced += 1
                yield ExecFrame(stdout=chunk)
            yield ExecFrame(result=ExecResult(status="exited", exit_code=0))
        finally:
            self.closed.set()


def test_a_slow_or_gone_stream_reader_bounds_the_daemon_and_does_not_hang_it(
    tmp_path: Path,
) -> None:
    flood = Flood()
    sock = tmp_path / "flood.sock"
    server = uvicorn.Server(uvicorn.Config(_app(flood, tmp_path), uds=str(sock),
                                           log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        remote = client.RemoteBackend(socket=sock)
        frames = remote.exec_stream("f-1", ExecRequest(argv=["flood"]))
        assert next(frames).stdout
        time.sleep(1.5)  # a reader that does not read: the daemon waits, it does not buffer
        waiting = flood.produced
        assert waiting < 400, f"{waiting} frames of 64 KiB produced for a reader that stopped"
        frames.close()
        remote.close()  # the reader is gone: the backend's iterator is closed, nothing hangs
        assert flood.closed.wait(30), f"the backend was never told (at {flood.produced} frames)"
        assert flood.produced < Flood.FRAMES
        with client.RemoteBackend(socket=sock).http as http:
            assert http.get("/healthz").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)


def test_an_exec_answer_has_every_field_of_the_engine_result() -> None:
    from forkd.engine.agent_client import ExecResult as EngineResult

    engine = {f.name for f in fields(EngineResult)}
    declared = set(api.ExecResult.__struct_fields__)
    assert engine <= declared, f"add {sorted(engine - declared)} to api.ExecResult"
