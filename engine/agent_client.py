"""Host side of the guest agent protocol (docs/agent-protocol.md).

AgentClient speaks the protocol over one unix socket: QEMU's agent socket itself (a build,
a waiting process before it becomes a child) or a child's relay socket. QEMU's socket
chardev takes one client at a time, so for a running child one relay process per child
(`python -m forkd.engine.agent_client relay DIR`, started on demand by ``connect_child``)
owns that connection and multiplexes any number of clients over it, from any process:
requests carry ids unique per client connection's process, and the relay routes every
frame the agent sends back to the client whose request it answers.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import errno
import fcntl
import itertools
import json
import os
import re
import secrets
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from forkd import jsondoc
from forkd.engine.commands import (
    check_command,
    check_guest_path,
    check_mode,
    check_payload,
    check_timeout,
)
from forkd.engine.errors import AgentError
from forkd.engine.paths import unix_address
from forkd.engine.qmp import MAX_LINE, LineSocket, LineTooLong, connect_unix
from forkd.errors import Conflict, NotFound
from forkd.names import inert, shown
from forkd.shares import Shares

PROTOCOL = 2
RELAY_SOCKET = "agent-mux.sock"
RELAY_LOCK = "agent-mux.lock"
RELAY_LOG = "agent-mux.log"
RELAY_IDLE_S = 30.0  # a relay with no client and no request in flight exits after this
RELAY_START_S = 10.0  # how long connect_child waits for a relay it started to listen
CLIENT_BUFFER = 16 << 20  # relay: bytes queued for one client before the agent is not read
SLOW_CLIENT_S = 60.0  # relay: a client that takes none of its queued bytes this long is dropped
# relay: request bytes queued for the agent before no client is read (a guest that stops
# reading its port made the relay hold every request sent to it, 43 MiB per ``put``)
AGENT_QUEUE = 16 << 20
# relay: a line from the agent longer than this is passed on as it arrives (to the client
# its head names, or to nobody), not held whole: a guest that wrote a line without end made
# its relay hold 128 MiB, and a 64 MiB reply three copies of it, per child and outside the
# child's memory limit. Its client's own bound on a line (MAX_LINE, SMALL_REPLY_LINE) and
# CLIENT_BUFFER's backpressure bound the rest.
LONG_LINE = 64 << 10
REPLY_MARGIN_S = 30.0  # host wait beyond a request's own guest-side timeout
# an event's binary payload: the agent sends at most 1 MiB (engine/guest/agent.py CHUNK); a
# hostile one sending more must not make each queued frame of a stream 16 times larger
MAX_EVENT = 2 << 20
# An event's header line (with its newline) at most: the relay reads a payload's size from
# no longer one (it skips no payload after it), and a client refuses one (AgentClient),
# so the two never disagree about where the payload ends. The agent's are ~60 bytes.
EVENT_HEAD_MAX = 4096
DEFAULT_REQUEST_S = 30.0  # quick ops (ping, fixup, put, get, proc_*) without their own timeout
# bytes of a frame outside its strings (keys, numbers, brackets): a parser makes up to ~20
# times as much memory of them, so a 64 MiB line of ``[],[],..`` held 1.4 GB of the host
# (per request in flight). A frame's bulk (output, a file's base64) is strings, which parse
# to about their own size; its structure is a few hundred bytes, or an eval's value (a
# list of a million numbers is ~7 MiB of structure).
MAX_STRUCTURE = 8 << 20
# the reply line of an op whose answer is small (a status, a handle, the argv it echoes:
# at most 1 MiB, ~6 when every byte is escaped): a hostile guest answering each of the 16
# requests a process may have in flight to it with a 64 MiB line held ~4 GB of the host
SMALL_REPLY_LINE = 8 << 20
SMALL_REPLY_OPS = frozenset({"ping", "fixup", "sync", "cancel", "put", "proc_start",
                             "proc_stdin", "proc_close_stdin", "proc_kill"})
# What the replies being read in one process may hold together past REPLY_FREE bytes each
# (a receive buffer's high-water mark, kept until its request returns): without it, the
# MAX_REQUESTS (32) requests a controller may have in flight, each answered by a hostile
# guest with a MAX_LINE (64 MiB) line, held 2 GiB of buffers and more parsed. Four replies
# of the largest size fit; a reply that would pass it fails (AgentError) and is not read.
REPLY_FREE = SMALL_REPLY_LINE
REPLY_BUDGET = 256 << 20
# What parsing a reply makes is counted too, not only its bytes: each JSON value becomes a
# Python object of its own and a slot (8 bytes) in its container, so a 60 MiB line of short
# strings, under MAX_STRUCTURE and counted as 52 MiB, parsed into 331 MiB (889 at the
# parse's peak), and an 8 MiB line of ``{},``, counted as nothing, into 193 MiB. A line
# over CHECKED_LINE is counted, before it is parsed, as its bytes plus, per value, what
# parsing makes of it past its text (parsed_size); a shorter one cannot pass REPLY_FREE.
PER_CONTAINER = 72  # an empty list 56, a dict 64; and its slot
PER_STRING = 57  # a str 49 past its text; and its slot
PER_SCALAR = 32  # an int 28, a float 24; and its slot
CHECKED_LINE = 96 << 10  # at most 2 values in 3 bytes: under 7 MiB of objects
MIB = 1 << 20


class ReplyBudget(Shares):
    """The bytes replies in this process hold past ``REPLY_FREE`` each, at most ``limit``;
    one server's client (REQUEST_CLIENT) at most half of it with all its replies."""

    @property
    def limit(self) -> int:
        return self.total

    def take(self, n: int, what: str, own: int = 0, client: str | None = None) -> None:
        """``n`` more bytes for a reply that holds ``own`` already, else AgentError. A
        client that reads its answers slowly (keeping them counted, KeptReplies) cannot
        take every large reply from the others."""
        refused = self.take_or_refuse(n, client)
        if refused is None:
            return
        others = (refused.held - own) / MIB
        if refused.bound == "client":
            raise AgentError(
                f"{what}: its reply (as read and as parsed) passed {REPLY_FREE / MIB:g} MiB "
                f"while this client's ({client}) other replies held "
                f"{others:.1f} MiB past theirs (at most {self.share / MIB:g} MiB, half of the "
                f"{self.limit / MIB:g} MiB of this process); it was dropped and the "
                "connection closed. Read your answers as they come, ask for less at "
                "once (stream a command's output, read a file in parts), or retry when "
                "fewer of your large replies are in flight")
        raise AgentError(
            f"{what}: its reply (as read and as parsed) passed {REPLY_FREE / MIB:g} MiB "
            f"while the other replies being read in this process held "
            f"{others:.1f} MiB past theirs (at most {self.limit / MIB:g} MiB in all); it was "
            "dropped and "
            "the connection closed. Ask for less at once (stream a command's output, read "
            "a file in parts) or retry when fewer large replies are in flight")


BUDGET = ReplyBudget(REPLY_BUDGET)
# Who the request this thread serves is for: the listener's client (server.peer_of: a uid
# on the daemon's Unix socket, an address on TCP), set per request by the daemon and by
# `forkd mcp`'s HTTP listener; None in process (one caller: no share to keep). Shares of
# the reply budget and of the guest requests (children._admitted) are kept per client.
REQUEST_CLIENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "forkd_request_client", default=None)


class _ReplyHold:
    """One request's share of a ReplyBudget: its receive buffer's high-water mark past
    ``REPLY_FREE``, given back when the request returns (its reply is parsed by then), or
    in a server once its answer is sent (KeptReplies); counted for its client."""

    def __init__(self, budget: ReplyBudget, what: str) -> None:
        self.budget = budget
        self.what = what
        self.taken = 0
        self.client = REQUEST_CLIENT.get()

    def grow(self, size: int) -> None:
        want = size - REPLY_FREE
        if want > self.taken:
            self.budget.take(want - self.taken, self.what, self.taken, self.client)
            self.taken = want

    def release(self) -> None:
        self.budget.give(self.taken, self.client)
        self.taken = 0


class KeptReplies:
    """The reply budgets of one server request's guest replies, kept once each reply is
    parsed instead of given back: the parsed reply lives on until the request's answer
    has been sent (converted, encoded, written to a client that may read slowly). The
    server gives them back when its request ends (``release``); a reply parsed after that
    (a stream's producer thread outliving its request) is given back at once."""

    def __init__(self) -> None:
        self._holds: list[_ReplyHold] = []
        self._lock = threading.Lock()
        self._released = False

    def keep(self, hold: _ReplyHold) -> bool:
        """Keep ``hold`` until ``release``; False (not kept) once released."""
        with self._lock:
            if not self._released:
                self._holds.append(hold)
            return not self._released

    def release(self) -> None:
        with self._lock:
            self._released = True
            holds, self._holds = self._holds, []
        for hold in holds:
            hold.release()


# The KeptReplies of the server request this thread serves (server.BoundedProtocol sets
# one per request); None in process (one caller, which has its answer at once): a reply's
# budget is given back when its request returns.
KEPT_REPLIES: contextvars.ContextVar[KeptReplies | None] = contextvars.ContextVar(
    "forkd_kept_replies", default=None)

OnData = Callable[[bytes], None]


def _new_ids() -> Callable[[], str]:
    """Request ids unique across every client of one relay: pid, a random tag, a counter."""
    tag = f"{os.getpid():x}-{secrets.token_hex(4)}"
    counter = itertools.count(1)
    return lambda: f"{tag}-{next(counter)}"


def _raise_for(op: str, reply: dict[str, Any]) -> None:
    err = reply["error"]  # an object (parse_frame)
    # the guest's words, bounded: they go into an error the API returns and logs keep
    message = inert(err.get("message", "no message"), 2000)
    kind = err.get("type")
    if kind == "not_found":
        raise NotFound(f"{op}: {message}")
    if kind == "state":
        raise Conflict(f"{op}: {message}")
    raise AgentError(f"guest agent refused {op!r}: {message}")


_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")


class ProtocolViolation(ValueError):
    """A frame from the guest agent that the host must not take (parse_frame)."""


def parsed_size(line: bytes, structure: bytes, strings: int) -> int:
    """At most about the bytes parsing ``line`` makes, ``structure`` being what is outside
    its ``strings`` strings (jsondoc.skeleton_and_strings): its text, and per value (the
    frame's, the first in each container that is not ``[]`` or ``{}``, then one after each
    ``,`` and ``:``) its object and slot. Over-counted, never under (``[ ]`` is not seen
    as empty)."""
    containers = structure.count(b"[") + structure.count(b"{")
    empty = structure.count(b"[]") + structure.count(b"{}")
    values = 1 + containers - empty + structure.count(b",") + structure.count(b":")
    scalars = max(0, values - containers - strings)
    return (len(line) + PER_CONTAINER * containers + PER_STRING * strings
            + PER_SCALAR * scalars)


def parse_frame(line: bytes, structure: bytes | None = None) -> dict[str, Any] | None:
    """A line the guest agent sent, as a frame. The guest is the untrusted side (root in it
    can replace the agent): None for a line that is not a JSON object at all, which a reader
    skips (the tail of a frame a previous host connection took part of); ProtocolViolation
    for an object the host must not take: nested past the parser's recursion limit, more
    structure than MAX_STRUCTURE, a key twice (the relay routes by the first ``id``, a
    parser would keep the last), or frame fields of the wrong type. NaN and Infinity are
    taken: the agent sends them for an eval's float value (json's allow_nan), agents in
    existing snapshots included; the API's encoder writes them as null."""
    text = line  # not stripped: a copy of up to 64 MiB (json takes the whitespace)
    if _OBJECT_START.match(text) is None:
        return None
    if len(text) > MAX_STRUCTURE and len(
            jsondoc.skeleton(text) if structure is None else structure) > MAX_STRUCTURE:
        raise ProtocolViolation(f"a frame with more than {MAX_STRUCTURE} bytes of structure "
                                "outside its strings")
    twice: list[str | None] = []  # per object as it closes: the outermost closes last
    try:
        frame = json.loads(text, object_pairs_hook=lambda pairs: _keys(pairs, twice))
    except RecursionError:
        raise ProtocolViolation("a frame nested deeper than the host parses") from None
    except ValueError:
        return None  # not JSON: skipped, as the protocol says
    if not isinstance(frame, dict):
        return None
    if twice[-1] is not None:  # in the frame's own fields; a value's (an eval of
        # {1: "a", "1": "b"} encodes "1" twice) is the guest's data, not routing
        raise ProtocolViolation(f"key {shown(twice[-1])} twice in the frame")
    _check_frame(frame)
    return frame


def _keys(pairs: list[tuple[str, Any]], twice: list[str | None]) -> dict[str, Any]:
    out = dict(pairs)
    twice.append(jsondoc.repeated_key(pairs, out))
    return out


def _check_frame(frame: dict[str, Any]) -> None:
    """The frame fields the host acts on have the protocol's types (docs/agent-protocol.md,
    "Frames"); what a result holds is checked where it is used."""
    if "hello" in frame and not isinstance(frame["hello"], dict):
        raise ProtocolViolation("a hello that is not an object")
    if "id" not in frame:
        return  # the hello, or a line no request's reader takes
    rid = frame["id"]
    if not isinstance(rid, str | int) and rid is not None:  # the relay echoes a bad one
        raise ProtocolViolation(f"a frame whose id is {type(rid).__name__}, not a string")
    if "ev" in frame:
        if not isinstance(frame["ev"], str):
            raise ProtocolViolation("an event whose name is not a string")
        return
    if not isinstance(frame.get("ok"), bool):
        raise ProtocolViolation("a frame that is neither an event nor a reply with ok "
                                "true or false")
    if frame["ok"]:
        if not isinstance(frame.get("result", {}), dict):
            raise ProtocolViolation("a reply whose result is not an object")
    elif not isinstance(frame.get("error"), dict):
        raise ProtocolViolation("a refusal whose error is not an object")


def guest_b64(value: Any, op: str) -> bytes:
    """A base64 field of the guest agent's reply (a missing one is empty); AgentError
    when it is not base64 (the guest is the untrusted side)."""
    try:
        return base64.b64decode(value or "", validate=True)
    except (TypeError, ValueError) as exc:  # binascii.Error is a ValueError
        raise AgentError(f"the guest agent's answer to {op} has a field that is not "
                         f"base64 ({exc}); its sandbox may be damaged: kill it") from None


STOP_POLL_S = 0.5  # how often a request with a ``stop`` asks it while no frame arrives


class Abandoned(Exception):
    """The caller stopped waiting for a request (its ``stop`` said so): the connection was
    closed, so the relay cancels the request in the guest."""


class AgentClient:
    """One connection to a guest agent (directly or through a child's relay). Requests on
    one client are sequential; open one client per concurrent caller (they are cheap: a
    unix connect to the relay)."""

    def __init__(self, path: Path, *, timeout: float = 10.0,
                 alive: Callable[[], bool] | None = None,
                 sock: socket.socket | None = None) -> None:
        """Connect to the socket at path (QEMU's, waiting up to timeout for it), or use
        sock, already connected to path."""
        self.path = path
        self.alive = alive
        if sock is None:
            sock = connect_unix(path, time.monotonic() + timeout, alive, "agent socket")
        self._ls = LineSocket(sock)
        self._next_id = _new_ids()
        self.hello: dict[str, Any] | None = None

    def wait_hello(self, timeout: float, alive: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Wait for the agent's unsolicited hello line (cold boot only)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._ls.readline(min(deadline, time.monotonic() + 1.0), "guest agent")
            except TimeoutError:
                if alive is not None and not alive():
                    raise AgentError("the VM exited before its agent said hello; "
                                     "see the serial log") from None
                if time.monotonic() > deadline:
                    raise AgentError(f"guest agent did not start within {timeout:.0f} s; "
                                     "see the serial log") from None
                continue
            except EOFError as e:
                raise AgentError(f"agent socket closed during boot: {e}") from e
            except LineTooLong as e:
                raise AgentError(f"guest agent's hello refused: {e}") from e
            try:
                msg = parse_frame(line)
            except ProtocolViolation as e:
                raise AgentError(f"guest agent's hello refused: {e}") from e
            if msg is None:
                continue  # a partial line from before the connection
            if "hello" in msg:
                hello: dict[str, Any] = msg["hello"]
                if hello.get("protocol") != PROTOCOL:
                    spoken = inert(hello.get("protocol"), 80)
                    raise AgentError(f"guest agent speaks protocol {spoken}, "
                                     f"the host speaks {PROTOCOL}; rebuild the image")
                self.hello = hello
                return hello

    def request(self, op: str, args: dict[str, Any] | None = None, *,
                timeout: float | None = DEFAULT_REQUEST_S,
                on_event: Callable[[str, bytes], None] | None = None,
                stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send one request and read its frames until the final reply: events go to
        on_event(ev, bytes). timeout None waits as long as the VM lives (the relay closes
        the connection when it dies). stop: asked at least every STOP_POLL_S while the
        reply is awaited; once it says True the connection is closed (the relay then
        cancels the request in the guest: a command is killed with its group) and
        Abandoned is raised. An exception raised by on_event closes it the same way."""
        rid = self._next_id()
        msg = {"id": rid, "v": PROTOCOL, "op": op, **(args or {})}
        deadline = None if timeout is None else time.monotonic() + timeout
        small = op in SMALL_REPLY_OPS or (op == "get" and bool(msg.get("stream")))
        self._ls.max_line = SMALL_REPLY_LINE if small else MAX_LINE
        hold = _ReplyHold(BUDGET, f"guest agent ({op})")
        self._ls.on_grow = hold.grow
        kept = False
        try:
            self._ls.send(json.dumps(msg).encode() + b"\n")
            while True:
                reply = self._read_frame(op, deadline, stop, hold)
                if reply.get("id") != rid:
                    if "ev" in reply:
                        self._payload(reply, op, deadline)  # skipped whole
                    continue
                if "ev" in reply:
                    data = self._payload(reply, op, deadline)
                    if on_event is not None:
                        on_event(str(reply["ev"]), data)
                    continue
                break
            keeper = KEPT_REPLIES.get()
            # its parsed reply lives on until the answer is sent
            kept = keeper is not None and bool(hold.taken) and keeper.keep(hold)
        except ProtocolViolation as e:
            self.close()
            raise AgentError(f"the guest agent broke the protocol answering {op!r} ({e}); "
                             "its sandbox may be damaged: kill it") from e
        except (OSError, TimeoutError, EOFError, ValueError, LineTooLong) as e:
            self.close()
            raise AgentError(f"agent request {op!r} failed: {e}") from e
        except BaseException:  # Abandoned, a passed budget, on_event's own: never read on
            self.close()
            raise
        finally:
            self._ls.on_grow = None
            if not kept:
                hold.release()
        if not reply.get("ok"):
            _raise_for(op, reply)
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def _payload(self, frame: dict[str, Any], op: str, deadline: float | None) -> bytes:
        """An event's bytes: the binary payload of `size` bytes after its header line."""
        size = frame.get("size")
        if size is None:
            return b""
        if not jsondoc.is_integer(size, 0, MAX_EVENT):
            raise ValueError(f"guest agent ({op}) sent an event of {size!r} bytes; at most "
                             f"{MAX_EVENT} are allowed")
        limit = time.monotonic() + 60.0 if deadline is None else deadline
        return self._ls.read_exact(size, limit, f"guest agent ({op})")

    def _read_frame(self, op: str, deadline: float | None,
                    stop: Callable[[], bool] | None = None,
                    hold: _ReplyHold | None = None) -> dict[str, Any]:
        while True:
            if stop is not None and stop():
                raise Abandoned(f"the caller of {op!r} stopped waiting for it")
            step = time.monotonic() + (5.0 if stop is None else STOP_POLL_S)
            try:
                line = self._ls.readline(step if deadline is None else min(deadline, step),
                                         f"guest agent ({op})")
            except TimeoutError:
                if deadline is not None and time.monotonic() >= deadline:
                    raise
                if self.alive is not None and not self.alive():
                    raise EOFError("the VM exited") from None
                continue
            structure = None
            if len(line) > CHECKED_LINE:
                structure, strings = jsondoc.skeleton_and_strings(line)
                # before it is parsed; a frame of too much structure is refused as such
                if hold is not None and len(structure) <= MAX_STRUCTURE:
                    hold.grow(parsed_size(line, structure, strings))
            frame = parse_frame(line, structure)
            if frame is None:
                continue  # an incomplete frame the agent dropped (its host went away)
            if "ev" in frame and len(line) > EVENT_HEAD_MAX:
                # the relay skips no payload after such a header: its bytes went on as lines
                # (a guest program's output parsed as frames), and this client read the
                # next frames as the payload (or, connected directly, took it whole)
                raise ProtocolViolation(
                    f"an event header of {len(line)} bytes, over the {EVENT_HEAD_MAX} a "
                    "payload's size is read from")
            return frame

    def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        return self.request("ping", timeout=timeout)

    def exec(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | None = None, timeout: float | None = None,
             on_stdout: OnData | None = None, on_stderr: OnData | None = None,
             pty: bool = False, stop: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Run argv to its end. With on_stdout/on_stderr the output streams to them as it is
        produced (and the result's stdout/stderr are empty); else it is collected (32 MiB
        per stream at most). The host waits as long as the command's own timeout allows,
        or until ``stop`` says True (request: the command is killed, Abandoned raised)."""
        args = exec_args(argv, env, cwd, stdin, timeout, pty)
        stream = on_stdout is not None or on_stderr is not None
        if stream:
            args["stream"] = True
        res = self.request("exec", args, timeout=host_wait(timeout),
                           on_event=splitter(on_stdout, on_stderr) if stream else None,
                           stop=stop)
        if stream:
            res.setdefault("stdout", "")
            res.setdefault("stderr", "")
        return res

    def eval(self, code: str, timeout: float | None = 300.0) -> dict[str, Any]:
        check_timeout("timeout", timeout)
        args: dict[str, Any] = {"code": code}
        if timeout is not None:
            args["timeout"] = timeout
        return self.request("eval", args, timeout=host_wait(timeout))

    def run_code(self, code: str, *, timeout: float | None = 300.0,
                 on_stdout: OnData | None = None,
                 on_stderr: OnData | None = None) -> dict[str, Any]:
        check_timeout("timeout", timeout)
        args: dict[str, Any] = {"code": code}
        if timeout is not None:
            args["timeout"] = timeout
        stream = on_stdout is not None or on_stderr is not None
        if stream:
            args["stream"] = True
        return self.request("run_code", args, timeout=host_wait(timeout),
                            on_event=splitter(on_stdout, on_stderr) if stream else None)

    def put(self, path: str, data: bytes, mode: int = 0o644) -> dict[str, Any]:
        check_guest_path(path)
        check_payload("the file", data)
        check_mode(mode)
        return self.request("put", {"path": path, "data": base64.b64encode(data).decode(),
                                    "mode": mode}, timeout=DEFAULT_REQUEST_S + len(data) / 1e6)

    def get(self, path: str, timeout: float | None = None) -> bytes:
        """A guest file's bytes, streamed in 1 MiB chunks (up to 4 GiB)."""
        parts: list[bytes] = []
        self.get_chunks(path, parts.append, timeout)
        return b"".join(parts)

    def get_chunks(self, path: str, on_chunk: OnData, timeout: float | None = None,
                   stop: Callable[[], bool] | None = None) -> int:
        """A guest file's bytes given to ``on_chunk`` as they arrive (1 MiB at a time, up to
        4 GiB), none of them kept here; its size once all arrived. An exception raised by
        ``on_chunk``, or ``stop`` saying True (request), ends the transfer and closes this
        client (the rest is not read)."""
        check_guest_path(path)
        got = 0

        def chunk(ev: str, data: bytes) -> None:
            nonlocal got
            if ev == "chunk":
                got += len(data)
                on_chunk(data)

        res = self.request("get", {"path": path, "stream": True}, timeout=timeout,
                           on_event=chunk, stop=stop)
        if got != res.get("bytes"):
            raise AgentError(f"get {path}: {got} bytes arrived, the agent sent "
                             f"{res.get('bytes')}")
        return got

    def get_v1(self, path: str, timeout: float | None = DEFAULT_REQUEST_S) -> bytes:
        """The protocol-1 way: the whole file in one reply (at most 32 MiB)."""
        data = self.request("get", {"path": path}, timeout=timeout).get("data")
        if not isinstance(data, str):
            raise AgentError(f"get {path}: the guest agent's answer has no data; its sandbox "
                             "may be damaged: kill it")
        return guest_b64(data, f"get {path}")

    def close(self) -> None:
        self._ls.close()


@dataclass(frozen=True)
class ExecResult:
    """How a command ended (docs/agent-protocol.md, "exec"). status is one of exited,
    signaled, killed (by a request), timed_out, oom_killed; exit_code is the process's
    return code as before (negative: the signal that ended it); stdout/stderr are empty
    when the output was streamed."""

    status: str
    exit_code: int
    signal: int | None
    timed_out: bool
    killed: bool
    oom_killed: bool
    duration: float
    stdout: str = ""
    stderr: str = ""
    pid: int | None = None

    @classmethod
    def of(cls, res: dict[str, Any]) -> ExecResult:
        """The guest's exec reply as a result; AgentError when it is not of that shape."""
        try:
            return cls._of(res)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise AgentError(f"the guest agent's exec reply does not match the protocol "
                             f"({type(exc).__name__}: {exc})") from None

    @classmethod
    def _of(cls, res: dict[str, Any]) -> ExecResult:
        return cls(status=str(res.get("status", "exited")), exit_code=int(res["exit_code"]),
                   signal=res.get("signal"), timed_out=bool(res.get("timed_out")),
                   killed=bool(res.get("killed")), oom_killed=bool(res.get("oom_killed")),
                   duration=float(res.get("duration", 0.0)), stdout=res.get("stdout", ""),
                   stderr=res.get("stderr", ""), pid=res.get("pid"))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def exec_args(argv: list[str], env: dict[str, str] | None, cwd: str | None,
              stdin: bytes | None, timeout: float | None, pty: bool) -> dict[str, Any]:
    """The arguments of an exec or proc_start request (docs/agent-protocol.md), checked
    (engine/commands.py)."""
    check_command(argv, env, cwd)
    check_payload("stdin", stdin)
    check_timeout("timeout", timeout)
    args: dict[str, Any] = {"argv": argv}
    if env:
        args["env"] = env
    if cwd:
        args["cwd"] = cwd
    if stdin is not None:
        args["stdin"] = base64.b64encode(stdin).decode()
        args["stdin_b64"] = True
    if timeout is not None:
        args["timeout"] = timeout
    if pty:
        args["pty"] = True
    return args


def host_wait(timeout: float | None) -> float | None:
    """No host deadline shorter than the guest's own: its timeout plus a margin, or none."""
    return None if timeout is None else timeout + REPLY_MARGIN_S


def splitter(on_stdout: OnData | None,
              on_stderr: OnData | None) -> Callable[[str, bytes], None]:
    def route(ev: str, data: bytes) -> None:
        fn = on_stdout if ev == "stdout" else on_stderr if ev == "stderr" else None
        if fn is not None:
            fn(data)
    return route


# ---------------------------------------------------------------- the per-child relay
def connect_child(d: Path, *, timeout: float = 10.0,
                  alive: Callable[[], bool] | None = None) -> AgentClient:
    """A client of child directory d's agent, through its relay (started if none runs)."""
    sock = d / RELAY_SOCKET
    with contextlib.suppress(AgentError, OSError):
        return _relay_client(sock, alive)
    fd = os.open(d / RELAY_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        _flock(fd, time.monotonic() + timeout, d.name)
        with contextlib.suppress(AgentError, OSError):
            return _relay_client(sock, alive)  # another caller started it meanwhile
        return _start_relay(d, alive, timeout)
    finally:
        os.close(fd)


def _relay_client(sock: Path, alive: Callable[[], bool] | None) -> AgentClient:
    if not sock.exists():
        raise AgentError(f"no relay socket {sock}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        with unix_address(sock) as address:
            s.connect(address)
    except OSError:
        s.close()
        raise
    return AgentClient(sock, alive=alive, sock=s)


def _flock(fd: int, deadline: float, child_id: str) -> None:
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise AgentError(f"child {child_id}: another process is starting its agent "
                                 "relay and did not finish; try again") from None
            time.sleep(0.01)


def _start_relay(d: Path, alive: Callable[[], bool] | None, timeout: float) -> AgentClient:
    log = open(d / RELAY_LOG, "ab")  # noqa: SIM115 (the child keeps it)
    try:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "forkd.engine.agent_client",
                                 "relay", str(d)], stdin=subprocess.DEVNULL,
                                stdout=log, stderr=log, start_new_session=True, close_fds=True,
                                env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    finally:
        log.close()
    deadline = time.monotonic() + max(timeout, RELAY_START_S)
    while True:
        with contextlib.suppress(AgentError, OSError):
            return _relay_client(d / RELAY_SOCKET, alive)
        if proc.poll() is not None:
            tail = inert((d / RELAY_LOG).read_text(errors="replace")[-2000:])
            raise AgentError(f"child {d.name}: its agent relay exited at once:\n{tail}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AgentError(f"child {d.name}: its agent relay did not listen within "
                             f"{deadline - time.monotonic() + max(timeout, RELAY_START_S):.0f} s")
        time.sleep(0.005)


# the id (and whether the frame is final) read off the front of a frame without parsing it
_FRAME_HEAD = re.compile(rb'\{"id": ?("(?:[^"\\]|\\.)*"|-?\d+|null), ?"(ok|ev)"')
_REQ_HEAD = re.compile(rb'\{"id": ?("(?:[^"\\]|\\.)*"|-?\d+)')


def _event_size(head: bytes) -> int:
    """The payload size an event's header line announces (0 when it has none or a bad one:
    then the stream resynchronises at the next line)."""
    if len(head) > EVENT_HEAD_MAX:
        return 0
    try:
        frame = parse_frame(head)
    except ValueError:  # ProtocolViolation: its reader refuses it
        return 0
    size = 0 if frame is None else frame.get("size", 0)
    if not jsondoc.is_integer(size, 0, MAX_EVENT):
        return 0
    return size


@dataclass
class _Client:
    sock: socket.socket
    inbuf: bytearray
    outbuf: bytearray
    ids: set[str]
    stuck_since: float | None = None


class Relay:
    """Owns the agent socket of one child and multiplexes clients over it (a selector loop,
    one process, no threads)."""

    def __init__(self, d: Path) -> None:
        self.d = d
        self.sel = selectors.DefaultSelector()
        self.agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.agent.settimeout(10.0)
        with unix_address(d / "agent.sock") as address:
            self.agent.connect(address)
        self.agent.setblocking(False)
        self.agent_in = bytearray()
        self.agent_out = bytearray()
        self.raw_left = 0  # bytes of an event's binary payload still to come from the agent
        self.raw_to: _Client | None = None  # whose they are (None: nobody's, skipped)
        self.long_line = False  # the rest of a line past LONG_LINE is still to come
        self.line_to: _Client | None = None  # whose it is (None: nobody's, skipped)
        self.clients: dict[int, _Client] = {}
        self.routes: dict[str, _Client] = {}
        self.next_id = _new_ids()
        self.idle_since = time.monotonic()
        self.unlinked = False  # the socket path was given up (then it may be another relay's)
        self.reading_clients = True  # False while AGENT_QUEUE bytes wait for the agent
        self.listener = self._listen()
        self.sel.register(self.agent, selectors.EVENT_READ, "agent")
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")

    def _listen(self) -> socket.socket:
        path = self.d / RELAY_SOCKET
        tmp = self.d / f".{RELAY_SOCKET}.{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with unix_address(tmp) as address:
            s.bind(address)
        os.chmod(tmp, 0o600)
        s.listen(64)
        s.setblocking(False)
        os.replace(tmp, path)  # atomically: clients never see a socket nobody listens on
        return s

    def run(self) -> None:
        while True:
            agent_events = selectors.EVENT_READ if self._agent_readable() else 0
            agent_events |= selectors.EVENT_WRITE if self.agent_out else 0
            self._modify(self.agent, agent_events, "agent")
            self._backpressure_clients()
            for ev_key, mask in self.sel.select(timeout=1.0):
                if ev_key.data == "agent":
                    if mask & selectors.EVENT_READ and not self._read_agent():
                        return  # QEMU closed the socket: the VM is gone
                    if mask & selectors.EVENT_WRITE:
                        self._flush(self.agent, self.agent_out)
                elif ev_key.data == "listen":
                    self._accept()
                else:
                    self._client_io(ev_key.data, mask)
            if self._should_exit():
                return

    def _backpressure_clients(self) -> None:
        """Read no client while AGENT_QUEUE bytes wait for the agent: their sends block
        (and time out in the client), the relay's memory stays bounded, and the guest
        takes the queue at its own pace."""
        reading = len(self.agent_out) <= AGENT_QUEUE
        if reading == self.reading_clients:
            return
        self.reading_clients = reading
        for c in list(self.clients.values()):
            self._modify(c.sock, self._client_events(c), c)

    def _client_events(self, c: _Client) -> int:
        events = selectors.EVENT_READ if self.reading_clients else 0
        return events | (selectors.EVENT_WRITE if c.outbuf else 0)

    def _modify(self, sock: socket.socket, events: int, data: Any) -> None:
        if events:
            try:
                self.sel.modify(sock, events, data)
            except KeyError:
                self.sel.register(sock, events, data)
        else:
            with contextlib.suppress(KeyError):
                self.sel.unregister(sock)

    def _agent_readable(self) -> bool:
        """Backpressure: stop reading the agent while a client has too much queued (the
        guest's writes then block, and its processes with them); drop a client that stays
        stuck for SLOW_CLIENT_S."""
        now = time.monotonic()
        ok = True
        for c in list(self.clients.values()):
            if len(c.outbuf) > CLIENT_BUFFER:
                c.stuck_since = c.stuck_since or now
                if now - c.stuck_since > SLOW_CLIENT_S:
                    self._drop(c)
                    continue
                ok = False
            else:
                c.stuck_since = None
        return ok

    def _should_exit(self) -> bool:
        if self.clients or self.routes or self.agent_out:
            self.idle_since = time.monotonic()
            return False
        if time.monotonic() - self.idle_since < RELAY_IDLE_S:
            return False
        # leave no window where a client connects to a relay that is going away: unlink the
        # socket first, then serve whoever got into the backlog before that
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.d / RELAY_SOCKET)
        self.unlinked = True
        self._accept()
        if self.clients:
            self.sel.unregister(self.listener)
            self.listener.close()
            self.listener = self._listen()
            self.unlinked = False
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
            return False
        return True

    def _read_agent(self) -> bool:
        try:
            chunk = self.agent.recv(1 << 20)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        buf = self.agent_in
        scan = len(buf)  # what is left from the last call is part of one line: no newline
        buf += chunk
        start = 0
        while True:
            if self.raw_left:
                take = min(self.raw_left, len(buf) - start)
                if self.raw_to is not None:
                    self.raw_to.outbuf += buf[start:start + take]
                    self._want_write(self.raw_to)
                start += take
                self.raw_left -= take
                if self.raw_left:
                    break
                continue
            if self.long_line:
                i = buf.find(b"\n", start)
                end = len(buf) if i < 0 else i + 1
                if self.line_to is not None:
                    self.line_to.outbuf += buf[start:end]
                    self._want_write(self.line_to)
                start = end
                if i < 0:
                    break
                self.long_line, self.line_to = False, None
                continue
            i = buf.find(b"\n", max(scan, start))
            if i < 0:
                if len(buf) - start > LONG_LINE:
                    self._start_long_line(bytes(buf[start:start + LONG_LINE]))
                    continue  # what arrived of it goes on now
                break
            self._route(bytes(buf[start:i + 1]))
            start = i + 1
        if start:
            del buf[:start]
        return True

    def _start_long_line(self, head: bytes) -> None:
        """A line past LONG_LINE: its head decides whose it is, as _route does for a whole
        one (a reply ends its request's route; an event's header this long announces no
        payload the relay skips, as _event_size says)."""
        self.long_line, self.line_to = True, None
        m = _FRAME_HEAD.match(head)
        if m is None:
            return  # the hello, or not a frame: skipped
        try:
            rid = json.loads(m.group(1))
        except ValueError:
            return
        c = self.routes.get(rid) if isinstance(rid, str) else None
        if c is not None and m.group(2) == b"ok":
            del self.routes[rid]
            c.ids.discard(rid)
        self.line_to = c

    def _route(self, frame: bytes) -> None:
        m = _FRAME_HEAD.match(frame)
        if m is None:
            return  # hello, or an incomplete frame the agent dropped
        try:
            rid = json.loads(m.group(1))
        except ValueError:
            return
        c = self.routes.get(rid) if isinstance(rid, str) else None
        if m.group(2) == b"ev":
            self.raw_left = _event_size(frame)  # its payload follows, for c or nobody
            self.raw_to = c
        if c is None:
            return  # its client went away (or a reply to the relay's own cancel)
        if m.group(2) == b"ok":
            del self.routes[rid]
            c.ids.discard(rid)
        c.outbuf += frame
        self._want_write(c)

    def _accept(self) -> None:
        while True:
            try:
                s, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            s.setblocking(False)
            c = _Client(s, bytearray(), bytearray(), set())
            self.clients[s.fileno()] = c
            self._modify(s, self._client_events(c), c)

    def _want_write(self, c: _Client) -> None:
        self._modify(c.sock, self._client_events(c), c)

    def _client_io(self, c: _Client, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            if not self._flush(c.sock, c.outbuf):
                self._drop(c)
                return
            if not c.outbuf:
                self._modify(c.sock, self._client_events(c), c)
        if mask & selectors.EVENT_READ:
            try:
                chunk = c.sock.recv(1 << 20)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self._drop(c)
                return
            scan = len(c.inbuf)
            c.inbuf += chunk
            start = 0
            while True:
                i = c.inbuf.find(b"\n", max(scan, start))
                if i < 0:
                    break
                self._request(c, bytes(c.inbuf[start:i + 1]))
                start = i + 1
            if start:
                del c.inbuf[:start]
            if len(c.inbuf) > 64 << 20:
                self._drop(c)  # past the protocol's bound on a line

    def _request(self, c: _Client, line: bytes) -> None:
        m = _REQ_HEAD.match(line)
        rid: Any = None
        if m is not None:
            with contextlib.suppress(ValueError):
                rid = json.loads(m.group(1))
        if not isinstance(rid, str) or rid in self.routes:
            why = ("a request through the relay starts with a string id" if not isinstance(
                rid, str) else f"request id {rid!r} is already in flight")
            c.outbuf += (json.dumps({"id": rid, "ok": False,
                                     "error": {"type": "protocol", "message": why}}) + "\n"
                         ).encode()
            self._want_write(c)
            return
        self.routes[rid] = c
        c.ids.add(rid)
        self.agent_out += line

    def _flush(self, sock: socket.socket, buf: bytearray) -> bool:
        try:
            n = sock.send(buf)
        except BlockingIOError:
            return True
        except OSError as e:
            return e.errno in (errno.EAGAIN, errno.EINTR)
        del buf[:n]
        return True

    def _drop(self, c: _Client) -> None:
        """A client went away: its running commands are cancelled in the guest, and the
        rest of an event payload or a long line the agent is sending it is skipped (its
        socket is closed: the relay died on queueing bytes for it, and every other client
        of the child with it)."""
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(c.sock)
        self.clients.pop(c.sock.fileno(), None)
        if self.raw_to is c:
            self.raw_to = None
        if self.line_to is c:
            self.line_to = None
        c.sock.close()
        for rid in c.ids:
            self.routes.pop(rid, None)
            cancel = {"id": self.next_id(), "v": PROTOCOL, "op": "cancel", "target": rid}
            self.agent_out += (json.dumps(cancel) + "\n").encode()
        c.ids.clear()


def relay_main(d: Path) -> int:
    try:
        relay = Relay(d)
    except OSError as e:
        print(f"forkd agent relay for {d}: cannot start: {e}", file=sys.stderr)
        return 1
    try:
        relay.run()
    finally:
        if not relay.unlinked:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(d / RELAY_SOCKET)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "relay":
        sys.exit(relay_main(Path(sys.argv[2])))
    print("usage: python -m forkd.engine.agent_client relay CHILD_DIR", file=sys.stderr)
    sys.exit(2)
