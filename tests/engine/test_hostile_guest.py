"""A hostile guest against the host: root in a sandbox can replace the agent and write
anything into its virtio-serial port, and anything to its console.

The agent-channel tests run the real host side (AgentClient, the per-child relay process
connect_child starts, the daemon's backend) against a unix socket that stands in for
QEMU's agent chardev and speaks the hostile bytes; the console test runs a real VM.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkd.engine.agent_client import AgentClient, connect_child, relay_main
from forkd.engine.errors import AgentError

MIB = 1 << 20
Reply = Callable[[str], bytes]


def _line(obj: object) -> bytes:
    return json.dumps(obj).encode() + b"\n"


# what a hostile agent answers to a request of id rid (keyed by the request's "case")
CASES: dict[str, Reply] = {
    "scalar": lambda rid: b"5\n",
    "string": lambda rid: b'"hello"\n',
    "error_string": lambda rid: _line({"id": rid, "ok": False, "error": "boom"}),
    "result_list": lambda rid: _line({"id": rid, "ok": True, "result": [1, 2]}),
    "id_list": lambda rid: _line({"id": [rid], "ok": True, "result": {}}),
    "ok_missing": lambda rid: _line({"id": rid, "result": {}}),
    "deep": lambda rid: (b'{"id": "%s", "ok": true, "result": ' % rid.encode()
                         + b"[" * 100_000 + b"\n"),
    "nan": lambda rid: b'{"id": "%s", "ok": true, "result": {"x": NaN}}\n' % rid.encode(),
    "twice": lambda rid: b'{"id": "%s", "ok": true, "ok": false, "result": {}}\n'
                         % rid.encode(),
    "twice_inside": lambda rid: b'{"id": "%s", "ok": true, "result": {"v": {"1": "a", '
                                b'"1": "b"}}}\n' % rid.encode(),
    "deep_event": lambda rid: (b'{"id": "%s", "ev": "stdout", "size": ' % rid.encode()
                               + b"[" * 3000 + b"\n"),
    "huge_message": lambda rid: _line({"id": rid, "ok": False,
                                       "error": {"type": "x", "message": "m" * (8 * MIB)}}),
}


class HostileAgent:
    """A unix socket at path that behaves like QEMU's agent chardev (one client at a time)
    with a hostile agent behind it: every request is answered by CASES[request["case"]];
    a request without a case gets a proper ping reply."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.stop = threading.Event()
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.listener.settimeout(0.2)
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            self.conns.append(conn)
            self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        conn.settimeout(0.2)
        while not self.stop.is_set():
            try:
                data = conn.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                req = json.loads(line)
                if req.get("op") == "cancel":
                    continue
                case = req.get("case")
                answer = (_line({"id": req["id"], "ok": True, "result": {"pong": True}})
                          if case is None else CASES[case](req["id"]))
                try:  # blocking: a reader slowed by a loaded host (or tracemalloc) must
                    # not cut a 42 MiB answer short, as a 0.2 s send timeout did
                    conn.settimeout(None)
                    conn.sendall(answer)
                    conn.settimeout(0.2)
                except OSError:
                    return

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for c in self.conns:
            c.close()
        self.listener.close()


@pytest.fixture
def hostile(tmp_path: Path) -> Iterator[Path]:
    """A child directory whose agent.sock is a hostile agent, and the child's relay serving
    it: the real relay code (relay_main), run on a thread of this process so that it is
    this checkout's (a relay process runs the installed forkd). It ends when the agent
    socket closes, as when QEMU exits; a relay that died of what the guest sent fails the
    test."""
    agent = HostileAgent(tmp_path / "agent.sock")
    died: list[BaseException] = []

    def relay() -> None:
        try:
            relay_main(tmp_path)
        except BaseException as exc:
            died.append(exc)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "agent-mux.sock").exists():
        assert time.monotonic() < deadline, "the relay did not listen"
        time.sleep(0.01)
    try:
        yield tmp_path
    finally:
        agent.close()
        thread.join(10)
        assert not thread.is_alive(), "the relay outlived its agent socket"
        assert not died, f"the relay died: {died[0]!r}"


def _refused(client: AgentClient, case: str) -> str:
    with pytest.raises(AgentError) as err:
        client.request("ping", {"case": case}, timeout=20)
    return str(err.value)


@pytest.mark.parametrize("case", ["error_string", "result_list", "deep", "twice",
                                  "deep_event"])
def test_a_reply_of_the_wrong_shape_is_an_agent_error_naming_the_protocol(
    hostile: Path, case: str,
) -> None:
    """Frames that were JSON but not of the protocol's shape raised AttributeError (an
    error that is a string, a scalar frame), RecursionError (deep nesting) or went through
    (a result that is a list, a key twice) into the daemon: a 500, or two readings of one
    frame. Each is now an AgentError that says the guest broke
    the protocol, and the next client of the same child is served."""
    client = connect_child(hostile)
    try:
        message = _refused(client, case)
    finally:
        client.close()
    assert "broke the protocol" in message, message
    again = connect_child(hostile)  # the relay survived (deep_event crashed it)
    try:
        assert again.request("ping", timeout=20) == {"pong": True}
    finally:
        again.close()


@pytest.mark.parametrize("via", ["relay", "direct"])
@pytest.mark.parametrize("case", ["scalar", "string"])
def test_a_line_that_is_not_an_object_is_skipped(hostile: Path, tmp_path_factory:
                                                 pytest.TempPathFactory, case: str,
                                                 via: str) -> None:
    """A line that is not a JSON object is not a frame (the tail of one that a previous
    host connection took part of): skipped, not an AttributeError (the direct client took
    ``5`` for a frame and called ``.get`` on it); the request then waits for its reply
    until its deadline."""
    own = None
    if via == "relay":
        client = connect_child(hostile)
    else:  # QEMU's socket takes one client: the relay holds hostile's
        d = tmp_path_factory.mktemp("direct")
        own = HostileAgent(d / "agent.sock")
        client = AgentClient(d / "agent.sock", timeout=5)
    try:
        with pytest.raises(AgentError, match="in time"):
            client.request("ping", {"case": case}, timeout=1)
    finally:
        client.close()
        if own is not None:
            own.close()


def test_nan_from_the_agent_is_taken(hostile: Path) -> None:
    """The agent writes NaN for an eval's float value (json's allow_nan), agents of
    existing snapshots too: taken, not refused."""
    client = connect_child(hostile)
    try:
        value = client.request("ping", {"case": "nan"}, timeout=20)["x"]
    finally:
        client.close()
    assert value != value  # NaN


def test_a_key_twice_inside_a_value_is_taken(hostile: Path) -> None:
    """An eval of {1: "a", "1": "b"} encodes "1" twice in the value: the guest's data, not
    the frame's routing fields, so taken."""
    client = connect_child(hostile)
    try:
        assert client.request("ping", {"case": "twice_inside"}, timeout=20) == {"v": {"1": "b"}}
    finally:
        client.close()


def test_a_refusal_message_from_the_guest_is_cut_short(hostile: Path) -> None:
    """The guest's error message goes into an error the API returns and logs keep: 8 MiB
    of it came back whole."""
    client = connect_child(hostile)
    try:
        with pytest.raises(AgentError) as err:
            client.request("ping", {"case": "huge_message"}, timeout=20)
    finally:
        client.close()
    assert len(str(err.value)) < 4000


def test_a_frame_of_empty_lists_is_refused_before_it_fills_the_host(tmp_path: Path) -> None:
    """A 40 MiB line of ``[],[],..`` (within the 64 MiB line bound) parsed into ~900 MiB
    of Python lists in the host, per request in flight: a few made the daemon's host run
    out of memory. Now a frame with more than MAX_STRUCTURE bytes outside its strings is
    refused before it is parsed; a frame whose bulk is strings (a file's base64) is not, nor
    an eval's value of a million numbers."""
    rid_box: list[str] = []

    def amplify(rid: str) -> bytes:
        rid_box.append(rid)
        return (b'{"id": "%s", "ok": true, "result": {"a": [' % rid.encode()
                + b"[]," * (14 * MIB) + b"[]]}}\n")

    CASES["amplify"] = amplify
    data = "QUJD" * (6 * MIB)  # 24 MiB of base64, in one string
    CASES["big_string"] = lambda rid: _line({"id": rid, "ok": True, "result": {"data": data}})
    numbers = list(range(1_000_000))  # an eval's value: ~7 MiB of structure
    CASES["big_value"] = lambda rid: _line({"id": rid, "ok": True, "result": {"v": numbers}})
    agent = HostileAgent(tmp_path / "agent.sock")
    try:
        client = AgentClient(tmp_path / "agent.sock", timeout=5)
        tracemalloc.start()
        try:
            with pytest.raises(AgentError, match="structure"):
                client.request("eval", {"case": "amplify"}, timeout=60)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 300 * MIB, f"{peak / MIB:.0f} MiB for one 42 MiB frame"
        client = AgentClient(tmp_path / "agent.sock", timeout=5)
        started = time.monotonic()
        assert client.request("eval", {"case": "big_string"}, timeout=60)["data"] == data
        assert time.monotonic() - started < 10
        assert client.request("eval", {"case": "big_value"}, timeout=60)["v"] == numbers
        client.close()
    finally:
        agent.close()
        CASES.pop("amplify")
        CASES.pop("big_string")
        CASES.pop("big_value")


@pytest.mark.parametrize("case", ["id_list", "ok_missing", "error_string", "deep"])
def test_the_direct_client_refuses_the_same_frames(tmp_path: Path, case: str) -> None:
    """Before a child has a relay (a waiting process's restore and fixup, a build) the
    host reads QEMU's socket itself: the same frames are AgentErrors there (the relay drops
    a frame whose id is not a string or that is neither a reply nor an event: nobody asked
    for it)."""
    agent = HostileAgent(tmp_path / "agent.sock")
    try:
        client = AgentClient(tmp_path / "agent.sock", timeout=5)
        assert "broke the protocol" in _refused(client, case)
    finally:
        agent.close()


# ---------------------------------------------------------------- a real VM's console
@pytest.mark.vm
def test_a_child_writing_its_console_fills_no_host_file(store: object, tiny: str,
                                                        cleanup_children: None) -> None:
    """Root in a child wrote /dev/ttyS0 as fast as TCG emulates port I/O, and QEMU appended
    it all to the child's serial.log on the host's disk, without bound (and log_tail read
    the whole file into memory). A child's console is now a 1 MiB ring in QEMU: 4 MiB
    written leave no file in the child's directory grown by them, and the tail of what
    it wrote is still in a failure's log tail."""
    from forkd.engine import children as ch
    from forkd.engine.qemu import QemuVM

    child = ch.fork(store, tiny, 1).children[0]  # type: ignore[arg-type]
    flood = ("import os\nfd = os.open('/dev/ttyS0', os.O_WRONLY | os.O_NOCTTY)\n"
             "block = b'x' * 65535 + b'\\n'\nfor _ in range(64):\n    os.write(fd, block)\n"
             "os.write(fd, b'forkd-console-marker\\n')\nos.close(fd)\n")
    res = ch.exec_in(child.id, ["python3", "-c", flood], timeout=600)
    assert res["exit_code"] == 0, res
    sizes = {p.name: p.stat().st_size for p in child.path.iterdir()
             if p.is_file() and p.name != "disk.qcow2"}
    assert sum(sizes.values()) < 1 << 20, sizes
    vm = QemuVM.attach(child.path, child.pid)
    try:
        tail = vm.log_tail()
    finally:
        if vm.qmp is not None:
            vm.qmp.close()
    assert "forkd-console-marker" in tail, tail[-500:]
    ch.kill(child.id)


def test_a_guest_that_stops_reading_its_port_makes_the_relay_hold_a_bounded_queue(
    tmp_path: Path,
) -> None:
    """A guest that reads nothing from its port (its agent stopped, or replaced): the relay
    read every request sent to it and queued it for the agent without bound (each 32 MiB
    ``put``, 43 MiB of base64, stayed in the relay until the guest read it; the relay
    never exits while bytes wait). Now, past AGENT_QUEUE bytes waiting, the relay reads
    no client: their requests time out in the client, and the relay's queue stays at
    about AGENT_QUEUE plus one line."""
    from forkd.engine.agent_client import Relay

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "agent.sock"))
    listener.listen(1)
    relay = Relay(tmp_path)  # connects now: the guest's end is accepted and never read
    conn, _ = listener.accept()
    done = threading.Event()
    thread = threading.Thread(target=lambda: (relay.run(), done.set()), daemon=True)
    thread.start()
    line = "A" * (24 * MIB)
    try:
        for _ in range(3):
            client = connect_child(tmp_path)
            with pytest.raises(AgentError):
                client.request("put", {"path": "/tmp/x", "data": line}, timeout=3)
            client.close()
        held = len(relay.agent_out) + sum(len(c.inbuf) for c in list(relay.clients.values()))
        assert held <= 16 * MIB + 2 * len(line), f"{held / MIB:.0f} MiB queued"  # AGENT_QUEUE
    finally:
        conn.close()  # as QEMU's end going away: the relay ends
        thread.join(15)
        listener.close()
    assert done.is_set()


# ---------------------------------------------------------------- a guest that ends its VM
@pytest.mark.vm
def test_a_child_that_ends_its_own_vm_is_cleaned_up_at_its_deadline(
    store: object, tiny: str, cleanup_children: None, engine_env: dict[str, Path],
) -> None:
    """Root in a sandbox can end its own VM (a power-off: QEMU exits; under microvm a reboot
    hangs the guest instead, which stays running and bound by its deadline). The sandbox is
    then "crashed", and the sweeper acted only on running ones: past its deadline it still
    held its cgroups, its netns and egress proxy when it had them, its disk overlay and
    directory, for ever. Now its deadline removes all that."""
    from forkd.engine import children as ch
    from forkd.engine import lifetimes
    from forkd.engine.lifecycle import ChildVM, Lifetime

    child = ch.fork(store, tiny, 1, lifetime=Lifetime(timeout_s=600)).children[0]  # type: ignore[arg-type]
    cgroup = ChildVM.adopt(child.path).cgroup
    power_off = "import ctypes; ctypes.CDLL(None).reboot(0x4321FEDC)"  # RB_POWER_OFF
    with pytest.raises(AgentError):  # the VM is gone before it answers
        ch.exec_in(child.id, ["python3", "-c", power_off], timeout=30)
    deadline = time.monotonic() + 30
    while ch.get(child.id).state() != "crashed":
        assert time.monotonic() < deadline, "the guest's power-off did not end its QEMU"
        time.sleep(0.1)
    acted = lifetimes.enforce(store, now=time.time() + 3600)  # type: ignore[arg-type]
    assert [(a.id, a.action) for a in acted] == [(child.id, "killed")], acted
    assert not child.path.exists()
    assert cgroup is None or not any(p.exists() for p in cgroup.paths.values())
    assert child.id not in {c.id for c in ch.list_children()}


def test_a_small_answer_may_not_be_a_64_mib_line(tmp_path: Path) -> None:
    """A ping, fixup, put, a background process's start/stdin/kill have small answers, but
    the host read up to 64 MiB for each (a line's protocol bound), and a process may have
    16 requests in flight to one child: a guest answering each with 64 MiB held ~4 GB of
    the daemon. Those answers are now bounded at SMALL_REPLY_LINE (8 MiB); an exec's
    collected output keeps the line bound."""
    big = "x" * (20 * MIB)
    line = _line({"id": "not-yours", "ok": True, "result": {"o": big}})  # made before
    CASES["big_line"] = lambda rid: line  # the measurement: this process serves it
    CASES["big_reply"] = lambda rid: _line({"id": rid, "ok": True, "result": {"o": big}})
    agent = HostileAgent(tmp_path / "agent.sock")
    try:
        client = AgentClient(tmp_path / "agent.sock", timeout=5)
        tracemalloc.start()
        try:
            with pytest.raises(AgentError, match="longer than"):
                client.request("ping", {"case": "big_line"}, timeout=5)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 20 * MIB, f"{peak / MIB:.0f} MiB read for a ping"
        client = AgentClient(tmp_path / "agent.sock", timeout=5)
        assert client.request("exec", {"case": "big_reply"}, timeout=30)["o"] == big
        client.close()
    finally:
        agent.close()
        CASES.pop("big_reply")
        CASES.pop("big_line")


# ---------------------------------------------------------------- the agent replaced in a real VM
PATCH_AGENT = """
import sys
_agent = sys.modules["__main__"]
_agent.OPS["proc_list"] = lambda req: {}
_agent.OPS["proc_wait"] = lambda req: {"running": False, "stdout": "not base64!"}
_agent.OPS["exec"] = lambda req: {"status": "exited", "exit_code": 0, "signal": "nine"}
"""


@pytest.mark.vm
def test_answers_of_a_replaced_agent_are_agent_errors_in_the_backend(
    store: object, tiny: str, cleanup_children: None,
) -> None:
    """Code in a sandbox runs as root, in the agent's own interpreter when it is an eval:
    it can replace how the agent answers. Answers without the fields the host reads were
    a KeyError (proc_list), a binascii.Error (proc_wait's output) or a msgspec
    ValidationError raised in the stream's thread (exec): 500s with "internal error".
    Each is now an AgentError saying the guest's answer does not match the protocol."""
    from forkd.controller.api import ExecRequest, ProcessWaitRequest
    from forkd.controller.backend import LocalBackend

    backend = LocalBackend(store)  # type: ignore[arg-type]
    from forkd.engine import children as ch

    child = ch.fork(store, tiny, 1).children[0]  # type: ignore[arg-type]
    assert ch.eval_in(child.id, PATCH_AGENT, timeout=60)["error"] is None
    with pytest.raises(AgentError, match="proc_list"):
        backend.processes(child.id)
    with pytest.raises(AgentError, match="base64"):
        backend.process_wait(child.id, "p1", ProcessWaitRequest(timeout=1))
    with pytest.raises(AgentError, match="exec"):
        list(backend.exec_stream(child.id, ExecRequest(argv=["true"])))
    ch.kill(child.id)


# ---------------------------------------------------------------- code generated in the guest
JIT = r"""
import ctypes, mmap
n = 1_000_000
buf = mmap.mmap(-1, n * 16, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
for i in range(n):  # mov eax, i; ret: a million distinct blocks for TCG to translate
    buf[i * 16:i * 16 + 6] = b"\xb8" + i.to_bytes(4, "little") + b"\xc3"
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
call = ctypes.CFUNCTYPE(ctypes.c_int)
for i in range(n):
    call(addr + i * 16)()
print("ran")
"""


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.mark.vm
def test_code_a_guest_generates_grows_its_qemu_by_a_bounded_cache(
    store: object, tiny: str, cleanup_children: None,
) -> None:
    """Under TCG, QEMU translates each new block of guest code into a cache that was 1 GiB
    by default: a guest writing and running a million distinct blocks grew its QEMU by
    ~700 MiB of host memory beyond its RAM (no memory limit is set by default). The cache
    is now TCG_TB_MIB (128 MiB); QEMU flushes it when full."""
    from forkd.engine import children as ch

    child = ch.fork(store, tiny, 1).children[0]  # type: ignore[arg-type]
    maps = Path(f"/proc/{child.pid}/maps").read_text().splitlines()
    spans = [int(b, 16) - int(a, 16) for a, b in
             (line.split()[0].split("-") for line in maps if line.split()[1] == "rwxp")]
    assert spans and max(spans) <= 160 * MIB, [s // MIB for s in spans]
    before = _rss_mib(child.pid)
    res = ch.exec_in(child.id, ["python3", "-c", JIT], timeout=900)
    assert res["stdout"].strip() == "ran", res
    grown = _rss_mib(child.pid) - before
    assert grown < 350, f"QEMU grew by {grown:.0f} MiB"
    ch.kill(child.id)
