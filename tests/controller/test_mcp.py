"""`forkd mcp` driven by the official MCP SDK's own clients (stdio and streamable HTTP)
against real VMs (issue 15 item 3): every tool, progress while a command runs, and bad
input as tool errors from a server that goes on answering."""

from __future__ import annotations

import base64
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import httpx
import pytest
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from net_support import free_port

TOKEN = "mcp-test-token-" + "m" * 40
TINY_TAG = "mcptiny:latest"

pytestmark = pytest.mark.timeout(1800)


def _server_env(env: dict[str, str]) -> dict[str, str]:
    return {**env, "PATH": os.environ["PATH"], "FORKD_CACHE": os.environ.get(
        "FORKD_CACHE", os.path.expanduser("~/.cache/forkd"))}


@contextlib.asynccontextmanager
async def stdio_session(env: dict[str, str], *options: str) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(
        command=sys.executable,
        args=["-c", "from forkd.cli.main import main; main()", "mcp", *options],
        env=_server_env(env), cwd="/")
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        yield session


async def call(session: ClientSession, tool: str, **args: Any) -> dict[str, Any]:
    """A tool's structured result; the test fails on a tool error."""
    res = await session.call_tool(tool, args)
    assert not res.is_error, [getattr(c, "text", c) for c in res.content]
    assert res.structured_content is not None
    return res.structured_content


async def error(session: ClientSession, tool: str, **args: Any) -> str:
    """A tool error's message; the test fails if the call succeeded."""
    res = await session.call_tool(tool, args)
    assert res.is_error, res.structured_content
    return " ".join(getattr(c, "text", "") for c in res.content)


def _children_left() -> list[str]:
    from forkd.engine import children as ch

    return [c.id for c in ch.list_children()]


def test_stdio_every_tool_on_real_vms(env: dict[str, str], tiny: str) -> None:
    async def main() -> None:
        async with stdio_session(env) as s:
            names = {t.name for t in (await s.list_tools()).tools}
            assert names == {"list_snapshots", "list_sandboxes", "create_sandboxes",
                             "fork_from_branch", "run_command", "run_code", "read_file",
                             "write_file", "branch_sandbox", "kill_sandbox"}
            refs = [x["ref"] for x in (await call(s, "list_snapshots"))["snapshots"]]
            assert tiny in refs
            ids = (await call(s, "create_sandboxes", tag=tiny, n=2))["sandboxes"]
            assert len(ids) == 2
            a, b = ids

            # a command's output arrives as progress notifications while it runs
            pieces: list[tuple[float, str]] = []

            async def on_progress(progress: float, total: float | None,
                                  message: str | None) -> None:
                pieces.append((progress, message or ""))

            res = await s.call_tool("run_command", {
                "sandbox_id": a,
                "command": "for i in 1 2 3; do echo line$i; sleep 0.3; done; echo oops >&2; "
                           "exit 3"}, progress_callback=on_progress)
            assert not res.is_error
            r = res.structured_content
            assert r is not None
            assert r["exit_code"] == 3 and r["status"] == "exited" and not r["timed_out"]
            assert r["stdout"] == "line1\nline2\nline3\n" and r["stderr"] == "oops\n"
            streamed = "".join(m for _, m in pieces)
            assert "line1" in streamed and "line3" in streamed and "stderr: oops" in streamed
            assert [p for p, _ in pieces] == sorted(p for p, _ in pieces)
            r = await call(s, "run_command", sandbox_id=a, command=["cat"], stdin="in\n",
                           cwd="/tmp", env={"X": "1"})
            assert r["stdout"] == "in\n" and r["exit_code"] == 0
            r = await call(s, "run_command", sandbox_id=a, command="sleep 30", timeout_s=1)
            assert r["timed_out"] and r["status"] == "timed_out"

            # files: text and any bytes
            await call(s, "write_file", sandbox_id=a, path="/root/notes.txt",
                       content="héllo\n")
            assert (await call(s, "read_file", sandbox_id=a, path="/root/notes.txt")
                    )["text"] == "héllo\n"
            blob = bytes(range(256))
            await call(s, "write_file", sandbox_id=a, path="/root/blob.bin",
                       content=base64.b64encode(blob).decode(), encoding="base64", mode=0o600)
            got = await call(s, "read_file", sandbox_id=a, path="/root/blob.bin",
                             encoding="base64")
            assert base64.b64decode(got["base64"]) == blob and got["size"] == 256
            assert "encoding='base64'" in await error(s, "read_file", sandbox_id=a,
                                                      path="/root/blob.bin")
            assert "NotFound" in await error(s, "read_file", sandbox_id=a, path="/no/such")

            # code in the warm interpreter; an exception is a result, not a tool error
            r = await call(s, "run_code", sandbox_id=a, code="x = 41\nprint('hi')\nx + 1")
            assert r["value"] == 42 and r["stdout"] == "hi\n" and r["error"] is None
            r = await call(s, "run_code", sandbox_id=a, code="1 / 0")
            assert r["value"] is None and r["error"]["type"] == "ZeroDivisionError"
            assert "ZeroDivisionError" in r["error"]["traceback"]
            # rich results: images as MCP image content, html in the structured result
            res = await s.call_tool("run_code", {"sandbox_id": a, "code": (
                "class Pic:\n"
                "    def _repr_png_(self): return b'\\x89PNG-pic'\n"
                "    def _repr_html_(self): return '<b>pic</b>'\n"
                "Pic()")})
            assert not res.is_error and res.structured_content is not None
            images = [c for c in res.content if c.type == "image"]
            assert [(base64.b64decode(i.data), i.mime_type) for i in images] == [
                (b"\x89PNG-pic", "image/png")]
            (main,) = [x for x in res.structured_content["results"] if x["is_main_result"]]
            assert main["html"] == "<b>pic</b>"

            # branch, then fork from the branch: the children start where a was
            branch = (await call(s, "branch_sandbox", sandbox_id=a, tag="mcpbranch:one")
                      )["branch"]
            assert branch["ref"] == "mcpbranch:one"
            assert "exists" in await error(s, "branch_sandbox", sandbox_id=a,
                                           tag="mcpbranch:one")
            kids = (await call(s, "fork_from_branch", tag="mcpbranch:one", n=1))["sandboxes"]
            assert (await call(s, "run_code", sandbox_id=kids[0], code="x"))["value"] == 41
            assert (await call(s, "read_file", sandbox_id=kids[0], path="/root/notes.txt")
                    )["text"] == "héllo\n"
            listed = {x["id"] for x in (await call(s, "list_sandboxes"))["sandboxes"]}
            assert {a, b, kids[0]} <= listed

            # bad input: tool errors that say what was wrong; the server goes on
            assert "sandbox_id" in await error(s, "run_command", command="true")
            assert "tag" in await error(s, "create_sandboxes")
            assert "less than or equal to 64" in await error(s, "create_sandboxes",
                                                             tag=tiny, n=65)
            assert "NotFound" in await error(s, "create_sandboxes", tag="no-such:tag")
            assert "no child" in await error(s, "run_command", sandbox_id="nosuch",
                                             command="true")
            # refused by the tool's schema, before any request (test_review_hostile_ctl4)
            said = await error(s, "kill_sandbox", sandbox_id="../etc")
            assert "sandbox_id" in said and "pattern" in said, said
            assert "pattern" in await error(s, "write_file", sandbox_id=a, path="rel",
                                            content="x")
            assert "base64" in await error(s, "write_file", sandbox_id=a, path="/x",
                                           content="@@", encoding="base64")
            assert "non-empty argv" in await error(s, "run_command", sandbox_id=a, command=[])
            assert (await s.call_tool("no_such_tool", {})).is_error

            for sid in (a, b, kids[0]):
                assert (await call(s, "kill_sandbox", sandbox_id=sid))["killed"] == sid
            assert "no child" in await error(s, "run_command", sandbox_id=a, command="true")
            assert (await call(s, "list_sandboxes"))["sandboxes"] == []

    anyio.run(main)
    assert _children_left() == []


@contextlib.contextmanager
def http_server(env: dict[str, str]) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from forkd.cli.main import main; main()", "mcp",
         "--transport", "http", "--port", str(port)],
        env=_server_env(env), stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        cwd="/")
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            assert time.monotonic() < deadline, "forkd mcp --transport http did not listen"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def test_http_needs_the_token_and_serves_the_tools(env: dict[str, str], tiny: str) -> None:
    with http_server(env) as url:
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            r = httpx.post(url, json=init, headers=headers, timeout=10)
            assert r.status_code == 401, (headers, r.status_code)
            assert "Bearer" in r.text

        async def main() -> None:
            client = create_mcp_http_client(headers={"Authorization": f"Bearer {TOKEN}"})
            async with client, streamable_http_client(url, http_client=client) as (read, write), \
                    ClientSession(read, write) as s:
                await s.initialize()
                assert tiny in [x["ref"] for x in (await call(s, "list_snapshots"))["snapshots"]]
                (sid,) = (await call(s, "create_sandboxes", tag=tiny))["sandboxes"]
                seen: list[str] = []

                async def on_progress(p: float, t: float | None, m: str | None) -> None:
                    seen.append(m or "")

                res = await s.call_tool("run_command", {"sandbox_id": sid,
                                                        "command": "echo over-http"},
                                        progress_callback=on_progress)
                assert res.structured_content is not None
                assert res.structured_content["stdout"] == "over-http\n"
                assert "over-http" in "".join(seen)
                assert "no child" in await error(s, "run_command", sandbox_id="gone",
                                                 command="true")
                await call(s, "kill_sandbox", sandbox_id=sid)

        anyio.run(main)
    assert _children_left() == []


@contextlib.contextmanager
def controller_daemon(env: dict[str, str]) -> Iterator[None]:
    """`forkd serve` on the module's socket (no TCP), stopped on exit."""
    sock = os.path.join(env["FORKD_RUN"], "controller.sock")
    proc = subprocess.Popen(
        [sys.executable, "-c", "from forkd.cli.main import main; main()", "serve"],
        env=_server_env(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, cwd="/")
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(sock):
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "forkd serve did not start"
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        proc.wait(30)
    assert not os.path.exists(sock)


def test_stdio_through_the_daemon(env: dict[str, str], tiny: str) -> None:
    async def without_daemon() -> None:
        with pytest.raises(Exception):  # noqa: B017 - the server exits before initialize
            async with stdio_session(env, "--controller", "daemon"):
                pass

    anyio.run(without_daemon)

    async def main() -> None:
        async with stdio_session(env, "--controller", "daemon") as s:
            (sid,) = (await call(s, "create_sandboxes", tag=tiny, timeout_s=600))["sandboxes"]
            seen: list[str] = []

            async def on_progress(p: float, t: float | None, m: str | None) -> None:
                seen.append(m or "")

            res = await s.call_tool("run_command", {
                "sandbox_id": sid, "command": "echo one; sleep 0.5; echo two"},
                progress_callback=on_progress)
            assert res.structured_content is not None
            assert res.structured_content["stdout"] == "one\ntwo\n"
            assert "one" in "".join(seen) and "two" in "".join(seen)
            listed = (await call(s, "list_sandboxes"))["sandboxes"]
            assert [x["id"] for x in listed] == [sid] and listed[0]["time_left_s"] > 0
            await call(s, "kill_sandbox", sandbox_id=sid)
            assert "no child" in await error(s, "kill_sandbox", sandbox_id=sid)

    with controller_daemon(env):
        anyio.run(main)
    assert _children_left() == []


def test_mcp_help_lists_transports(env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-c", "from forkd.cli.main import main; main()", "mcp", "--help"],
        env=_server_env(env), capture_output=True, text=True, check=True, cwd="/").stdout
    assert "--transport [stdio|http]" in out and "--controller [auto|daemon|local]" in out


def test_streamed_output_keeps_a_bounded_tail() -> None:
    from forkd.controller.mcp import MAX_OUTPUT_CHARS, Tail

    tail = Tail()
    piece = "x" * 4095 + "\n"
    for _ in range(3 * MAX_OUTPUT_CHARS // len(piece)):
        tail.add(piece)
    tail.add("the end\n")
    text, cut = tail.text()
    assert len(text) == MAX_OUTPUT_CHARS and text.endswith("x\nthe end\n")
    assert cut + len(text) == 3 * MAX_OUTPUT_CHARS + len("the end\n")
    small = Tail()
    small.add("a")
    small.add("b")
    assert small.text() == ("ab", 0)
