"""forkd guest agent (runs in the guest as PID 1; stdlib only, Python >= 3.9).

Serves protocol version 2 (docs/agent-protocol.md): JSON lines over the virtio-serial port
given as argv[1]. Every request runs in its own thread, so many are in flight at once; each
frame the agent writes starts with the request's "id" (events: "ev", the final reply: "ok").
Commands run in their own session and process group (a timeout or kill ends the group) and
stream their output as it is produced. On start it writes one unsolicited hello line.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import ctypes
import errno
import fcntl
import io
import json
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

PROTOCOL = 2
ACCEPTED_VERSIONS = (1, 2)  # v1 requests mean what they meant; v2 adds ops and fields
MAX_LINE = 64 << 20
MAX_FILE = 32 << 20  # a file in one frame (put; get without stream)
MAX_STREAMED_FILE = 4 << 30  # get with stream: true
MAX_COLLECTED = 32 << 20  # per stream, an exec's output collected into its reply
MAX_PROC_BUFFER = 8 << 20  # per stream, a background process's output nobody has read yet
MAX_PROCS = 256  # background processes known at once (running or not yet waited for)
CHUNK = 1 << 20  # bytes of output or file per event frame (its binary payload)
PIPE_SIZE = 1 << 20
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
F_SETPIPE_SZ = 1031
FIONREAD = 0x541B
# A pipe that is still filling is left to fill for up to this long (in 1 ms steps while it
# grows) before its bytes go out as one frame: a writer that writes 4-8 KiB at a time then
# yields frames of up to CHUNK instead of one per write (each frame costs guest CPU).
GATHER_S = 0.02
# Safety net only: SIGIO wakes the idle agent when the host connects or sends.
IDLE_WAIT_S = 60.0
WRITE_GIVE_UP_S = 5.0  # a frame the host does not take for this long is dropped

NS = {"__name__": "__forkd__", "__builtins__": __builtins__}
NS_LOCK = threading.Lock()  # eval/run_code share one namespace and sys.stdout: one at a time


class ProtocolError(Exception):
    pass


class NotFoundError(Exception):
    """An unknown process handle or a missing file: error type not_found."""


class StateError(Exception):
    """The process is not in a state that allows this (kill of a finished process, stdin to
    a closed stdin): error type state."""


# The request path runs in every forked child, and every Python function, object and code
# page it touches there is a copied-on-write page (and guest code QEMU translates) per child.
# So it stays short: JSON through the C scanner/encoder directly, not json.loads/dumps' Python
# layers (same output as json.dumps with the default separators and ensure_ascii).
_DECODER = json.JSONDecoder()


def _no_default(o: object) -> object:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _make_encoder() -> Callable[[Any], str]:
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is not None:
        try:
            enc = make(None, _no_default, json.encoder.encode_basestring_ascii, None,
                       ": ", ", ", False, False, True)
            return lambda o: "".join(enc(o, 0))
        except TypeError:  # another signature (other Python versions)
            pass
    return json.dumps


_ENCODE = _make_encoder()


def _line(obj: object) -> bytes:
    return (_ENCODE(obj) + "\n").encode()


# ---------------------------------------------------------------- the channel
class Channel:
    """The port's write side, shared by every request thread: one frame at a time, written
    whole (offsets into one buffer, never re-sliced copies)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lock = threading.Lock()
        self._stage_pipe: tuple[int, int] | None = None  # see _stage

    def send(self, obj: dict[str, Any]) -> None:
        result = obj.get("result")
        blob = result.get("data") if isinstance(result, dict) else None
        if isinstance(blob, Base64Reply):
            self._send_base64(obj, blob.data)
            return
        data = _line(obj)
        with self.lock:
            self._write_all(data)

    def _send_base64(self, obj: dict[str, Any], data: bytes) -> None:
        """A reply whose result ends with "data": the base64 of data, encoded and written
        piece by piece into the one line (the same bytes as encoding it whole)."""
        assert isinstance(obj["result"], dict)
        line = _line({**obj, "result": {**obj["result"], "data": ""}})
        tail = b'""}}\n'
        if not line.endswith(tail):  # "data" is not the last key: encode it whole
            result = {**obj["result"], "data": base64.b64encode(data).decode()}
            self.send({**obj, "result": result})
            return
        view = memoryview(data)
        with self.lock:
            self._write_all(line[:-len(tail) + 1])  # up to the opening quote
            for off in range(0, len(view), BASE64_PIECE):
                self._write_all(base64.b64encode(view[off:off + BASE64_PIECE]))
            self._write_all(tail[1:])

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        off = 0
        give_up = None
        while off < len(data):
            try:
                off += os.write(self.fd, view[off:])
                give_up = None
            except OSError:
                # host side went away mid-frame: keep trying briefly, then drop the frame (the
                # host's reader skips an incomplete line)
                now = time.monotonic()
                give_up = give_up or now + WRITE_GIVE_UP_S
                if now > give_up:
                    return
                time.sleep(0.05)

    def event(self, rid: object, ev: str, data: bytes | memoryview) -> None:
        """A header line with the payload's size, then the raw bytes (no base64 or JSON
        encoding of the payload: under TCG those cost more than the transfer), written
        one after the other (not joined: a join is one more copy of the payload)."""
        head = _line({"id": rid, "ev": ev, "size": len(data)})
        with self.lock:
            self._write_all(head)
            self._write_all(data)

    def event_from(self, rid: object, ev: str, fd: int, n: int, offset: int | None) -> int:
        """An event whose n-byte payload goes from fd (a pipe, or with offset a file)
        straight into the port: splice / sendfile, so the bytes never pass through the
        agent (under TCG each copy of the payload costs about as much as the transfer).
        Returns the payload bytes that came from fd; a file that shrank meanwhile is
        padded with zeros to the n announced (the reply's count tells)."""
        head = _line({"id": rid, "ev": ev, "size": n})
        with self.lock:
            self._write_all(head)
            return self._move(fd, n, offset)

    def _stage(self, fd: int, n: int) -> int:
        """Move n bytes from pipe fd into the channel's own pipe (pipe to pipe: page
        references, no copy) and return its read end, which then holds exactly them. A
        virtio port's splice sends every buffer of the pipe it reads as one element, but
        fills only those within the length asked for: from a pipe its command keeps
        writing into, the rest would go out empty, and QEMU fails the device ("zero sized
        buffers are not allowed")."""
        if self._stage_pipe is None:
            r, w = os.pipe()
            with contextlib.suppress(OSError):
                fcntl.fcntl(w, F_SETPIPE_SZ, CHUNK)
            self._stage_pipe = r, w
        r, w = self._stage_pipe
        staged = 0
        try:
            while staged < n:
                staged += os.splice(fd, w, n - staged)
        except OSError:
            if staged == 0:
                _ZERO_COPY[True] = False  # no splice here: copy from fd from now on
                return fd
            self._write_staged(w, _read(fd, n - staged, None))
        return r

    @staticmethod
    def _write_staged(w: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]

    def _move(self, fd: int, n: int, offset: int | None) -> int:
        if offset is None and _ZERO_COPY[True]:
            fd = self._stage(fd, n)
        left = n
        give_up = None
        while left > 0 and _ZERO_COPY[offset is None]:
            try:
                if offset is None:
                    moved = os.splice(fd, self.fd, left)
                else:
                    moved = os.sendfile(self.fd, fd, offset, left)
                    offset += moved
            except OSError as exc:
                if exc.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) and left == n:
                    _ZERO_COPY[offset is None] = False  # this port cannot: copy from now on
                    break
                now = time.monotonic()  # the host went away mid-frame, as in _write_all
                give_up = give_up or now + WRITE_GIVE_UP_S
                if now > give_up:
                    return n - left + len(_read(fd, left, offset))  # drained, dropped
                time.sleep(0.05)
                continue
            if moved == 0:
                break  # the file ended early
            left -= moved
            give_up = None
        if left:  # no zero copy here, or a file shorter than it was: copy the rest
            data = _read(fd, left, offset)
            self._write_all(data)
            self._write_all(bytes(left - len(data)))
            left -= len(data)
        return n - left


# whether splice (True: from a pipe) / sendfile (False: from a file) into the port works
_ZERO_COPY = {True: True, False: True}


def _read(fd: int, n: int, offset: int | None) -> bytes:
    """Up to n bytes of fd (at offset: a file; else a pipe, read until n or EOF)."""
    if offset is not None:
        return os.pread(fd, n, offset)
    parts, got = [], 0
    while got < n and (piece := os.read(fd, n - got)):
        parts.append(piece)
        got += len(piece)
    return b"".join(parts)


CHANNEL: Channel | None = None
BASE64_PIECE = 3 << 16  # bytes base64-encoded at a time (a multiple of 3: no padding inside)


class Base64Reply:
    """Bytes a reply carries as base64 in its last field (a protocol-1 get). The channel
    encodes and writes them piece by piece: building the line whole held about five
    copies of the file in guest memory (base64 bytes, str, escaped str, joined line,
    encoded line), and a 16 MiB get ran the 160 MiB tiny guest out of memory (the kernel
    panicked, the host waited for a reply until its timeout)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Emitter:
    """The events of one request: bytes given, or bytes moved from a pipe or a file."""

    def __init__(self, ch: Channel, rid: object) -> None:
        self.ch, self.rid = ch, rid

    def __call__(self, ev: str, data: bytes | memoryview) -> None:
        self.ch.event(self.rid, ev, data)

    def splice(self, ev: str, fd: int, n: int) -> None:
        self.ch.event_from(self.rid, ev, fd, n, None)

    def sendfile(self, ev: str, fd: int, offset: int, n: int) -> int:
        return self.ch.event_from(self.rid, ev, fd, n, offset)


class Emit(Protocol):
    def __call__(self, ev: str, data: bytes | memoryview) -> None: ...


def _emit(rid: object) -> Emitter:
    assert CHANNEL is not None
    return Emitter(CHANNEL, rid)


def _reap_orphans() -> None:
    """PID 1 duty: collect orphaned zombies, but never a process some Proc waits for."""
    managed = {p.popen.pid for p in list(PROCS.values()) + list(FOREGROUND.values())}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in managed:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == b"Z" and fields[1] == b"1":
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(int(entry), os.WNOHANG)


PYTHON_VERSION = sys.version.split()[0]


def op_ping(req: dict[str, Any]) -> dict[str, Any]:
    # CLOCK_BOOTTIME is what /proc/uptime shows (no file objects on the request path: every
    # object a request touches costs a copied-on-write page in a forked child)
    up = round(time.clock_gettime(time.CLOCK_BOOTTIME), 2)
    return {"protocol": PROTOCOL, "uptime": up, "pid": os.getpid(),
            "python": PYTHON_VERSION, "hostname": socket.gethostname()}


# ---------------------------------------------------------------- processes
def _oom_kills() -> int:
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


_KILLED_RE = re.compile(rb"(?:Killed process|Out of memory: Killed process) (\d+)|"
                        rb"oom-kill:.*?,pid=(\d+)")


def _kmsg_oom_pids() -> set[int]:
    """Pids the kernel's OOM killer named in its log (/dev/kmsg, read without blocking)."""
    pids: set[int] = set()
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return pids
    try:
        for _ in range(100000):
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: a record was overwritten while reading; go on
                continue
            if not rec:
                break
            for m in _KILLED_RE.finditer(rec):
                pids.add(int(m.group(1) or m.group(2)))
    finally:
        os.close(fd)
    return pids


def _exec_env(req: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    env.setdefault("HOME", "/root")
    extra = req.get("env") or {}
    if not isinstance(extra, dict):
        raise ProtocolError("env must be an object of strings")
    env.update({str(k): str(v) for k, v in extra.items()})
    return env


def _argv(req: dict[str, Any]) -> list[str]:
    argv = req.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ProtocolError(f"{req.get('op')} needs argv: a non-empty list of strings")
    return argv


def _timeout(req: dict[str, Any], name: str = "timeout") -> float | None:
    t = req.get(name)
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
        raise ProtocolError(f"{name} must be a positive number of seconds")
    return float(t)


def _stdin_bytes(req: dict[str, Any]) -> bytes | None:
    stdin = req.get("stdin")
    if stdin is None:
        return None
    return base64.b64decode(stdin) if req.get("stdin_b64") else str(stdin).encode()


def _set_ctty() -> None:  # runs in the child between fork and exec (PTY only)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Sink:
    """Where one stream of a process goes: events to a request (streaming), a bounded
    buffer (collected into a reply, or kept for a background process's next reader)."""

    def __init__(self, name: str, bound: int, keep_tail: bool) -> None:
        self.name = name
        self.bound = bound
        self.keep_tail = keep_tail  # background: drop the oldest bytes; collected: the newest
        self.buf = bytearray()
        self.dropped = 0
        self.emit: Emitter | None = None
        self.lock = threading.Lock()

    def write(self, data: bytes) -> None:
        with self.lock:  # held while emitting: attach(None) never cuts a frame in flight
            if self.emit is not None:
                self.emit(self.name, data)
            else:
                self._keep(data)

    def move(self, fd: int, n: int) -> bool:
        """Send n bytes waiting in pipe fd as one event, straight from the pipe (False,
        nothing read, when this stream is not streaming: the caller reads them)."""
        with self.lock:
            if self.emit is None:
                return False
            self.emit.splice(self.name, fd, n)
            return True

    def _keep(self, data: bytes) -> None:
        self.buf += data
        over = len(self.buf) - self.bound
        if over > 0:
            self.dropped += over
            if self.keep_tail:
                del self.buf[:over]
            else:
                del self.buf[self.bound:]

    def attach(self, emit: Emitter | None) -> None:
        """Send what is buffered, then everything new, as events (None: buffer again)."""
        with self.lock:
            if emit is not None and self.buf:
                pending = bytes(self.buf)
                self.buf.clear()
                for i in range(0, len(pending), CHUNK):
                    emit(self.name, pending[i:i + CHUNK])
            self.emit = emit

    def take(self) -> bytes:
        with self.lock:
            data = bytes(self.buf)
            self.buf.clear()
            return data


class Proc:
    """One command in its own session (process group), its output pumped into sinks."""

    def __init__(self, req: dict[str, Any], background: bool, emit: Emitter | None) -> None:
        """emit: stream the output as events from its first byte (else it is kept)."""
        self.argv = _argv(req)
        self.timeout = _timeout(req)
        self.pty = bool(req.get("pty"))
        data = _stdin_bytes(req)
        keep_stdin = background or bool(req.get("stdin_open"))
        bound = MAX_PROC_BUFFER if background else MAX_COLLECTED
        self.stdout = Sink("stdout", bound, keep_tail=background)
        self.stderr = Sink("stderr", bound, keep_tail=background)
        self.stdout.emit = self.stderr.emit = emit
        self.t0 = time.monotonic()
        self.oom_before = _oom_kills()
        self.timed_out = False
        self.killed_by: int | None = None  # the signal a request sent
        self.result: dict[str, Any] | None = None
        self.done = threading.Event()
        self.stdin_lock = threading.Lock()
        self.popen, self.stdin_fd, outs = self._spawn(req, data is not None or keep_stdin)
        self.pgid = self.popen.pid
        self.pumps = [threading.Thread(target=self._pump, args=(fd, sink), daemon=True)
                      for fd, sink in outs]
        for t in self.pumps:
            t.start()
        if data is not None:
            threading.Thread(target=self._feed, args=(data, not keep_stdin), daemon=True).start()
        elif not keep_stdin:
            self.close_stdin()
        threading.Thread(target=self._wait, daemon=True).start()

    def _spawn(self, req: dict[str, Any], want_stdin: bool
               ) -> tuple[subprocess.Popen[bytes], int | None, list[tuple[int, Sink]]]:
        env = _exec_env(req)
        cwd = req.get("cwd") or "/"
        if self.pty:
            master, slave = os.openpty()
            rows, cols = int(req.get("rows") or 24), int(req.get("cols") or 80)
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
            env.setdefault("TERM", "xterm-256color")
            try:
                p = subprocess.Popen(self.argv, stdin=slave, stdout=slave, stderr=slave, env=env,
                                     cwd=cwd, start_new_session=True, preexec_fn=_set_ctty)
            except BaseException:
                os.close(master)
                raise
            finally:
                os.close(slave)
            return p, os.dup(master), [(master, self.stdout)]
        p = subprocess.Popen(self.argv, stdin=subprocess.PIPE if want_stdin else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=cwd,
                             start_new_session=True)
        outs = []
        for f, sink in ((p.stdout, self.stdout), (p.stderr, self.stderr)):
            assert f is not None
            fd = os.dup(f.fileno())
            f.close()
            with contextlib.suppress(OSError):
                fcntl.fcntl(fd, F_SETPIPE_SZ, PIPE_SIZE)
            outs.append((fd, sink))
        stdin_fd = None
        if p.stdin is not None:
            stdin_fd = os.dup(p.stdin.fileno())
            p.stdin.close()
        return p, stdin_fd, outs

    def _pump(self, fd: int, sink: Sink) -> None:
        try:
            if self.pty:
                self._pump_reads(fd, sink)
            else:
                self._pump_pipe(fd, sink)
        finally:
            os.close(fd)

    def _pump_pipe(self, fd: int, sink: Sink) -> None:
        """Until EOF: wait for the pipe, let it fill (GATHER_S), then move up to CHUNK of
        it as one event without copying it through the agent (Sink.move), or read it into
        the sink when nobody streams it."""
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            poller.poll()
            n = _gather(fd)
            if n == 0:
                return  # readable and empty: every writer closed it
            if not sink.move(fd, n):
                sink.write(os.read(fd, n))

    def _pump_reads(self, fd: int, sink: Sink) -> None:
        """A PTY (no splice from it): read until EOF, gathering what is already there
        into frames of up to CHUNK."""
        while True:
            try:
                data = os.read(fd, CHUNK)
            except OSError:  # EIO: the PTY's other side is gone
                data = b""
            if not data:
                return
            if len(data) < CHUNK:
                more = bytearray(data)
                while len(more) < CHUNK and select.select([fd], [], [], 0)[0]:
                    try:
                        piece = os.read(fd, CHUNK - len(more))
                    except OSError:
                        piece = b""
                    if not piece:
                        break
                    more += piece
                data = bytes(more)
            sink.write(data)

    def _feed(self, data: bytes, close: bool) -> None:
        with contextlib.suppress(OSError):
            self.write_stdin(data)
        if close:
            self.close_stdin()

    def write_stdin(self, data: bytes) -> None:
        with self.stdin_lock:
            if self.stdin_fd is None:
                raise StateError(f"the stdin of process {self.popen.pid} is closed")
            view = memoryview(data)
            off = 0
            while off < len(data):
                off += os.write(self.stdin_fd, view[off:])

    def close_stdin(self, final: bool = False) -> None:
        """Close stdin; on a PTY (until the process ends) send ^D, the terminal's EOF."""
        with self.stdin_lock:
            if self.stdin_fd is None:
                return
            if self.pty and not final:
                with contextlib.suppress(OSError):
                    os.write(self.stdin_fd, b"\x04")
                return
            with contextlib.suppress(OSError):
                os.close(self.stdin_fd)
            self.stdin_fd = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (what the command started, too)."""
        if self.done.is_set():
            raise StateError(f"process {self.popen.pid} already ended ({self.result_status()})")
        self.killed_by = sig
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _wait(self) -> None:
        try:
            code = self.popen.wait(self.timeout)
        except subprocess.TimeoutExpired:
            self.timed_out = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
            code = self.popen.wait()
        if self.timed_out or self.killed_by == signal.SIGKILL:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)  # stragglers that ignored the first one
        for t in self.pumps:
            t.join()
        self.close_stdin(final=True)
        self.result = self._result(code)
        self.done.set()
        _reap_orphans()

    def _result(self, code: int) -> dict[str, Any]:
        sig = -code if code < 0 else None
        oom = False
        if not self.timed_out and self.killed_by is None and (sig == 9 or code == 137):
            after = _oom_kills()
            named = _kmsg_oom_pids()
            oom = self.popen.pid in named or (after > self.oom_before >= 0)
        if self.timed_out:
            status = "timed_out"
        elif oom:
            status = "oom_killed"
        elif self.killed_by is not None and sig is not None:
            status = "killed"
        elif sig is not None:
            status = "signaled"
        else:
            status = "exited"
        return {"status": status, "exit_code": code, "signal": sig,
                "signal_name": signal.Signals(sig).name if sig else None,
                "timed_out": self.timed_out, "killed": status == "killed",
                "oom_killed": oom, "duration": time.monotonic() - self.t0, "pid": self.popen.pid,
                "stdout_dropped": self.stdout.dropped, "stderr_dropped": self.stderr.dropped}

    def result_status(self) -> str:
        return self.result["status"] if self.result else "running"


FOREGROUND: dict[object, Proc] = {}  # request id -> Proc of a running exec (for cancel)
PROCS: dict[str, Proc] = {}  # handle -> Proc of a background process
_PROC_LOCK = threading.Lock()
_HANDLES = iter(range(1, 1 << 62))


def _pipe_bytes(fd: int) -> int:
    return struct.unpack("i", fcntl.ioctl(fd, FIONREAD, b"\0\0\0\0"))[0]  # type: ignore[no-any-return]


def _gather(fd: int) -> int:
    """Bytes in pipe fd (at most CHUNK) once it stops growing, is full or GATHER_S passed."""
    n = _pipe_bytes(fd)
    deadline = time.monotonic() + GATHER_S
    while 0 < n < CHUNK and time.monotonic() < deadline:
        time.sleep(0.001)
        grown = _pipe_bytes(fd)
        if grown == n:
            break
        n = grown
    return min(n, CHUNK)


def _start(req: dict[str, Any], background: bool, emit: Emitter | None = None) -> Proc:
    try:
        return Proc(req, background, emit)
    except FileNotFoundError as e:
        raise _SpawnFailed(127, str(e)) from None
    except PermissionError as e:
        raise _SpawnFailed(126, str(e)) from None


class _SpawnFailed(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def op_exec(req: dict[str, Any]) -> dict[str, Any]:
    """Run a command to its end. stream: true sends its output as events while it runs."""
    rid = req.get("id")
    stream = bool(req.get("stream"))
    t0 = time.monotonic()
    try:
        p = _start(req, background=False, emit=_emit(rid) if stream else None)
    except _SpawnFailed as e:
        return {"status": "exited", "exit_code": e.code, "signal": None, "signal_name": None,
                "timed_out": False, "killed": False, "oom_killed": False,
                "duration": time.monotonic() - t0, "stdout": "", "stderr": str(e)}
    FOREGROUND[rid] = p
    try:
        p.done.wait()
    finally:
        FOREGROUND.pop(rid, None)
    res = dict(p.result or {})
    if not stream:
        res["stdout"] = p.stdout.take().decode("utf-8", "replace")
        res["stderr"] = p.stderr.take().decode("utf-8", "replace")
    return res


def op_cancel(req: dict[str, Any]) -> dict[str, Any]:
    """End a running exec, eval or run_code whose client went away (the host's relay
    sends this): an exec's process group is killed, a cell is interrupted (or skipped, if
    it has not started)."""
    target = req.get("target")
    if not isinstance(target, str | int):
        return {"cancelled": False}
    cell = CELLS.get(target)
    if cell is not None:
        cell.cancel()
        return {"cancelled": True}
    p = FOREGROUND.get(target)
    if p is None or p.done.is_set():
        return {"cancelled": False}
    with contextlib.suppress(StateError):
        p.kill(signal.SIGKILL)
    return {"cancelled": True}


def _proc(req: dict[str, Any]) -> Proc:
    handle = req.get("handle")
    p = PROCS.get(handle) if isinstance(handle, str) else None
    if p is None:
        raise NotFoundError(f"no process with handle {handle!r} (proc_list shows the known ones;"
                            " a handle is forgotten once proc_wait has returned its end)")
    return p


def _proc_view(handle: str, p: Proc) -> dict[str, Any]:
    return {"handle": handle, "pid": p.popen.pid, "argv": p.argv, "pty": p.pty,
            "status": p.result_status(), "running": not p.done.is_set(),
            "exit_code": p.result["exit_code"] if p.result else None,
            "started_s_ago": round(time.monotonic() - p.t0, 3)}


def op_proc_start(req: dict[str, Any]) -> dict[str, Any]:
    """Start a background process; its output waits in bounded buffers for proc_wait."""
    with _PROC_LOCK:
        if len(PROCS) >= MAX_PROCS:
            raise StateError(f"{MAX_PROCS} background processes are known already; "
                             "proc_wait the finished ones (or proc_kill some) first")
        try:
            p = _start(req, background=True)
        except _SpawnFailed as e:
            raise NotFoundError(f"cannot start {req.get('argv')!r}: {e}") from None
        handle = f"p{next(_HANDLES)}"
        PROCS[handle] = p
    return _proc_view(handle, p)


def op_proc_wait(req: dict[str, Any]) -> dict[str, Any]:
    """Wait for a background process (up to timeout seconds: then running: true). Its
    output so far and while waiting comes as events (stream: true, the default) or in the
    reply. When it has ended, the reply carries its result and the handle is forgotten."""
    p = _proc(req)
    wait_s = _timeout(req)
    stream = req.get("stream", True)
    if stream:
        emit = _emit(req.get("id"))
        p.stdout.attach(emit)
        p.stderr.attach(emit)
    try:
        ended = p.done.wait(wait_s)
    finally:
        if stream:
            p.stdout.attach(None)
            p.stderr.attach(None)
    res: dict[str, Any] = {"handle": req.get("handle"), "running": not ended}
    if ended:
        res.update(p.result or {})
        with _PROC_LOCK:
            PROCS.pop(str(req.get("handle")), None)
    if not stream:
        res["stdout"] = base64.b64encode(p.stdout.take()).decode()
        res["stderr"] = base64.b64encode(p.stderr.take()).decode()
    return res


def op_proc_stdin(req: dict[str, Any]) -> dict[str, Any]:
    """Write to a background process's stdin (data: base64); close: true closes it after."""
    p = _proc(req)
    if p.done.is_set():
        raise StateError(f"process {req.get('handle')} already ended ({p.result_status()})")
    data = base64.b64decode(req.get("data") or "")
    if data:
        try:
            p.write_stdin(data)
        except BrokenPipeError:
            raise StateError(f"process {req.get('handle')} closed its stdin") from None
    elif p.stdin_fd is None:
        raise StateError(f"the stdin of process {req.get('handle')} is closed")
    if req.get("close"):
        p.close_stdin()
    return {"bytes": len(data), "closed": p.stdin_fd is None or bool(req.get("close"))}


def op_proc_close_stdin(req: dict[str, Any]) -> dict[str, Any]:
    p = _proc(req)
    if p.stdin_fd is None:
        raise StateError(f"the stdin of process {req.get('handle')} is closed already")
    p.close_stdin()
    return {"closed": True}


def op_proc_kill(req: dict[str, Any]) -> dict[str, Any]:
    """Signal a background process's whole group (default SIGKILL)."""
    p = _proc(req)
    sig = req.get("signal", int(signal.SIGKILL))
    if isinstance(sig, str):
        try:
            sig = int(signal.Signals[sig if sig.startswith("SIG") else "SIG" + sig])
        except KeyError:
            raise ProtocolError(f"unknown signal {sig!r}") from None
    if isinstance(sig, bool) or not isinstance(sig, int) or not 0 < sig < 65:
        raise ProtocolError(f"signal must be a signal number or name, got {sig!r}")
    p.kill(sig)
    return {"handle": req.get("handle"), "signal": sig}


def op_proc_list(req: dict[str, Any]) -> dict[str, Any]:
    return {"processes": [_proc_view(h, p) for h, p in sorted(PROCS.items())]}


# ---------------------------------------------------------------- Python in the warm namespace
def _jsonable(v: object) -> object:
    try:
        _ENCODE(v)  # no circular check: a circular value ends in RecursionError
        return v
    except (TypeError, ValueError, RecursionError):
        return None


class _Capture(io.TextIOBase):
    """sys.stdout/sys.stderr during eval/run_code: kept for the reply, and sent as events
    too when the request streams."""

    def __init__(self, name: str, emit: Emit | None) -> None:
        self.name = name
        self.parts: list[str] = []
        self.emit = emit

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        self.parts.append(s)
        if self.emit is not None and s:
            self.emit(self.name, s.encode("utf-8", "replace"))
        return len(s)

    def getvalue(self) -> str:
        return "".join(self.parts)


class _Deadline:
    """Raises TimeoutError in the thread running a cell when its timeout passes, and never
    after the cell has ended (a pending one is cleared then)."""

    def __init__(self, timeout: float | None) -> None:
        self.tid = threading.get_ident()
        self.lock = threading.Lock()
        self.ended = False
        self.fired = False
        self.raised: type[BaseException] | None = None
        self.timer = None if timeout is None else threading.Timer(timeout, self._fire)
        if self.timer is not None:
            self.timer.start()

    def _fire(self) -> None:
        self.interrupt(TimeoutError)

    def interrupt(self, exc: type[BaseException]) -> None:
        """Raise ``exc`` in the cell's thread, unless it has ended (or been interrupted)."""
        with self.lock:
            if not self.ended and not self.fired:
                self.fired = True
                self.raised = exc
                _set_async_exc(self.tid, exc)

    def end(self) -> None:
        with self.lock:
            self.ended = True
            if self.timer is not None:
                self.timer.cancel()
            if self.fired:
                _set_async_exc(self.tid, None)  # not delivered yet: drop it


def _set_async_exc(thread_id: int, exc: type | None) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc is not None else None)


class _Cell:
    """A cell's request, for ``cancel`` (its client went away): one not yet running is
    skipped, a running one is interrupted (KeyboardInterrupt in its thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cancelled = False
        self.deadline: _Deadline | None = None

    def start(self, deadline: _Deadline) -> bool:
        with self.lock:
            self.deadline = deadline
            return not self.cancelled

    def cancel(self) -> None:
        with self.lock:
            self.cancelled = True
            deadline = self.deadline
        if deadline is not None:
            deadline.interrupt(KeyboardInterrupt)


CELLS: dict[object, _Cell] = {}  # request id -> a cell waiting or running (for cancel)


def _run_python(req: dict[str, Any], code: str
                ) -> tuple[object, str, str, dict[str, Any] | None]:
    rid = req.get("id")
    cell = _Cell()
    if isinstance(rid, str | int):
        CELLS[rid] = cell
    try:
        return _run_cell(req, code, cell)
    finally:
        if isinstance(rid, str | int):
            CELLS.pop(rid, None)


def _run_cell(req: dict[str, Any], code: str, cell: _Cell
              ) -> tuple[object, str, str, dict[str, Any] | None]:
    """Run code in the namespace (one request at a time), like a REPL: the value of a
    trailing expression is returned. (value, stdout, stderr, error)."""
    stream = bool(req.get("stream"))
    emit = _emit(req.get("id")) if stream else None
    out, err = _Capture("stdout", emit), _Capture("stderr", emit)
    timeout = _timeout(req)
    value = None
    error: dict[str, Any] | None = None
    with NS_LOCK:
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        deadline = _Deadline(timeout)
        try:
            try:
                try:
                    if not cell.start(deadline):
                        raise KeyboardInterrupt  # cancelled while it waited its turn
                    expr = _compile_expr(code)
                    value = eval(expr, NS) if expr is not None else _exec_repl(code)
                finally:
                    deadline.end()
            except BaseException as e:  # the caller's code may raise anything
                error = {"type": type(e).__name__, "message": str(e),
                         "traceback": traceback.format_exc()}
                if isinstance(e, TimeoutError) and deadline.raised is TimeoutError:
                    error["message"] = f"the code ran longer than its timeout of {timeout} s"
                    error["timed_out"] = True
                elif isinstance(e, KeyboardInterrupt) and cell.cancelled:
                    error["message"] = "the cell was cancelled: its client went away"
                    error["cancelled"] = True
        finally:
            sys.stdout, sys.stderr = saved
    return value, out.getvalue(), err.getvalue(), error


def op_eval(req: dict[str, Any]) -> dict[str, Any]:
    code = req.get("code")
    if not isinstance(code, str):
        raise ProtocolError("eval needs code: a string of Python")
    value, out, err, error = _run_python(req, code)
    return {"value": _jsonable(value), "repr": None if value is None else repr(value),
            "stdout": out, "stderr": err, "error": error}


def _compile_expr(code: str) -> Any:
    """A single expression compiles directly, with no AST objects on the way; else None."""
    try:
        return compile(code, "<eval>", "eval")
    except (SyntaxError, ValueError):
        return None


def _exec_repl(code: str) -> object:
    """Run statements; the value of a trailing expression is returned, like a REPL."""
    tree = ast.parse(code, "<eval>", "exec")
    last = None
    tail = tree.body[-1] if tree.body else None
    if isinstance(tail, ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, "<eval>", "exec"), NS)
    if last is not None:
        return eval(compile(last, "<eval>", "eval"), NS)
    return None


_MIME = (("_repr_html_", "html"), ("_repr_markdown_", "markdown"), ("_repr_svg_", "svg"),
         ("_repr_latex_", "latex"), ("_repr_json_", "json"))


def _figure_png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode()


def _is_figure(v: object) -> bool:
    fig_mod = sys.modules.get("matplotlib.figure")
    return fig_mod is not None and isinstance(v, fig_mod.Figure)


def _rich(value: object, main: bool) -> dict[str, Any]:
    """One result the way E2B's code interpreter returns it: text always, and whichever of
    png/html/markdown/svg/latex/json/jpeg the object can render itself as."""
    res: dict[str, Any] = {"text": repr(value), "is_main_result": main}
    if _is_figure(value):
        res["png"] = _figure_png(value)
    for attr, key in _MIME:
        fn = getattr(value, attr, None)
        if callable(fn) and not isinstance(value, type):
            with contextlib.suppress(Exception):
                out = fn()
                if out is not None:
                    res[key] = out if isinstance(out, (str, dict, list)) else str(out)
    for attr, key in (("_repr_png_", "png"), ("_repr_jpeg_", "jpeg")):
        fn = getattr(value, attr, None)
        if callable(fn) and key not in res and not isinstance(value, type):
            with contextlib.suppress(Exception):
                out = fn()
                if isinstance(out, bytes):
                    res[key] = base64.b64encode(out).decode()
    return res


def _open_figures(skip: object) -> list[dict[str, Any]]:
    """PNG results of every pyplot figure the code left open (then closed, like a notebook
    cell's display), except `skip` (the main result, rendered once)."""
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        fig = plt.figure(num)
        if fig is not skip:
            out.append(_rich(fig, main=False))
    plt.close("all")
    return out


def op_run_code(req: dict[str, Any]) -> dict[str, Any]:
    """Code-interpreter cell: eval plus rich results (figures as PNG, DataFrames as HTML)."""
    code = req.get("code")
    if not isinstance(code, str):
        raise ProtocolError("run_code needs code: a string of Python")
    value, out, err, error = _run_python(req, code)
    with NS_LOCK:
        results = []
        try:
            results = _open_figures(value)
            if value is not None:
                results.append(_rich(value, main=True))
        except Exception as e:  # a repr that fails is the code's error, not the agent's
            if error is None:
                error = {"type": type(e).__name__, "message": str(e),
                         "traceback": traceback.format_exc()}
    return {"results": results, "stdout": out, "stderr": err, "error": error,
            "value": _jsonable(value), "repr": None if value is None else repr(value)}


# ---------------------------------------------------------------- files
def _guest_path(req: dict[str, Any]) -> str:
    path = req.get("path")
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise ProtocolError(f"{req.get('op')} needs path: an absolute guest path")
    return path


def op_put(req: dict[str, Any]) -> dict[str, Any]:
    path = _guest_path(req)
    data = base64.b64decode(req.get("data", ""))
    if len(data) > MAX_FILE:
        raise ProtocolError("put: file larger than 32 MiB")
    os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
    tmp = path + ".forkd-tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.chmod(tmp, int(req.get("mode", 0o644)))
    os.replace(tmp, path)
    return {"bytes": len(data)}


def op_get(req: dict[str, Any]) -> dict[str, Any]:
    """A file's bytes: in the reply (up to 32 MiB), or with stream: true as "chunk" events
    of up to 1 MiB each (up to 4 GiB)."""
    path = _guest_path(req)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise NotFoundError(f"no file {path} in the guest") from None
    with os.fdopen(fd, "rb", buffering=0) as f:
        size = os.fstat(fd).st_size
        if not req.get("stream"):
            if size > MAX_FILE:
                raise ProtocolError(f"get: {path} is {size} bytes, more than 32 MiB; "
                                    "ask with stream: true")
            data = f.read()
            return {"bytes": len(data), "data": Base64Reply(data)}  # last: see Channel.send
        if size > MAX_STREAMED_FILE:
            raise ProtocolError(f"get: {path} is {size} bytes, more than 4 GiB")
        emit = _emit(req.get("id"))
        total = 0
        while total < size:  # what it holds now goes from the page cache to the port
            n = min(CHUNK, size - total)
            got = emit.sendfile("chunk", fd, total, n)
            total += got
            if got < n:  # it shrank meanwhile (the frame was padded): the count says so
                return {"bytes": total}
        os.lseek(fd, total, os.SEEK_SET)
        while total <= MAX_STREAMED_FILE:  # what was appended meanwhile, or a /proc file
            chunk = f.read(CHUNK)
            if not chunk:
                break
            emit("chunk", chunk)
            total += len(chunk)
        return {"bytes": total}


def op_fixup(req: dict[str, Any]) -> dict[str, Any]:
    """After a restore: clock, fresh entropy (kernel CRNG + Python/numpy PRNGs), hostname."""
    res: dict[str, Any] = {}
    if "time" in req:
        before = time.time()
        time.clock_settime(time.CLOCK_REALTIME, float(req["time"]))
        res["clock_skew"] = float(req["time"]) - before
    if "seed" in req:
        seed = bytes.fromhex(req["seed"])
        if len(seed) < 16:
            raise ProtocolError("fixup seed must be at least 16 bytes (32 hex digits)")
        fd = os.open("/dev/urandom", os.O_WRONLY)
        try:
            fcntl.ioctl(fd, RNDADDENTROPY, struct.pack("ii", len(seed) * 8, len(seed)) + seed)
            try:
                fcntl.ioctl(fd, RNDRESEEDCRNG)
                res["crng_reseeded"] = True
            except OSError as e:
                res["crng_reseeded"] = False
                res["reseed_error"] = str(e)
        finally:
            os.close(fd)
        random.seed(int.from_bytes(os.urandom(32), "little"))  # an int: no sha512 on the way
        reseeded = ["random"]
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(int.from_bytes(os.urandom(4), "little"))
            reseeded.append("numpy")
        res["prng_reseeded"] = reseeded
    if "hostname" in req:
        name = str(req["hostname"])
        socket.sethostname(name)
        res["hostname"] = name
    net = req.get("net")
    if net:
        res["net"] = _net_fixup(net)
    return res


SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
SIOCSIFADDR, SIOCSIFNETMASK, SIOCSIFHWADDR, SIOCADDRT = 0x8916, 0x891C, 0x8924, 0x890B
IFF_UP, RTF_UP, RTF_GATEWAY, ARPHRD_ETHER = 0x1, 0x1, 0x2, 1


def _sockaddr_in(ip: str) -> bytes:
    return struct.pack("=H2s4s8x", socket.AF_INET, b"\0\0", socket.inet_aton(ip))


def _ifreq(name: str, payload: bytes) -> bytes:
    return struct.pack("16s", name.encode()) + payload.ljust(24, b"\0")


def _net_fixup(net: dict[str, Any]) -> dict[str, Any]:
    """A new network identity with plain ioctls (no iproute2 needed in the guest):
    {"ifname": "eth0", "mac": "02:..", "address": "10.200.1.7/16", "gateway": "10.200.0.1"}."""
    ifname = str(net.get("ifname", "eth0"))
    done = []
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        if net.get("mac"):
            mac = bytes.fromhex(str(net["mac"]).replace(":", ""))
            fcntl.ioctl(s, SIOCSIFHWADDR, _ifreq(ifname, struct.pack("=H6s", ARPHRD_ETHER, mac)))
            done.append("mac")
        if net.get("address"):
            addr, _, plen = str(net["address"]).partition("/")
            bits = int(plen or 32)
            mask = socket.inet_ntoa(struct.pack("!I", (0xFFFFFFFF << (32 - bits)) & 0xFFFFFFFF))
            fcntl.ioctl(s, SIOCSIFADDR, _ifreq(ifname, _sockaddr_in(addr)))
            fcntl.ioctl(s, SIOCSIFNETMASK, _ifreq(ifname, _sockaddr_in(mask)))
            done.append("address")
        flags = struct.unpack_from("=H", fcntl.ioctl(s, SIOCGIFFLAGS, _ifreq(ifname, b"")), 16)[0]
        if not flags & IFF_UP:
            fcntl.ioctl(s, SIOCSIFFLAGS, _ifreq(ifname, struct.pack("=H", flags | IFF_UP)))
        if net.get("gateway"):
            # struct rtentry (x86_64): default route via the gateway
            rt = struct.pack("=Q16s16s16sHh4xQQh6xQQQH6x", 0, _sockaddr_in("0.0.0.0"),
                             _sockaddr_in(str(net["gateway"])), _sockaddr_in("0.0.0.0"),
                             RTF_UP | RTF_GATEWAY, 0, 0, 0, 0, 0, 0, 0, 0)
            with contextlib.suppress(FileExistsError):
                fcntl.ioctl(s, SIOCADDRT, rt)
            done.append("gateway")
    finally:
        s.close()
    return {"changed": done}


def op_sync(req: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    os.sync()
    if req.get("drop_caches"):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
    return {"duration": time.monotonic() - t0}


OPS = {"ping": op_ping, "exec": op_exec, "eval": op_eval, "run_code": op_run_code,
       "put": op_put, "get": op_get, "fixup": op_fixup, "sync": op_sync, "cancel": op_cancel,
       "proc_start": op_proc_start, "proc_wait": op_proc_wait, "proc_stdin": op_proc_stdin,
       "proc_close_stdin": op_proc_close_stdin, "proc_kill": op_proc_kill,
       "proc_list": op_proc_list}
# answered on the reading thread (quick, and fixup must finish before anything else runs)
INLINE = {"ping", "fixup", "cancel", "proc_list"}


def _error(rid: object, kind: str, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"type": kind, "message": message}}


def handle(req: dict[str, Any]) -> dict[str, Any]:
    rid = req.get("id")
    try:
        op = OPS[str(req.get("op"))]
        return {"id": rid, "ok": True, "result": op(req)}
    except ProtocolError as e:
        return _error(rid, "protocol", str(e))
    except (NotFoundError, FileNotFoundError) as e:
        return _error(rid, "not_found", str(e) if isinstance(e, NotFoundError)
                      else f"{type(e).__name__}: {e}")
    except StateError as e:
        return _error(rid, "state", str(e))
    except (ValueError, TypeError) as e:
        return _error(rid, "protocol", f"bad request: {e}")
    except Exception as e:
        return _error(rid, "guest", f"{type(e).__name__}: {e}")


def _serve_one(req: dict[str, Any]) -> None:
    assert CHANNEL is not None
    CHANNEL.send(handle(req))


def dispatch(line: bytes) -> None:
    """Parse one request line and answer it: inline for quick ops, else on its own thread."""
    assert CHANNEL is not None
    try:
        req = _DECODER.decode(line.decode())
    except ValueError as e:
        CHANNEL.send(_error(None, "protocol", f"bad request: {e}"))
        return
    if not isinstance(req, dict):
        CHANNEL.send(_error(None, "protocol", "a request must be a JSON object"))
        return
    rid = req.get("id")
    if req.get("v", 1) not in ACCEPTED_VERSIONS:
        CHANNEL.send(_error(rid, "protocol", f"unsupported protocol version {req.get('v')!r}; "
                                             f"this agent speaks {list(ACCEPTED_VERSIONS)}"))
        return
    op = str(req.get("op"))
    if op not in OPS:
        CHANNEL.send(_error(rid, "protocol", f"unknown op {req.get('op')!r}; known: {sorted(OPS)}"))
        return
    if op in INLINE:
        _serve_one(req)
    else:
        threading.Thread(target=_serve_one, args=(req,), daemon=True).start()


def _port_events(fd: int) -> int:
    """A pipe that becomes readable when the port's state changes. With no host connected,
    read() on a virtio-serial port returns EOF at once and poll() reports POLLHUP, so neither
    can wait; but virtio_console raises SIGIO on an O_ASYNC port when the host connects or
    disconnects and when data arrives. The signal's wake-up fd is that pipe."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    signal.signal(signal.SIGIO, lambda signum, frame: None)
    fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_ASYNC)
    return r


def serve(port: str) -> None:
    global CHANNEL
    fd = os.open(port, os.O_RDWR)
    events = _port_events(fd)
    CHANNEL = Channel(fd)
    CHANNEL.send({"hello": {"protocol": PROTOCOL, "agent": "forkd-agent",
                            "versions": list(ACCEPTED_VERSIONS), **op_ping({})}})
    buf = bytearray()
    scanned = 0  # bytes at the start of buf known to hold no newline
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except OSError:
            chunk = b""
        if not chunk:
            # Host side not connected: read() returned EOF at once. Whatever part of a line
            # the last host sent is dropped (a new host starts with a new line). Sleep until
            # SIGIO (a signal raised after the read() is still in the pipe), then drain the
            # pipe before reading again. No periodic wake-ups while idle.
            buf.clear()
            scanned = 0
            select.select([events], [], [], IDLE_WAIT_S)
            with contextlib.suppress(OSError):
                os.read(events, 4096)
            continue
        buf += chunk
        start = 0
        while True:
            i = buf.find(b"\n", max(scanned, start))
            if i < 0:
                break
            line = bytes(buf[start:i])
            start = i + 1
            if line.strip():
                dispatch(line)
        if start:
            del buf[:start]
        scanned = len(buf)
        if len(buf) > MAX_LINE:
            buf.clear()
            scanned = 0
            CHANNEL.send(_error(None, "protocol", "request line longer than 64 MiB"))


def main() -> None:
    os.environ.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    os.environ.setdefault("HOME", "/root")
    with contextlib.suppress(OSError):
        socket.sethostname("forkd")
    with contextlib.suppress(OSError):
        subprocess.run(["ip", "link", "set", "lo", "up"], stderr=subprocess.DEVNULL, check=False)
    print(f"FORKD-AGENT protocol={PROTOCOL} port={sys.argv[1]}", flush=True)
    serve(sys.argv[1])


if __name__ == "__main__":
    main()
