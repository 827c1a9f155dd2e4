"""Hostile review, round 3: what a caller sends the daemon is checked before a guest sees it.

A command's argv, env and cwd, a timeout, a signal, a file's path, mode and size went to
the guest agent unchecked: a NUL in an argument, ``A=B`` as a variable name, a timeout of
-1 or 1e308, signal 99999 or mode -1 failed in the guest's execve, wait or chmod, and came
back as the agent's protocol error, a 500. A body of a few thousand ``[`` was a
RecursionError in the JSON parser, another 500. Each is now a 400 InvalidInput that says
what was wrong, decided before any sandbox is looked up, by one set of checks
(engine/commands.py) that the REST request types, the engine (so the CLI and the SDK) and
the MCP tools share.

The real app with a real LocalBackend (no VM is started: every request here is refused
before one would be reached).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from forkd.audit import AuditLog
from forkd.controller.api import OPERATIONS
from forkd.controller.app import MAX_FILE_BYTES, MAX_JSON_BYTES, ControllerMetrics, create_app
from forkd.controller.backend import LocalBackend
from forkd.engine import commands
from forkd.engine.agent_client import exec_args
from forkd.errors import InvalidInput
from forkd.jsondoc import MAX_DEPTH
from forkd.store.store import Store

SB = "/v1/sandboxes/ghost-1"


@pytest.fixture
def http(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient[Any]]:
    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    app = create_app(LocalBackend(Store.open()), AuditLog(tmp_path / "audit.log"),
                     ControllerMetrics(), None)
    with TestClient(app) as client:
        yield client


def _refused(answer: Any, *words: str) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "InvalidInput", error
    for word in words:
        assert word in error["message"], error["message"]


COMMAND_ROUTES = [SB + "/exec", SB + "/exec/stream", SB + "/processes"]
BAD_COMMANDS: list[tuple[dict[str, Any], str]] = [
    ({"argv": []}, "non-empty list"),
    ({"argv": ["ls", "a\u0000b"]}, "argv[1] contains a NUL"),
    ({"argv": ["x" * (commands.MAX_ARG_BYTES + 1)]}, "argv[0] is"),
    ({"argv": ["a" * 100_000] * 11}, "argv and env are"),
    ({"argv": ["env"], "env": {"A=B": "1"}}, "not a variable name"),
    ({"argv": ["env"], "env": {"": "1"}}, "not a variable name"),
    ({"argv": ["env"], "env": {"A\u0000": "1"}}, "NUL"),
    ({"argv": ["env"], "env": {"A": "1\u00002"}}, "NUL"),
    ({"argv": ["pwd"], "cwd": "tmp"}, "cwd 'tmp' must be absolute"),
    ({"argv": ["pwd"], "cwd": "/tmp\u0000"}, "cwd contains a NUL"),
    ({"argv": ["pwd"], "cwd": "/" + "d" * 5000}, "cwd is 5001 bytes"),
]


@pytest.mark.parametrize("route", COMMAND_ROUTES)
@pytest.mark.parametrize(("body", "said"), BAD_COMMANDS)
def test_a_bad_command_is_a_400_before_any_sandbox(
    http: TestClient[Any], route: str, body: dict[str, Any], said: str
) -> None:
    _refused(http.post(route, json=body), said)


TIMED_ROUTES = [
    (SB + "/exec", {"argv": ["true"]}),
    (SB + "/exec/stream", {"argv": ["true"]}),
    (SB + "/eval", {"code": "1"}),
    (SB + "/run_code", {"code": "1"}),
    (SB + "/processes/p1/wait", {}),
]


@pytest.mark.parametrize(("route", "body"), TIMED_ROUTES)
@pytest.mark.parametrize("timeout", [-1, 0, 1e308, commands.MAX_WAIT_S + 1])
def test_a_timeout_out_of_range_is_a_400(
    http: TestClient[Any], route: str, body: dict[str, Any], timeout: float
) -> None:
    _refused(http.post(route, json={**body, "timeout": timeout}), "timeout must be")


@pytest.mark.parametrize("sig", [0, 65, 99999, -9, "SIGNOPE", "", "KILL\u0000"])
def test_an_unknown_signal_is_a_400(http: TestClient[Any], sig: object) -> None:
    _refused(http.post(SB + "/processes/p1/kill", json={"signal": sig}), "signal")


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("path=relative", "must be absolute"),
        ("path=/a%00b", "NUL"),
        ("path=/" + "p" * 5000, "guest path is 5001 bytes"),
        ("path=/ok&mode=-1", "mode must be"),
        ("path=/ok&mode=99999999", "mode must be"),
        ("path=/ok&mode=4096", "mode must be"),
    ],
)
def test_a_bad_file_write_is_a_400(http: TestClient[Any], query: str, said: str) -> None:
    _refused(http.put(f"{SB}/files?{query}", content=b"x"), said)


def test_a_bad_file_read_is_a_400(http: TestClient[Any]) -> None:
    _refused(http.get(f"{SB}/files?path=/a%00b"), "NUL")
    _refused(http.get(f"{SB}/files?path=" + "p" * 10), "must be absolute")


def test_a_file_is_bounded_by_what_the_guest_takes(http: TestClient[Any]) -> None:
    """The REST bound is the guest agent's (a bigger body would pass the daemon and be
    refused by the agent as a 500)."""
    from forkd.engine.guest import agent

    assert MAX_FILE_BYTES == commands.MAX_PUT_BYTES == agent.MAX_FILE
    answer = http.put(f"{SB}/files?path=/big", content=b"x" * (MAX_FILE_BYTES + 1))
    assert answer.status_code == 413, answer.text


def test_good_values_pass_the_checks(http: TestClient[Any]) -> None:
    """The checks refuse what the guest cannot do, nothing more: these reach the backend,
    which has no such sandbox."""
    for route, body in [
        (SB + "/exec", {"argv": ["env"], "env": {"A_1": "x=y", "LANG": "é"}, "cwd": "/tmp",
                        "timeout": 0.25, "stdin_b64": "aGk="}),
        (SB + "/exec", {"argv": ["sh", "-c", "echo é " + "y" * 100_000]}),
        (SB + "/processes", {"argv": ["sleep", "9"], "cwd": "/"}),
        (SB + "/processes/p1/wait", {"timeout": commands.MAX_WAIT_S}),
        (SB + "/processes/p1/kill", {"signal": "TERM"}),
        (SB + "/processes/p1/kill", {"signal": 15}),
        (SB + "/eval", {"code": "1", "timeout": 3}),
    ]:
        answer = http.post(route, json=body)
        assert answer.status_code == 404, (route, answer.text)
    assert http.put(f"{SB}/files?path=/x&mode=493", content=b"#!").status_code == 404


def _json_routes(http: TestClient[Any]) -> list[tuple[str, str]]:
    out = []
    for route in http.app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        for method, (handler, _model) in route.route_handler_map.items():
            if "data" in handler.parsed_fn_signature.parameters:
                out.append((method, re.sub(r"\{[^}]+\}", "ghost-1", route.path)))
    return out


def test_a_deeply_nested_body_is_a_400_on_every_json_route(http: TestClient[Any]) -> None:
    routes = _json_routes(http)
    assert len(routes) == sum(op.body not in (None, bytes) for op in OPERATIONS), routes
    deep = b'{"tag": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for method, path in routes:
        answer = http.request(method, path, content=deep,
                              headers={"content-type": "application/json"})
        _refused(answer, f"over the limit of {MAX_DEPTH}")
    flat = http.post("/v1/sandboxes", json={"tag": "ghost", "egress": [["x"]]})
    _refused(flat, "Expected `str`")  # a shallow body is parsed and checked as before


def test_a_key_twice_in_one_object_is_a_400_on_every_json_route(http: TestClient[Any]) -> None:
    """msgspec keeps the last of a repeated key, other readers (the audit, a proxy, the
    client's own reading) the first: such a body is refused, not read one way here."""
    routes = _json_routes(http)
    twice = b'{"tag": "a", "n": 1, "tag": "b"}'
    nested = b'{"tag": "a", "env": {"A": "1", "A": "2"}}'
    for method, path in routes:
        for body in (twice, nested):
            answer = http.request(method, path, content=body,
                                  headers={"content-type": "application/json"})
            _refused(answer, "appears twice in one object")
    flat = http.post("/v1/sandboxes", content=b'{"tag": "ghost", "n": 1, "n2": 2}',
                     headers={"content-type": "application/json"})
    assert "appears twice" not in flat.text, flat.text  # distinct keys are decoded as before


def test_an_untrusted_id_is_shortened_in_the_error(http: TestClient[Any]) -> None:
    answer = http.get("/v1/sandboxes/" + "A" * 6000)
    _refused(answer, "invalid child id")
    assert len(answer.text) < 400, len(answer.text)


def test_the_engine_makes_the_same_checks() -> None:
    """The CLI and the in-process SDK reach the guest through exec_args: the same checks."""
    with pytest.raises(InvalidInput, match="not a variable name"):
        exec_args(["env"], {"A=B": "1"}, None, None, None, False)
    with pytest.raises(InvalidInput, match="timeout must be"):
        exec_args(["true"], None, None, None, float("nan"), False)
    with pytest.raises(InvalidInput, match="stdin is"):
        exec_args(["cat"], None, None, b"x" * (commands.MAX_PUT_BYTES + 1), None, False)
    assert exec_args(["true"], {"A": "1"}, "/", b"", 1.5, False)["timeout"] == 1.5


def test_mcp_run_command_refuses_the_same(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    mcp = pytest.importorskip("forkd.controller.mcp")
    from mcp.server.mcpserver.exceptions import ToolError

    from forkd import Controller

    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    server = mcp.build_server(Controller(local=True))
    for args, said in [
        ({"command": ["env"], "env": {"A=B": "1"}}, "not a variable name"),
        ({"command": ["ls", "a\u0000"]}, "NUL"),
        ({"command": "ls", "cwd": "/tmp\u0000"}, "NUL"),
    ]:
        with pytest.raises(ToolError, match=f"InvalidInput: .*{said}"):
            asyncio.run(server.call_tool("run_command", {"sandbox_id": "ghost-1", **args}))


def test_a_sandbox_in_another_state_is_a_conflict_not_a_server_error() -> None:
    """A paused or crashed sandbox (ChildDead) and one held by another operation past the
    wait (Busy) are the caller's 409, with the engine's exit code kept."""
    from forkd.controller.app import error_answer
    from forkd.engine.errors import Busy, ChildDead

    for exc, code in [(ChildDead("child x-1 is paused"), 15), (Busy("child x-1 is busy"), 10)]:
        status, body = error_answer(exc)
        assert (status, body.type, body.exit_code) == (409, "Conflict", code), (exc, body)


def test_a_body_that_is_not_json_or_too_large_says_so(http: TestClient[Any]) -> None:
    for raw in (b'{"tag": "x", "n": NaN}', b"\xff\xfe", b'{"tag": '):
        answer = http.post("/v1/sandboxes", content=raw,
                           headers={"content-type": "application/json"})
        _refused(answer, "must be JSON")
    stdin = "A" * MAX_JSON_BYTES
    answer = http.post(SB + "/exec", json={"argv": ["cat"], "stdin_b64": stdin})
    assert answer.status_code == 413, answer.text
    error = answer.json()["error"]
    assert error["type"] == "InvalidInput" and f"at most {MAX_JSON_BYTES}" in error["message"]


@pytest.mark.parametrize("action", ["wait", "stdin", "kill"])
@pytest.mark.parametrize("handle", ["x-1", "p", "p1x", "p" + "9" * 40, "P1"])
def test_a_handle_that_process_start_never_gave_is_a_400(
    http: TestClient[Any], action: str, handle: str
) -> None:
    _refused(http.post(f"{SB}/processes/{handle}/{action}", json={}), "invalid process handle")


def test_a_guest_reply_of_another_shape_is_an_agent_error_that_says_so() -> None:
    """The guest is the untrusted side: a reply that does not fit the protocol is told as
    the guest agent's fault (a 500 with its reason), not an unexplained internal error."""
    from forkd.controller.api import ExecResult, ProcessSignaled
    from forkd.controller.app import error_answer
    from forkd.controller.backend import guest_answer
    from forkd.engine.agent_client import ExecResult as EngineResult
    from forkd.engine.errors import AgentError

    for reply, answer in [({"status": "weird", "exit_code": 0}, ExecResult),
                          ({"handle": "p1", "signal": "nine"}, ProcessSignaled)]:
        with pytest.raises(AgentError, match="does not match the protocol") as caught:
            guest_answer(reply, answer, "exec")
        status, body = error_answer(caught.value)
        assert status == 500 and "does not match the protocol" in body.message
    for reply in ({}, {"exit_code": "x"}, {"exit_code": 0, "duration": [1]}):
        with pytest.raises(AgentError, match="exec reply does not match"):
            EngineResult.of(reply)
    assert guest_answer({"status": "exited", "exit_code": 3}, ExecResult, "exec").exit_code == 3


@pytest.mark.parametrize("route,body", [
    ("/v1/sandboxes", {"tag": "forkd-paused/other-1a2b3c:a"}),
    ("/v1/pools", {"tag": "forkd-paused/other-1a2b3c:b", "k": 1}),
])
def test_a_paused_sandboxs_saved_state_is_not_a_source(
    http: TestClient[Any], route: str, body: dict[str, Any]
) -> None:
    """Only the paused sandbox's resume starts from its saved state: no spawn or pool
    clones it (its memory is that sandbox's)."""
    _refused(http.post(route, json=body), "saved state of paused sandbox other-1a2b3c")


def test_a_validation_error_does_not_repeat_the_url(http: TestClient[Any]) -> None:
    answer = http.post("/v1/sandboxes?<script>" + "q" * 300, json={"tag": "a:b", "nn": 1})
    _refused(answer, "unknown query parameter (a name of 308 characters")
    assert "<script>" not in answer.text and "q" * 50 not in answer.text
    answer = http.post("/v1/sandboxes", json={"tag": "a:b", "nn": 1})
    _refused(answer, "unknown field", "nn")


def test_errors_name_no_host_paths(http: TestClient[Any], tmp_path: Path) -> None:
    """An error answer names the store as $FORKD_HOME (and the run directory as
    $FORKD_RUN), never where this host keeps them."""
    answer = http.get("/v1/snapshots/ghost:v1")
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert str(tmp_path) not in message and "$FORKD_HOME" in message, message


def test_hidden_host_paths_names_each_directory(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.engine.paths import cache_dir, hidden_host_paths, run_dir

    monkeypatch.setenv("FORKD_RUN", str(tmp_path / "run"))
    monkeypatch.setenv("FORKD_CACHE", str(tmp_path / "cache"))
    text = f"{tmp_path}/home/blobs/x, {run_dir()}/children/a-1/qemu.log, {cache_dir()}/debs"
    hidden = hidden_host_paths(text, tmp_path / "home")
    assert hidden == "$FORKD_HOME/blobs/x, $FORKD_RUN/children/a-1/qemu.log, $FORKD_CACHE/debs"


def test_requests_in_flight_to_guests_are_bounded() -> None:
    """A request to a guest holds a worker until the guest answers: past
    MAX_REQUESTS_PER_CHILD to one child, or MAX_REQUESTS in all, the next is Busy (a 409)
    at once, so commands that never end cannot take every worker of the daemon."""
    import contextlib

    from forkd.engine import children as ch
    from forkd.engine.errors import Busy

    with contextlib.ExitStack() as held:
        for _ in range(ch.MAX_REQUESTS_PER_CHILD):
            held.enter_context(ch._admitted("a-1"))
        with pytest.raises(Busy, match="requests to child a-1"):
            held.enter_context(ch._admitted("a-1"))
        for i in range(ch.MAX_REQUESTS - ch.MAX_REQUESTS_PER_CHILD):
            held.enter_context(ch._admitted(f"b-{i}"))
        with pytest.raises(Busy, match="requests to children"):
            held.enter_context(ch._admitted("c-1"))
    with ch._admitted("a-1"), ch._admitted("c-1"):  # all given back
        assert ch._in_flight == {"a-1": 1, "c-1": 1}
    assert ch._in_flight == {}


def test_an_in_process_controller_has_the_daemons_vm_limit(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK and `forkd mcp` without a daemon run VMs in their own process: an agent
    driving them is bound by the same limit as a daemon's callers (docs/api.md)."""
    from forkd.controller.backend import MAX_SANDBOXES, LocalBackend
    from forkd.controller.sdk import Controller

    monkeypatch.setenv("FORKD_HOME", str(tmp_path / "home"))
    backend = Controller(local=True).backend
    assert isinstance(backend, LocalBackend) and backend.max_sandboxes == MAX_SANDBOXES


def test_failed_writes_a_caller_provokes_are_audited_within_a_budget(
        http: TestClient[Any], tmp_path: Path) -> None:
    """An exec in a sandbox that is not there fails at no cost to its caller: each was an
    audit record, as often as it liked. At most FAILED_PER_MINUTE are written a minute; the
    rest are counted (the count is written with the next minute's first record)."""
    from forkd.controller.app import FAILED_PER_MINUTE

    for _ in range(FAILED_PER_MINUTE + 40):
        assert http.post(SB + "/exec", json={"argv": ["true"]}).status_code == 404
    records = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    failed = [r for r in records if r["result"] == "failed"]
    assert len(failed) == FAILED_PER_MINUTE, len(failed)
    assert failed[0]["target"] == SB + "/exec" and "ghost-1" in failed[0]["error"], failed[0]
