"""Guest agent protocol v2 against the real agent (engine/guest/agent.py) run on the host
behind a one-client socket like QEMU's (tests/engine/agent_harness.py), reached through
the real relay (agent_client.connect_child). The same protocol in VMs:
test_agent_v2_vm.py."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import AGENT, host_agent

from forkd.engine import agent_client as ac
from forkd.errors import Conflict, NotFound


def _gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def _relay_pids(d: Path) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if b"agent_client\0relay\0" + str(d).encode() in cmd:
                out.append(int(p.name))
    return out


@pytest.fixture
def child_dir(tmp_path: Path) -> Iterator[Path]:
    with host_agent(tmp_path):
        yield tmp_path
    deadline = time.monotonic() + 30
    while _relay_pids(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.1)  # the relay exits when its agent socket closes
    assert not _relay_pids(tmp_path), "the agent relay outlived its agent"


def _client(d: Path) -> ac.AgentClient:
    return ac.connect_child(d)


def test_many_requests_in_flight_on_one_channel(child_dir: Path) -> None:
    """A second request to a busy sandbox is answered at once (v1: waited, then "busy").
    The slow command runs until the test lets it end, so "answered while the slow one is
    still running" is a fact, not a timing (it was `sleep 3` and quick ones in < 2.5 s)."""
    started, go = child_dir / "slow-started", child_dir / "slow-go"
    slow: dict[str, object] = {}
    t = threading.Thread(target=lambda: slow.update(r=_client(child_dir).exec(
        ["sh", "-c", f"touch {started}; while [ ! -e {go} ]; do sleep 0.05; done"])))
    t.start()
    # If the quick requests waited for the slow one, they would wait for ever: let it
    # end after a minute, so the test fails (below) instead of hanging.
    guard = threading.Timer(60, go.touch)
    guard.start()
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert time.monotonic() < deadline, "the slow command never started"
            time.sleep(0.05)
        quick = [_client(child_dir).exec(["echo", str(i)]) for i in range(3)]
        assert not slow, "the quick requests waited for the slow one"
    finally:
        go.touch()
        guard.cancel()
        t.join(60)
    assert [q["stdout"] for q in quick] == ["0\n", "1\n", "2\n"]
    assert slow["r"]["status"] == "exited"  # type: ignore[index]


def test_output_streams_while_the_command_runs(child_dir: Path, tmp_path: Path) -> None:
    """The command goes on only once the test has received its first line, so a first
    line held back to the end shows as a timed-out command (it was: the first line came
    more than 1.5 s before the end of a command that slept 2 s, a timing)."""
    go = tmp_path / "got-one"
    seen: list[bytes] = []
    errs: list[bytes] = []

    def out(b: bytes) -> None:
        seen.append(b)
        if b"".join(seen).startswith(b"one\n"):
            go.touch()

    r = _client(child_dir).exec(
        ["sh", "-c", f"echo one; while [ ! -e {go} ]; do sleep 0.05; done; "
                     "echo two >&2; echo three"],
        on_stdout=out, on_stderr=errs.append, timeout=60)
    assert r["status"] == "exited", ("the first line arrived only at the end", r)
    assert b"".join(seen) == b"one\nthree\n"
    assert b"".join(errs) == b"two\n"
    assert r["stdout"] == ""


def test_large_output_arrives_whole(child_dir: Path, tmp_path: Path) -> None:
    data = os.urandom(24 << 20)
    (tmp_path / "big").write_bytes(data)
    got: list[bytes] = []
    r = _client(child_dir).exec(["cat", str(tmp_path / "big")], on_stdout=got.append)
    assert r["exit_code"] == 0
    assert hashlib.sha256(b"".join(got)).digest() == hashlib.sha256(data).digest()


def test_timeout_ends_the_whole_process_group(child_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "bg.pid"
    r = _client(child_dir).exec(["sh", "-c", f"sleep 300 & echo $! > {pidfile}; sleep 300"],
                                timeout=1)
    assert r["status"] == "timed_out" and r["timed_out"] and r["signal"] == 9
    assert not r["oom_killed"] and not r["killed"]
    assert _gone(int(pidfile.read_text())), "the background sleep 300 survived the timeout"


def test_exit_signal_and_kill_are_told_apart(child_dir: Path) -> None:
    c = _client(child_dir)
    assert c.exec(["sh", "-c", "exit 3"])["status"] == "exited"
    sig = c.exec(["sh", "-c", "kill -TERM $$"])
    assert (sig["status"], sig["signal"], sig["signal_name"]) == ("signaled", 15, "SIGTERM")
    h = c.request("proc_start", {"argv": ["sleep", "300"]})
    c.request("proc_kill", {"handle": h["handle"]})
    end = c.request("proc_wait", {"handle": h["handle"]})
    assert (end["status"], end["signal"], end["killed"]) == ("killed", 9, True)
    assert c.exec(["no-such-command-here"])["exit_code"] == 127


def test_background_process_stdin_wait_and_bad_input(child_dir: Path) -> None:
    c = _client(child_dir)
    reader = "while read l; do echo got $l; done; sleep 1"
    h = c.request("proc_start", {"argv": ["sh", "-c", reader]})
    handle = h["handle"]
    assert any(p["handle"] == handle and p["running"]
               for p in c.request("proc_list")["processes"])
    c.request("proc_stdin", {"handle": handle, "data": "YQo="})  # "a\n"
    c.request("proc_stdin", {"handle": handle, "data": "Ygo=", "close": True})
    with pytest.raises(Conflict, match="closed"):
        c.request("proc_stdin", {"handle": handle, "data": "Ywo="})
    out: list[bytes] = []
    end = c.request("proc_wait", {"handle": handle, "timeout": 30},
                    on_event=lambda ev, b: out.append(b))
    assert end["running"] is False and end["status"] == "exited"
    assert b"".join(out) == b"got a\ngot b\n"
    with pytest.raises(NotFound, match="no process with handle"):
        c.request("proc_wait", {"handle": handle})  # forgotten once its end was returned
    with pytest.raises(NotFound):
        c.request("proc_kill", {"handle": "p999999"})
    done = c.request("proc_start", {"argv": ["true"]})

    def running() -> bool:
        return any(p["handle"] == done["handle"] and p["running"]
                   for p in c.request("proc_list")["processes"])

    deadline = time.monotonic() + 60
    while running():
        assert time.monotonic() < deadline, "`true` never ended"
        time.sleep(0.05)
    with pytest.raises(Conflict, match="already ended"):
        c.request("proc_kill", {"handle": done["handle"]})
    with pytest.raises(Conflict, match="already ended"):
        c.request("proc_stdin", {"handle": done["handle"], "data": "eAo="})


def test_wait_with_a_timeout_returns_while_running(child_dir: Path) -> None:
    c = _client(child_dir)
    h = c.request("proc_start", {"argv": ["sh", "-c", "echo early; sleep 300"]})
    out: list[bytes] = []
    w = c.request("proc_wait", {"handle": h["handle"], "timeout": 5},
                  on_event=lambda ev, b: out.append(b))
    assert w["running"] is True and b"".join(out) == b"early\n"
    c.request("proc_kill", {"handle": h["handle"], "signal": "TERM"})
    assert c.request("proc_wait", {"handle": h["handle"]})["signal"] == 15


def test_pty(child_dir: Path) -> None:
    r = _client(child_dir).exec(["sh", "-c", "test -t 0 && test -t 1 && tty; echo $TERM"],
                                pty=True)
    assert r["exit_code"] == 0 and r["stdout"].startswith("/dev/pts/"), r
    plain = _client(child_dir).exec(["sh", "-c", "test -t 1"])
    assert plain["exit_code"] == 1


def test_a_client_that_goes_away_cancels_its_command(child_dir: Path, tmp_path: Path) -> None:
    pidfile = tmp_path / "p"
    c = _client(child_dir)
    rid_thread = threading.Thread(target=lambda: _swallow(
        lambda: c.exec(["sh", "-c", f"echo $$ > {pidfile}; exec sleep 300"])))
    rid_thread.start()
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    c.close()
    rid_thread.join(10)
    pid = int(pidfile.read_text())
    while not _gone(pid):
        assert time.monotonic() < deadline + 10, "the orphaned command still runs"
        time.sleep(0.05)


def _swallow(fn: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):
        fn()


def test_run_code_value_stdout_error(child_dir: Path) -> None:
    c = _client(child_dir)
    r = c.run_code("x = 20\nprint('hi')\nx * 2 + 2")
    assert r["stdout"] == "hi\n" and r["error"] is None
    assert r["results"] == [{"text": "42", "is_main_result": True}]
    e = c.run_code("def f():\n    raise KeyError('k')\nf()")
    assert e["error"]["type"] == "KeyError" and "line 2, in f" in e["error"]["traceback"]
    html = c.run_code("class T:\n    def _repr_html_(self): return '<b>t</b>'\nT()")
    assert html["results"][0]["html"] == "<b>t</b>"
    t = c.run_code("while True: pass", timeout=1)
    assert t["error"]["type"] == "TimeoutError" and t["error"].get("timed_out")
    assert c.run_code("x")["results"][0]["text"] == "20"  # the namespace still serves


def test_files_stream_and_missing_is_not_found(child_dir: Path, tmp_path: Path) -> None:
    c = _client(child_dir)
    data = os.urandom(5 << 20)
    (tmp_path / "f").write_bytes(data)
    assert c.get(str(tmp_path / "f")) == data
    with pytest.raises(NotFound, match="no file"):
        c.get(str(tmp_path / "missing"))
    with pytest.raises(NotFound):
        c.get_v1(str(tmp_path / "missing"))


def test_relay_refuses_duplicate_and_non_string_ids(child_dir: Path) -> None:
    c = _client(child_dir)
    c._ls.send(b'{"id": 5, "v": 2, "op": "ping"}\n')
    reply = c._read_frame("ping", time.monotonic() + 10)
    assert reply["ok"] is False and "string id" in reply["error"]["message"]


def test_recipe_tmp_mib_is_a_setting_and_the_default_keeps_cache_keys() -> None:
    from forkd.engine import recipe

    base = '[recipe]\nname = "t"\n[guest]\n'
    default = recipe.parse(base)
    assert default.tmp_mib == 64 and "tmp_mib" not in default.to_dict()
    assert recipe.parse(base + "tmp_mib = 64\n").content_digest("") == \
        default.content_digest("")
    big = recipe.parse(base + "tmp_mib = 512\n")
    assert big.tmp_mib == 512 and big.to_dict()["tmp_mib"] == 512
    assert big.content_digest("") != default.content_digest("")
    with pytest.raises(Exception, match="tmp_mib"):
        recipe.parse(base + "tmp_mib = 0\n")


def test_relay_skips_the_payload_of_an_event_nobody_waits_for(tmp_path: Path) -> None:
    """An event's binary payload is forwarded or skipped whole: bytes in it that look like
    frames (a reply to the waiting request) are never taken for frames."""
    import json
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)

    def agent() -> None:
        conn, _ = listener.accept()
        with conn:
            line = b""
            while not line.endswith(b"\n"):
                line += conn.recv(4096)
            rid = json.loads(line)["id"]
            fake = (json.dumps({"id": rid, "ok": True, "result": {"fake": 1}}) + "\n").encode()
            ghost = b"\n" + fake + b"\n"
            conn.sendall(json.dumps({"id": "ghost", "ev": "stdout", "size": len(ghost)}).encode()
                         + b"\n" + ghost)
            mine = b"x\n" + fake
            conn.sendall(json.dumps({"id": rid, "ev": "stdout", "size": len(mine)}).encode()
                         + b"\n" + mine)
            conn.sendall(json.dumps({"id": rid, "ok": True, "result": {"real": 1}}).encode()
                         + b"\n")
            conn.recv(4096)  # until the relay goes

    t = threading.Thread(target=agent, daemon=True)
    t.start()
    c = ac.connect_child(tmp_path)
    got: list[bytes] = []
    try:
        assert c.request("ping", on_event=lambda ev, b: got.append(b)) == {"real": 1}
        assert len(got) == 1 and got[0].startswith(b"x\n") and b'"fake": 1' in got[0]
    finally:
        c.close()
        listener.close()
        for pid in _relay_pids(tmp_path):
            os.kill(pid, 15)


def test_the_build_cache_key_follows_the_agent_source(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent lives in the snapshot's memory: a template built before an agent change
    must not be reused after it (forkd build boots a new one with the new agent)."""
    from forkd.engine import build, image, recipe

    r = recipe.parse('[recipe]\nname = "t"\n')
    before = build._cache_key(r, "tcg")
    real = image.agent_source()
    monkeypatch.setattr(image, "agent_source", lambda: real + b"\n# another agent\n")
    assert build._cache_key(r, "tcg") != before


def _guest_agent() -> Any:
    """engine/guest/agent.py as a module (it is a script in the guest)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("forkd_guest_agent_v2", AGENT)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _frames(data: bytes) -> list[tuple[dict[str, Any], bytes]]:
    """(header, payload) of each event frame in data, as a host reader splits them."""
    import json

    out = []
    while data:
        head, _, data = data.partition(b"\n")
        frame = json.loads(head)
        out.append((frame, data[:frame["size"]]))
        data = data[frame["size"]:]
    return out


@pytest.fixture
def port() -> Iterator[tuple[int, Callable[[], bytes]]]:
    """A pipe standing in for the agent's port: (its write end, read all that came)."""
    r, w = os.pipe()
    got = bytearray()
    t = threading.Thread(
        target=lambda: [got.extend(b) for b in iter(lambda: os.read(r, 1 << 20), b"")],
        daemon=True)
    t.start()

    def read_all() -> bytes:
        os.close(w)
        t.join(10)
        return bytes(got)

    yield w, read_all
    os.close(r)


@pytest.mark.parametrize("zero_copy", [True, False])
def test_event_payloads_go_from_pipe_and_file_into_the_port_whole(
    tmp_path: Path, port: tuple[int, Callable[[], bytes]], zero_copy: bool,
) -> None:
    """Streamed output (a pipe) and file chunks are moved into the port by splice/sendfile
    (never read into the agent) or, where the port cannot, copied: the frames are the same.
    The pipe a port splices from holds exactly the frame's bytes (a virtio port sends every
    buffer of it: with more, QEMU saw empty ones and failed the device). A file that shrank
    under a get is padded to the size announced and the count says so."""
    agent = _guest_agent()
    w, read_all = port
    ch = agent.Channel(w)
    if not zero_copy:
        agent._ZERO_COPY.update({True: False, False: False})
    out = os.urandom(60_000)
    r_pipe, w_pipe = os.pipe()
    os.write(w_pipe, out + b"the next frame's")
    ch.event_from("a", "stdout", r_pipe, 60_000, None)
    assert os.read(r_pipe, 100) == b"the next frame's"  # exactly the size announced moved
    if zero_copy:  # what the port splices from holds exactly the frame, never more
        os.write(w_pipe, out)
        staged = ch._stage(r_pipe, 1000)
        assert staged != r_pipe and agent._pipe_bytes(staged) == 1000
        assert agent._pipe_bytes(r_pipe) == len(out) - 1000
        assert os.read(staged, 2000) == out[:1000]
        assert os.read(r_pipe, len(out)) == out[1000:]
    os.close(w_pipe)
    file_data = os.urandom(3 << 20 | 123)
    (tmp_path / "f").write_bytes(file_data)
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        assert ch.event_from("b", "chunk", fd, 2 << 20, 1 << 20) == 2 << 20
        assert ch.event_from("b", "chunk", fd, 4 << 20, 1 << 20) == (2 << 20) + 123  # shrank
    finally:
        os.close(fd)
    frames = _frames(read_all())
    assert [(f["id"], f["ev"], f["size"]) for f, _ in frames] == [
        ("a", "stdout", 60_000), ("b", "chunk", 2 << 20), ("b", "chunk", 4 << 20)]
    assert frames[0][1] == out
    assert frames[1][1] == file_data[1 << 20:3 << 20]
    assert frames[2][1] == file_data[1 << 20:] + bytes((4 << 20) - (2 << 20) - 123)
    used = agent._ZERO_COPY
    assert used[True] is zero_copy and used[False] is zero_copy, \
        "splice/sendfile into a pipe port fell back to copying"
    os.close(r_pipe)


def test_streamed_output_is_spliced_not_read(port: tuple[int, Callable[[], bytes]]) -> None:
    """exec with stream: the command's stdout reaches the port whole, through Sink.move
    (splice) and not through a read into the agent."""
    agent = _guest_agent()
    w, read_all = port
    agent.CHANNEL = agent.Channel(w)
    reads: list[int] = []
    real_read = agent.os.read

    class _Os:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def read(fd: int, n: int) -> bytes:
            reads.append(n)
            return real_read(fd, n)

    agent.os = _Os()
    res = agent.op_exec({"id": "x", "argv": ["head", "-c", str(5 << 20), "/dev/urandom"],
                         "stream": True})
    frames = _frames(read_all())
    assert res["status"] == "exited" and res["exit_code"] == 0
    assert sum(f["size"] for f, _ in frames if f["ev"] == "stdout") == 5 << 20
    assert all(f["size"] <= agent.CHUNK for f, _ in frames)
    assert reads == [], "the agent read streamed output into its own memory"


def test_a_protocol_1_get_reply_holds_about_one_copy_of_the_file(tmp_path: Path) -> None:
    """A get without stream answers with the file base64-encoded in one JSON line: the
    agent writes that line in pieces, holding about one copy of the file (building it
    whole took ~5 copies, and a 16 MiB get ran the 160 MiB tiny guest out of memory).
    The line is the same JSON as before."""
    import base64
    import json
    import tracemalloc

    agent = _guest_agent()
    r, w = os.pipe()
    sink = tmp_path / "port"

    def drain() -> None:  # to a file, so the line is not held in this process's memory
        with sink.open("wb") as f:
            for piece in iter(lambda: os.read(r, 1 << 16), b""):
                f.write(piece)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    agent.CHANNEL = agent.Channel(w)
    size = 8 << 20
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    tracemalloc.start()
    try:
        agent._serve_one({"id": "g", "op": "get", "path": str(tmp_path / "f")})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        os.close(w)
        reader.join(10)
        os.close(r)
    line = sink.read_bytes()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    reply = json.loads(line)
    assert reply == {"id": "g", "ok": True,
                     "result": {"bytes": size, "data": base64.b64encode(data).decode()}}
    assert peak < 1.5 * size, f"the agent held {peak / size:.1f}x the file to answer a get"
