"""`forkd mcp`: forkd's sandboxes as MCP tools, over stdio or streamable HTTP.

Built on the official ``mcp`` SDK (``MCPServer``). Every tool goes through the Python SDK
(forkd.controller.sdk): ``Controller()`` is the daemon (`forkd serve`) when one answers on
its socket, else the engine in this process; ``--controller daemon|local`` forces one
(docs/mcp.md). The sandboxes are VMs that outlive the server either way: an agent names
them by id from one call to the next, and kills them with ``kill_sandbox``.

A failure is a tool error (``isError: true`` with what was wrong and what to do), never a
dead server: forkd's errors keep their family and message, arguments are validated against
each tool's schema before anything runs, and any other exception becomes a tool error too.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import contextvars
import fcntl
import functools
import json
import os
import secrets
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, ParamSpec, TypeVar

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, ImageContent, TextContent
from pydantic import Field

import forkd
from forkd.bodies import announced_size
from forkd.controller.api import ExecRequest
from forkd.controller.app import (
    BODY_BYTES,
    MAX_MESSAGE_CHARS,
    BodyBudget,
    Token,
    TokenWatch,
    scope_token,
    token_matches,
)
from forkd.controller.backend import (
    CALLER_STOP,
    MAX_SANDBOXES,
    Stop,
    Stopped,
    Transfer,
    client_share,
    lazy_remote,
)
from forkd.controller.sdk import Controller, Sandbox, command_argv, stdin_bytes
from forkd.controller.server import DEFAULT_LIMITS, Limits, bounded_config
from forkd.controller.server import peer_address as server_peer
from forkd.engine import children as ch
from forkd.engine.agent_client import REQUEST_CLIENT
from forkd.engine.errors import ChildNotFound, TooManyRequests
from forkd.engine.lifecycle import private_owner
from forkd.engine.paths import hidden_host_paths, run_dir
from forkd.errors import Conflict, ForkdError, InvalidInput, NotFound
from forkd.names import InertStream, inert, parse_ref, shown
from forkd.shares import Shares

# -- limits (docs/mcp.md, "Limits") ----------------------------------------------------
MAX_SANDBOXES_PER_CALL = 64  # create_sandboxes / fork_from_branch: n is 1..this
MAX_FILE_BYTES = 16 << 20  # read_file / write_file: a file's bytes, either way
MAX_OUTPUT_CHARS = 1 << 20  # run_command / run_code: each of stdout, stderr in the result
MAX_CELL_CHARS = 4 << 20  # run_code: the rest of a result (error, repr, value, results) in all
MAX_CELL_DEPTH = 128  # run_code: a JSON value nested deeper is left out (pydantic sends 253)
MAX_PROGRESS_CHARS = 16 << 10  # one progress notification carries at most this much output
MAX_CODE_CHARS = 1 << 20  # run_code: the code; run_command: the command line, stdin
# write_file: its content's characters (MAX_FILE_BYTES of base64), refused as it arrives,
# before it is encoded or decoded (each a copy); the bytes are then held to MAX_FILE_BYTES
MAX_CONTENT_CHARS = (MAX_FILE_BYTES * 4) // 3 + 4
MAX_BRANCHES_PER_CLIENT = 64  # branch_sandbox tags one HTTP client (address) holds at once

P = ParamSpec("P")
R = TypeVar("R")

SandboxId = Annotated[
    str,
    Field(
        min_length=1,
        max_length=64,
        pattern=r"^[a-z0-9][a-z0-9-]*$",  # lifecycle.ID_RE: nothing that leaves the route
        description="A sandbox id (create_sandboxes gives them).",
    ),
]
Tag = Annotated[
    str,
    Field(
        min_length=1,
        max_length=255,
        description="A snapshot tag, NAME[:TAG] (list_snapshots lists them).",
    ),
]
Count = Annotated[int, Field(ge=1, le=MAX_SANDBOXES_PER_CALL, description="How many sandboxes.")]
Seconds = Annotated[
    float | None, Field(gt=0, le=30 * 86400, description="Seconds; none: no limit.")
]
GuestPath = Annotated[
    str,
    Field(
        min_length=2, max_length=4096, pattern=r"^/", description="An absolute path in the sandbox."
    ),
]
Encoding = Literal["utf-8", "base64"]


def tool_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Every failure as a ToolError (an ``isError`` result): forkd's errors with their
    family and message, anything else with its type; the server itself goes on."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except ToolError:
            raise
        except ForkdError as exc:
            raise ToolError(f"{type(exc).__name__}: {error_text(exc)}") from exc
        except Exception as exc:  # a bug or the host's trouble: say so, keep serving
            raise ToolError(
                f"unexpected {type(exc).__name__}: {error_text(exc)}; the MCP "
                "server is still running (its stderr has the details)"
            ) from exc

    return wrapper


class ToolCalls(Shares):
    """Tool calls in flight on one `forkd mcp --transport http`, in all and per client (as
    agent_client.REQUEST_CLIENT names it: an address, an IPv6 /64), one client at most
    half. In front of a daemon every MCP client is the same client of the daemon (this
    process: its uid on the socket, its address on TCP), so the daemon's per-client
    shares were one share for all of them: one MCP client whose commands wait held all of
    this server's guest requests at the daemon, and every other MCP client's call was a
    TooManyRequests. So this server may have in flight what the daemon lets one client
    have (children.MAX_REQUESTS_PER_CLIENT), in process what a process may
    (children.MAX_REQUESTS), and one MCP client half of it; a call past it is a tool error
    at once, before anything runs."""

    @classmethod
    def for_daemon(cls) -> ToolCalls:
        return cls(ch.MAX_REQUESTS_PER_CLIENT)

    @classmethod
    def in_process(cls) -> ToolCalls:
        return cls(ch.MAX_REQUESTS)

    @classmethod
    def of(cls, controller: Controller) -> ToolCalls:
        return cls.for_daemon() if controller.remote else cls.in_process()

    def counting(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` counted against this from its start to its end, for its caller's client;
        TooManyRequests (a tool error saying which bound) when it would pass a share."""

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            client = REQUEST_CLIENT.get()
            refused = self.take_or_refuse(1, client)
            if refused is not None:
                if refused.bound == "client":
                    raise TooManyRequests(
                        f"this client ({client}) has {refused.held} tool calls in flight on "
                        f"this MCP server, the most one client may ({self.share} of "
                        f"{self.total}): wait for one of yours to end and try again (a "
                        "command without a timeout holds its call until it ends; give it "
                        "timeout_s)")
                raise TooManyRequests(
                    f"this MCP server has {refused.held} tool calls in flight, the most it "
                    f"takes at once ({self.total}): wait for one to end and try again")
            try:
                return fn(*args, **kwargs)
            finally:
                self.give(1, client)

        return wrapper


class SandboxShares:
    """The sandboxes one MCP client runs through a daemon, at most ``share``. In front of a
    daemon every MCP client is the same client of the daemon (this process's uid), so the
    daemon's per-client share of VMs (half its --max-sandboxes) was one share for all of
    them: one MCP client's create_sandboxes could take all of it, and every other MCP
    client's was refused until it killed some. A client (REQUEST_CLIENT) counts the
    sandboxes it created here that the daemon still lists, paused ones left out (as the
    daemon counts them), and the ones it is creating. In process there is no such class:
    the engine keeps each MCP client's share itself (LocalBackend.max_per_client)."""

    def __init__(self, share: int) -> None:
        self.share = share
        self._owners: dict[str, tuple[str, int]] = {}  # sandbox id: (client, when made)
        self._starting: dict[str, int] = {}  # client: sandboxes it is creating
        self._made = 0  # sandboxes recorded so far, to order them against a listing
        self._lock = threading.Lock()

    @classmethod
    def of(cls, controller: Controller) -> SandboxShares | None:
        """Half of this process's default share at a daemon; None in process."""
        return cls(client_share(client_share(MAX_SANDBOXES))) if controller.remote else None

    @contextlib.contextmanager
    def admitted(self, n: int, what: str, controller: Controller
                 ) -> Iterator[Callable[[list[str]], None]]:
        """Room for ``n`` more sandboxes of the calling client while the block runs, or
        TooManyRequests saying its share; the block hands the ids it made to the callable
        it gets, and they count against the client from then on."""
        client = REQUEST_CLIENT.get()
        if client is None:  # stdio: one caller, nothing to share
            yield lambda ids: None
            return
        with self._lock:
            listed_after = self._made  # ids recorded before the listing below
        running = {sb.id for sb in controller.backend.sandboxes() if sb.status != "paused"}
        with self._lock:
            for gone in [i for i, (_, made) in self._owners.items()
                         if made < listed_after and i not in running]:
                del self._owners[gone]
            mine = sum(1 for i, (who, _) in self._owners.items()
                       if who == client and i in running) + self._starting.get(client, 0)
            if mine + n > self.share:
                raise TooManyRequests(
                    f"{what} needs {n} more sandboxes and this client ({client}) runs {mine} "
                    f"(the ones it created on this MCP server that run, and ones starting); "
                    f"one MCP client runs at most {self.share}, so that every client of this "
                    "server keeps a share of what the daemon gives it: kill_sandbox some "
                    "of yours and try again")
            self._starting[client] = self._starting.get(client, 0) + n

        def own(ids: list[str]) -> None:
            with self._lock:
                for i in ids:
                    self._made += 1
                    self._owners[i] = (client, self._made)

        try:
            yield own
        finally:
            with self._lock:
                self._starting[client] -= n
                if self._starting[client] <= 0:
                    del self._starting[client]


# The MCP session a tool call belongs to (``forkd mcp --transport http``): the session's
# id, which the MCP SDK made (a random UUID) and gave to that client alone, and which
# every request of the session carries (``mcp-session-id``; the SDK answers an unknown
# one 404 before any tool runs). Tool calls run in the context of the request that
# carried them. Another session, even from the same address (every local client is
# 127.0.0.1), has another id. Over stdio: None, one client.
MCP_SESSION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "forkd_mcp_session", default=None)


def calling_client() -> tuple[str | None, str | None]:
    """Who makes a tool call, for what it may reach: its address (REQUEST_CLIENT) and its
    MCP session (MCP_SESSION)."""
    return REQUEST_CLIENT.get(), MCP_SESSION.get()


class SessionMark:
    """ASGI middleware of the MCP HTTP app: a request runs with MCP_SESSION set to the
    session id it carries (``mcp-session-id``; None for the request that opens one)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        ids = [value for key, value in scope.get("headers", ())
               if key.lower() == b"mcp-session-id"]
        if scope.get("type") != "http" or len(ids) != 1:
            await self.app(scope, receive, send)  # none, or two: the SDK refuses it
            return
        mark = MCP_SESSION.set(ids[0].decode("latin-1"))
        try:
            await self.app(scope, receive, send)
        finally:
            MCP_SESSION.reset(mark)


class BranchRecord:
    """The branches an HTTP server's sessions made and has not removed yet, in a file of
    its own under ``directory`` ($FORKD_RUN/mcp-branches: ``PID-HEX.json``) kept while the
    server runs, beside a lock file it holds (flock) for as long. A server that ended
    without removing them (killed, out of memory, its host's power) left them in the
    store, and the next server, which knew no maker, listed them to every client and
    forked them for any: the sandbox state of a session nobody has any more. A starting
    server removes the branches of every record whose server is gone (its lock free),
    those that still name what was branched (``sweep``)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.path = directory / f"{name}.json"
        self._write({})
        # locked before it has its name: a sweep never sees the lock of a live server free
        taking = directory / f".{name}.lock"
        self._fd = os.open(taking, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        weakref.finalize(self, os.close, self._fd)  # the lock held while this lives
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.replace(taking, directory / f"{name}.lock")

    @classmethod
    def of_server(cls, controller: Controller) -> BranchRecord | None:
        """The record of a starting HTTP server, in $FORKD_RUN/mcp-branches, once the
        records of servers that are gone have been swept (their branches removed
        through ``controller``); None where this process may not keep one there (a
        server run as another user than $FORKD_RUN's), the branches then removed only
        as their sessions end."""
        try:
            records = run_dir() / "mcp-branches"
            cls.sweep(records, functools.partial(removed_all, controller))
            return cls(records)
        except (OSError, ForkdError) as exc:
            print(f"forkd mcp: no record of branches ({error_text(exc)}): a branch of a "
                  "session is removed when it ends, not after a crash", file=sys.stderr)
            return None

    def _write(self, made: dict[str, str]) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(json.dumps(made))
        os.replace(tmp, self.path)

    def write(self, made: dict[str, str]) -> None:
        """Record ``made`` (tag: digest), all this server's branches not yet removed."""
        with contextlib.suppress(OSError):  # the branches are served all the same
            self._write(made)

    @staticmethod
    def sweep(directory: Path, remove: Callable[[dict[str, str]], bool]) -> None:
        """Hand each record left by a server that is gone to ``remove`` (tag: digest),
        and delete it once ``remove`` says all its branches are gone (else the next
        start tries again)."""
        if not directory.is_dir():
            return
        for lock in sorted(directory.glob("*.lock")):
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its server runs
                record = lock.with_suffix(".json")
                try:
                    made = json.loads(record.read_text())
                except (OSError, ValueError):
                    made = {}
                if not isinstance(made, dict) or remove(
                        {str(k): str(v) for k, v in made.items()}):
                    record.unlink(missing_ok=True)
                    lock.unlink(missing_ok=True)
            finally:
                os.close(fd)


def tag_digest(controller: Controller, ref: str) -> str | None:
    """What tag ``ref`` names now; None when there is no such tag."""
    try:
        return str(controller.backend.snapshot(ref)["digest"])
    except NotFound:
        return None


class BranchTags:
    """The tags each MCP client made with branch_sandbox on this server: the only existing
    tags its ``force`` may replace. A model told to by what it read (a prompt injection)
    passed ``force`` with the tag everyone forks from (``python:latest``): every sandbox
    forked from it after, by any client of the daemon, started in the state of a sandbox
    the injection's author controlled. A snapshot built, pulled, or branched by another
    client (or by this server before it restarted) is not this tool's to replace.

    A branch another client made here is not this client's to fork or list either: it is
    that client's sandbox as it was (its files, its interpreter's variables, the keys it
    was given), and forking it reached all of that as SandboxScope keeps the sandbox
    itself from reach (unless ``everything``: ``forkd mcp --all-sandboxes``). Snapshots
    made elsewhere (built, pulled, branched through the CLI or REST) are everyone's.

    A tag is a client's branch while it names what that client branched (the digest its
    branch made): removed, or replaced by one built, pulled or branched elsewhere (or by
    another client once it was removed), it is no longer that client's. The maker was
    kept by name for ever: a client that branched to a name the operator later used (a
    tag removed, then pulled again) kept it hidden from every other client, and its
    ``force`` replaced what the operator had put there.

    A branch of one tag is made one at a time on this server, and ``force`` reaches the
    engine only when the tag is one the caller made: a tag that did not exist when it was
    checked is branched without it, so one another client made meanwhile is a Conflict,
    never replaced."""

    def __init__(self, controller: Controller | None = None, everything: bool = False,
                 per_client: int | None = None) -> None:
        # tag: the client (calling_client) that made it, and the digest its branch made
        self._made: dict[str, tuple[tuple[str | None, str | None], str]] = {}
        self._when: dict[str, int] = {}  # tag: when it was noted (self._noted then)
        self._noted = 0
        self._starting: dict[str, int] = {}  # address: branches it is making
        self._lock = threading.Lock()
        self._branching: dict[str, tuple[threading.Lock, int]] = {}  # tag: lock, users
        self.controller = controller
        self.everything = everything
        self.per_client = MAX_BRANCHES_PER_CLIENT if per_client is None else per_client
        # the branches made here not yet removed, kept in ``record`` (http_server's)
        self.record: BranchRecord | None = None
        self._recorded: dict[str, str] = {}
        # whether an MCP session is still open (http_server sets it; None: stdio)
        self.session_open: Callable[[str], bool] | None = None

    def _digest(self, ref: str) -> str | None:
        """What ``ref`` names now; None when there is no such tag."""
        return None if self.controller is None else tag_digest(self.controller, ref)

    def maker(self, ref: str, digest: str | None = None) -> tuple[str | None, str | None] | None:
        """The client that made ``ref`` with branch_sandbox here, while the tag still names
        that branch (``digest``: what it names, when the caller knows); None otherwise."""
        with self._lock:
            entry = self._made.get(ref)
        if entry is None:
            return None
        now = digest if digest is not None else self._digest(ref)
        if now != entry[1]:  # removed or replaced since: no longer that client's branch
            with self._lock:
                if self._made.get(ref) == entry:
                    del self._made[ref]
                    del self._when[ref]
                if self._recorded.get(ref) == entry[1]:
                    self._note(ref, None)
            return None
        return entry[0]

    def anothers(self, tag: str, digest: str | None = None) -> bool:
        """Whether ``tag`` (NAME[:TAG]) is a branch another client made here (``digest``:
        what the tag names, when the caller knows)."""
        if self.everything:
            return False
        try:
            ref = str(parse_ref(tag))
        except InvalidInput:
            return False  # no local tag (a hub reference of a lazy fork): none made here
        maker = self.maker(ref, digest)
        return maker is not None and maker != calling_client()

    def may_fork(self, tag: str, lazy: bool = False) -> None:
        """NotFound when ``tag`` is a branch another client made here; for a ``lazy`` fork
        (whose tag is to be a hub reference) what a name nobody used that is no hub
        reference is (backend.lazy_remote: the daemon said the hidden tag was a local
        snapshot, another text)."""
        if self.anothers(tag):
            if lazy:
                lazy_remote(tag)
            self.not_found(tag)

    def not_found(self, tag: str) -> NoReturn:
        """The NotFound of a fork of ``tag``, another client's branch or no tag at all
        (Tools._spawn): the same text either way. The engine's own answer to a missing tag
        differed, so a client told a hidden branch of another from a name nobody used
        (that the other's tag exists, and its name: what the other client works on)."""
        raise NotFound(
            f"no snapshot {shown(tag)} among those this MCP client may fork: the tags "
            "list_snapshots lists, which leave out the branches other clients of this "
            "server made (their sandboxes' state); branch your own sandbox, or fork "
            "from a snapshot that was built or pulled")

    def may_replace(self, ref: str) -> bool:
        """The ``force`` a branch to ``ref`` asked to replace it may pass to the engine:
        True when ``ref`` is the calling client's branch, False when there is no such tag
        (so one made meanwhile is a Conflict, not replaced); Conflict when it exists and
        the calling client did not make it here."""
        if self.maker(ref) == calling_client():
            return True
        if self._digest(ref) is None:
            return False
        raise Conflict(
            f"{shown(ref)} exists and is not a branch this client made with branch_sandbox "
            "on this server: force replaces only those (a snapshot others fork from is not "
            "this tool's to replace); branch to a new tag")

    @contextlib.contextmanager
    def branching(self, ref: str) -> Iterator[None]:
        """One branch of ``ref`` at a time on this server, from its check to its record."""
        with self._lock:
            lock, users = self._branching.get(ref, (threading.Lock(), 0))
            self._branching[ref] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._lock:
                lock, users = self._branching[ref]
                if users > 1:
                    self._branching[ref] = (lock, users - 1)
                else:
                    del self._branching[ref]

    @contextlib.contextmanager
    def admitted(self, ref: str) -> Iterator[None]:
        """Room for one more branch of the calling client (its address, every session of
        it) while the block makes it, or TooManyRequests: a client holds at most
        ``per_client`` branches made here that still name what it branched, and the ones
        it is making. A branch is a diff layer of the sandbox's memory and disk in the
        store, and nothing bounded how many one client made: its branch_sandbox to one new
        tag after another filled the host's disk. Replacing its own tag (``force``) is no
        new one. Over stdio (one client, the operator's): not counted."""
        address = REQUEST_CLIENT.get()
        if address is None:
            yield
            return
        with self._lock:
            mark = self._noted
        now = {s.ref: s.digest for s in self.controller.snapshots()} if self.controller else {}
        with self._lock:
            mine = [t for t, ((who, _), digest) in self._made.items() if who == address
                    and (self._when[t] > mark or now.get(t) == digest)]
            held = len(mine) + self._starting.get(address, 0)
            if ref not in mine and held + 1 > self.per_client:
                raise TooManyRequests(
                    f"this client ({address}) holds {held} branches made with "
                    f"branch_sandbox on this server, the most one client may "
                    f"({self.per_client}; each is a layer of a sandbox's memory and disk in "
                    "the store): branch to one of your tags again with force=true, or end "
                    "the MCP session that made some (a session's branches are removed "
                    "when it ends)")
            self._starting[address] = self._starting.get(address, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._starting[address] -= 1
                if self._starting[address] <= 0:
                    del self._starting[address]

    def made(self, ref: str, digest: str) -> bool:
        """Note ``ref`` (naming ``digest``) as the calling client's branch; False, noting
        nothing, when its MCP session has already ended (ended ran for it: the caller
        removes the branch, nobody may reach it; with ``everything`` any session does)."""
        client = calling_client()
        with self._lock:
            session = client[1]
            if (session is not None and self.session_open is not None
                    and not self.everything and not self.session_open(session)):
                return False
            self._noted += 1
            self._made[ref] = (client, digest)
            self._when[ref] = self._noted
            self._note(ref, digest)
        return True

    def _note(self, ref: str, digest: str | None) -> None:
        """``ref`` recorded as naming this server's branch ``digest`` (None: no longer),
        under self._lock."""
        if digest is None:
            if self._recorded.pop(ref, None) is None:
                return
        else:
            self._recorded[ref] = digest
        if self.record is not None:
            self.record.write(dict(self._recorded))

    def removed(self, ref: str, digest: str) -> None:
        """``ref`` no longer names this server's branch ``digest`` (removed, or replaced)."""
        with self._lock:
            if self._recorded.get(ref) == digest:
                self._note(ref, None)

    def ended(self, session: str | None = None) -> list[tuple[str, str]]:
        """The branches (tag, digest) the ended MCP session ``session`` made (every
        session's, None: the server stops), forgotten here: the caller removes the ones
        that still name them (remove_branches). A session's branches were hidden from
        every other client for as long as the server ran, and nobody's once it ended
        (another session is another client): they filled the store, out of everyone's
        reach, and once the server restarted (its memory of makers gone) they were
        every client's to fork, the maker's sandbox state, files and keys. None with
        ``everything``, where any session forks them."""
        if self.everything:
            return []
        with self._lock:
            refs = [t for t, ((_, s), _) in self._made.items()
                    if session is None or s == session]
            gone = [(t, self._made[t][1]) for t in refs]
            for t in refs:
                del self._made[t]
                del self._when[t]
        return gone


def _is_ref(text: str) -> bool:
    """``text`` parses as a local tag, NAME[:TAG] (else the engine says what is wrong)."""
    try:
        parse_ref(text)
    except InvalidInput:
        return False
    return True


class SandboxScope:
    """The sandboxes each MCP client may act on: the ones it created on this server
    (create_sandboxes, fork_from_branch) and the ones the operator named (``forkd mcp
    --sandbox ID``); every sandbox of the controller with ``everything`` (``forkd mcp
    --all-sandboxes``). A tool call is the model's, and the model does what the text it
    read tells it to: with every sandbox of the daemon in reach, a prompt injection had it
    read another client's files, run commands in a sandbox whose egress carries the host's
    keys (one MCP's own create_sandboxes never binds), or kill what other jobs run. A
    client is its address and its MCP session (``calling_client``): two agents on one host
    (both 127.0.0.1) reach only their own sandboxes. A session that ends (its client's
    DELETE, or idle past ``SESSION_IDLE_S``) has its sandboxes killed (``ended``, through
    http_server): no session could reach them again, and they ran on, unreachable, until
    their timeouts (none by default), counted against their client's share of sandboxes
    (SandboxShares) and the host's VMs; a client that opened sessions, created sandboxes
    and went away, again and again, filled both for good. Not with ``everything``, where
    the next session reaches them, nor the ones the operator named."""

    def __init__(self, named: Iterable[str] = (), everything: bool = False) -> None:
        self.named = frozenset(named)
        self.everything = everything
        # sandbox id: the client (calling_client: address and MCP session) that created it
        self._made: dict[str, tuple[str | None, str | None]] = {}
        self._when: dict[str, int] = {}  # sandbox id: when it was noted (self._noted then)
        self._noted = 0
        self._lock = threading.Lock()
        # whether an MCP session is still open (http_server sets it; None: stdio, one
        # client whose sandboxes outlive it, as docs/mcp.md says)
        self.session_open: Callable[[str], bool] | None = None

    def made(self, ids: list[str]) -> list[str]:
        """Note ``ids`` as the calling client's; those of a session that has already ended
        (a create that finished after its session did) are returned instead, to be
        killed: nobody will ever reach them."""
        client = calling_client()
        session = client[1]
        if (session is not None and self.session_open is not None and not self.everything
                and not self.session_open(session)):
            return [i for i in ids if i not in self.named]
        with self._lock:
            for i in ids:
                self._noted += 1
                self._made[i] = client
                self._when[i] = self._noted
        return []

    def noted(self) -> int:
        """How many sandboxes were noted so far (a mark to take before a listing)."""
        with self._lock:
            return self._noted

    def forget(self, ids: Iterable[str], before: int | None = None) -> None:
        """Forget ``ids``, sandboxes that ended (killed, or not in a listing begun at
        ``before``, a ``noted()`` mark: one noted since is kept). An id noted for ever was
        the client's for ever: a sandbox that got it again later (another client's) was
        this client's to use and kill."""
        with self._lock:
            for i in ids:
                if i in self._made and (before is None or self._when[i] <= before):
                    del self._made[i]
                    del self._when[i]

    def gone_from(self, listed: Iterable[str]) -> list[str]:
        """The ids noted here that ``listed`` (a listing of every sandbox) lacks."""
        running = set(listed)
        with self._lock:
            return [i for i in self._made if i not in running]

    def ended(self, session: str) -> list[str]:
        """The sandboxes the ended MCP session ``session`` created, forgotten here: the
        caller kills them. None with ``everything`` (the next session reaches them)."""
        if self.everything:
            return []
        with self._lock:
            ids = [i for i, (_, s) in self._made.items()
                   if s == session and i not in self.named]
            for i in ids:
                del self._made[i]
                del self._when[i]
        return ids

    def allows(self, sandbox_id: str) -> bool:
        if self.everything or sandbox_id in self.named:
            return True
        with self._lock:
            return self._made.get(sandbox_id) == calling_client()

    def check(self, sandbox_id: str) -> None:
        """ChildNotFound unless the calling client may act on ``sandbox_id``."""
        if not self.allows(sandbox_id):
            raise ChildNotFound(
                f"no child {sandbox_id} among the sandboxes this MCP client may use: the "
                "ones it created with create_sandboxes or fork_from_branch, and the ones "
                "the operator named (forkd mcp --sandbox ID); list_sandboxes shows them")


def remove_branches(branches: BranchTags, made: list[tuple[str, str]]) -> None:
    """Remove each tag of ``made`` (tag, digest: branches of an MCP session that ended)
    that still names that branch, as far as it goes: one removed or replaced meanwhile
    (by the operator) is left, a failure leaves the rest to be removed. A branch of one
    of these tags made on this server meanwhile waits (BranchTags.branching)."""
    if branches.controller is None:
        return
    for ref, digest in made:
        with contextlib.suppress(ForkdError), branches.branching(ref):
            remove_branch(branches.controller, ref, digest)
            branches.removed(ref, digest)


def remove_branch(controller: Controller, ref: str, digest: str) -> None:
    """Delete tag ``ref`` if it still names the branch ``digest`` (one the operator
    removed or replaced meanwhile is left)."""
    if tag_digest(controller, ref) == digest:
        controller.backend.delete_snapshot(ref)


def removed_all(controller: Controller, made: dict[str, str]) -> bool:
    """Remove each tag of ``made`` (tag: digest, a gone server's record) that still names
    that digest; whether none of them does any more (the record may go)."""
    left = False
    for ref, digest in made.items():
        try:
            remove_branch(controller, ref, digest)
        except ForkdError:
            left = True
    return not left


def kill_all(controller: Controller, ids: list[str]) -> None:
    """Kill the sandboxes ``ids`` (of an MCP session that ended), each as far as it goes:
    one that already ended, or a failure, leaves the rest to be killed."""
    for sandbox_id in ids:
        with contextlib.suppress(ForkdError):
            controller.backend.kill(sandbox_id)


def _owned_by_nobody(ids: list[str]) -> None:
    """Sandboxes counted against no client's share here (stdio, in process)."""


# The Stop of the tool call this thread runs (stoppable): set when the call is cancelled
CALL_STOP: contextvars.ContextVar[Stop | None] = contextvars.ContextVar(
    "forkd_mcp_call_stop", default=None)


def stoppable(fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """``fn`` (a tool, which blocks) as a coroutine that runs it in a worker thread and,
    when the call is cancelled (the client's ``notifications/cancelled``, its session
    ended by DELETE or closed idle, the server stopping), sets the call's Stop (CALL_STOP),
    which stops what it runs as a revocation does (Revocation): a command killed with its
    process group, a cell given up in the guest. The SDK ran a tool with
    ``to_thread.run_sync``, which no cancellation reaches: a cancelled call answered
    nothing, but its command ran on in the sandbox (one without a timeout for ever),
    holding its guest request and its client's share of them for a call nobody waited
    for."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        stop = Stop()

        def run() -> R:
            reset = CALL_STOP.set(stop)
            try:
                return fn(*args, **kwargs)
            finally:
                CALL_STOP.reset(reset)

        try:
            return await anyio.to_thread.run_sync(run, abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            stop.set("cancelled")  # the thread, let go of, ends what it runs and returns
            raise

    return wrapper


def error_text(exc: Exception) -> str:
    """An error's message for a tool result: host paths hidden, guest text inert."""
    return inert(hidden_host_paths(str(exc)), MAX_MESSAGE_CHARS)


def plain(value: Any) -> Any:
    """JSON types of an SDK answer (msgspec Structs, dataclasses, dicts)."""
    return msgspec.to_builtins(value)


def clipped(text: str, limit: int = MAX_OUTPUT_CHARS) -> tuple[str, int]:
    """The last ``limit`` characters of ``text`` and how many were cut before them."""
    cut = max(0, len(text) - limit)
    return text[cut:], cut


class Tail:
    """The last MAX_OUTPUT_CHARS of a stream, in bounded memory, and how much came before."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._cut = 0

    def add(self, text: str) -> None:
        self._parts.append(text)
        self._size += len(text)
        if self._size > 2 * MAX_OUTPUT_CHARS:
            kept, cut = clipped("".join(self._parts))
            self._parts, self._size, self._cut = [kept], len(kept), self._cut + cut

    def text(self) -> tuple[str, int]:
        kept, cut = clipped("".join(self._parts))
        return kept, self._cut + cut


class CellBudget:
    """What of a cell's result beyond stdout and stderr a run_code result carries: the
    guest makes every part of it (a hostile one, or a cell whose value is a huge object),
    up to the agent protocol's 64 MiB line, and a result carries it twice (JSON text and
    structured content), so one cell put ~130 MB into the model's context. The parts, most
    useful first (the error, repr, value, then each result's forms), share ``chars``: a
    text past what is left keeps its first characters, a JSON value or an image that does
    not fit whole is left out (null), as is a JSON value nested past MAX_CELL_DEPTH (the
    MCP SDK cannot send one past 253: the whole result was a JSON-RPC error);
    ``other_cut_chars`` counts what was left out."""

    TEXTS = ("type", "message", "traceback", "text", "html", "markdown", "svg", "latex")

    def __init__(self, chars: int) -> None:
        self.left = chars
        self.cut = 0

    def bounded(self, r: dict[str, Any]) -> dict[str, Any]:
        out = dict(r)
        if isinstance(r.get("error"), dict):
            out["error"] = self._parts(r["error"])
        out["repr"] = self._text(r.get("repr"))
        out["value"] = self._whole(r.get("value"))
        out["results"] = [self._parts(x) for x in r.get("results") or [] if isinstance(x, dict)]
        out["other_cut_chars"] = self.cut
        return out

    def _parts(self, parts: dict[str, Any]) -> dict[str, Any]:
        return {k: self._text(v) if k in self.TEXTS else self._whole(v) for k, v in parts.items()}

    def _text(self, text: Any) -> Any:
        if not isinstance(text, str):
            return self._whole(text)
        kept = text[: self.left]
        self.left -= len(kept)
        self.cut += len(text) - len(kept)
        return kept

    def _whole(self, value: Any) -> Any:
        if value is None or isinstance(value, bool):
            return value
        if not isinstance(value, str) and _depth(value) > MAX_CELL_DEPTH:
            self.cut += len(json.dumps(value, default=str))
            return None
        size = len(value) if isinstance(value, str) else len(json.dumps(value, default=str))
        if size > self.left:
            self.cut += size
            return None
        self.left -= size
        return value


def _depth(value: Any) -> int:
    """How deep a JSON value nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest


class Progress:
    """Output of a running command sent as MCP progress notifications, from the worker
    thread the tool runs in: ``progress`` is the characters so far, ``message`` the piece.
    The output's tail is kept for the result."""

    def __init__(self, ctx: Context[Any, Any]) -> None:
        self._ctx = ctx
        self._sent = 0
        self._lock = threading.Lock()
        self.stdout = Tail()
        self.stderr = Tail()
        # a progress message is for a person to see as it comes (a client's status line,
        # its log, a terminal): the guest's control characters in it are shown as escapes
        # (names.InertStream), as the CLI shows them; the result carries the exact text
        self._inert = {"": InertStream(), "stderr: ": InertStream()}

    def on_stdout(self, text: str) -> None:
        self.stdout.add(text)
        self._send(text, "")

    def on_stderr(self, text: str) -> None:
        self.stderr.add(text)
        self._send(text, "stderr: ")

    def _send(self, text: str, prefix: str) -> None:
        with self._lock:
            for start in range(0, len(text), MAX_PROGRESS_CHARS):
                piece = text[start : start + MAX_PROGRESS_CHARS]
                self._sent += len(piece)
                shown = self._inert[prefix].feed(piece)
                with contextlib.suppress(Exception):  # a gone client must not end the command
                    anyio.from_thread.run(
                        self._ctx.report_progress, self._sent, None, prefix + shown
                    )


class Tools:
    """The tools, on one Controller (the SDK's: daemon or in-process). ``token``: the one
    HTTP callers present (http_server); a command or cell that runs when it is revoked is
    stopped (Revocation)."""

    def __init__(self, controller: Controller, token: Token | None = None,
                 sandboxes: SandboxShares | None = None,
                 scope: SandboxScope | None = None,
                 branches: BranchTags | None = None) -> None:
        self.controller = controller
        self.token = token
        self.sandboxes = sandboxes
        self.scope = scope if scope is not None else SandboxScope()
        self.branches = (branches if branches is not None
                         else BranchTags(controller, everything=self.scope.everything))

    def sandbox(self, sandbox_id: str) -> Sandbox:
        """The sandbox, when the calling client may act on it (SandboxScope)."""
        self.scope.check(sandbox_id)
        return Sandbox(controller=self.controller, sandbox_id=sandbox_id)

    def list_snapshots(self) -> dict[str, Any]:
        """The snapshot tags sandboxes can be created from (ref, digest, depth, sizes)."""
        mine = [s for s in self.controller.snapshots() if self._listable(s.ref, s.digest)]
        return {"snapshots": plain(mine)}

    def _listable(self, ref: str, digest: str) -> bool:
        """Not another client's branch, nor the saved state of a paused sandbox this
        client may not reach (its tag, ``forkd-paused/ID:a|b``, names that sandbox)."""
        owner = private_owner(ref)
        return (not self.branches.anothers(ref, digest)
                and (owner is None or self.scope.allows(owner)))

    def list_sandboxes(self) -> dict[str, Any]:
        """The sandboxes: id, the tag each came from, status (running, paused, crashed) and
        seconds left before its deadline (null: none)."""
        # one listing (asking each sandbox for its info again failed the whole call when
        # one ended meanwhile), which also forgets the ones that ended (SandboxScope.forget):
        # each one missing from it that the daemon no longer knows (a listing skips a record
        # it cannot read at that moment; its sandbox is not lost to its client for that)
        mark = self.scope.noted()
        listed = self.controller.backend.sandboxes()
        for missing in self.scope.gone_from(sb.id for sb in listed):
            try:
                self.controller.backend.sandbox(missing)
            except NotFound:
                self.scope.forget([missing], before=mark)
        out = []
        for sb in listed:
            if not self.scope.allows(sb.id):
                continue  # another client's, or made elsewhere and not named to this server
            info = plain(sb)
            out.append({k: info.get(k) for k in ("id", "ref", "origin", "status", "time_left_s")})
        return {"sandboxes": out}

    def create_sandboxes(
        self,
        tag: Tag,
        n: Count = 1,
        timeout_s: Seconds = None,
        memory_limit_mib: Annotated[int | None, Field(ge=64)] = None,
        lazy: Annotated[
            bool,
            Field(description="tag is a hub's HUB/NS/NAME[:TAG]: fork before its pack is here."),
        ] = False,
    ) -> dict[str, Any]:
        """Fork n sandboxes (copy-on-write VMs) from snapshot `tag`, ready in about a second
        each. timeout_s: each is killed that many seconds after it is ready. All of them
        start or none (the ones that did are killed). Returns their ids."""
        return self._spawn(tag, n, timeout_s, memory_limit_mib, lazy)

    def fork_from_branch(
        self,
        tag: Tag,
        n: Count = 1,
        timeout_s: Seconds = None,
    ) -> dict[str, Any]:
        """Fork n sandboxes from a branch: a tag you made with branch_sandbox (another
        client's branches are not yours to fork). Each starts in the state the branched
        sandbox was in (its files, its processes, its interpreter's variables),
        independently of the others."""
        return self._spawn(tag, n, timeout_s, None)

    def _spawn(
        self,
        tag: str,
        n: int,
        timeout_s: float | None,
        memory_limit_mib: int | None,
        lazy: bool = False,
    ) -> dict[str, Any]:
        self.branches.may_fork(tag, lazy)
        options: dict[str, Any] = {"lazy": True} if lazy else {}
        if timeout_s is not None:
            options["timeout"] = timeout_s
        if memory_limit_mib is not None:
            options["memory_limit_mib"] = memory_limit_mib
        admitted = (self.sandboxes.admitted(n, f"forking {n} of {tag}", self.controller)
                    if self.sandboxes is not None else contextlib.nullcontext(_owned_by_nobody))
        # A call cancelled (or its token revoked) while its sandboxes start gives them to
        # nobody: they are killed, not left running for ever unknown to anyone. Through a
        # daemon the spawn's connection is cut and the daemon kills them (app.unclaimed);
        # in process, or when the stop came after the daemon's answer, they are killed here.
        with admitted as own, Revocation(self.token) as revocation:
            try:
                started = self.controller.spawn_sandboxes(tag, n, **options)
            except NotFound:
                # no such tag: the answer to another client's branch (BranchTags.not_found)
                if not lazy and _is_ref(tag) and self.branches._digest(tag) is None:
                    self.branches.not_found(tag)
                raise
            if revocation.stop():
                for sb in started:
                    with contextlib.suppress(ForkdError):
                        sb.kill()
                revocation.check()
            own([sb.id for sb in started])
            orphans = self.scope.made([sb.id for sb in started])
        if orphans:
            kill_all(self.controller, orphans)
            raise ForkdError(
                f"this MCP session ended while its {len(orphans)} sandboxes started, so they "
                "were killed (a session's sandboxes end with it); open a new session and "
                "create them again")
        return {"tag": tag, "sandboxes": [sb.id for sb in started]}

    def run_command(
        self,
        sandbox_id: SandboxId,
        command: Annotated[
            str | list[str],
            Field(description="A string runs through /bin/sh -c; a list is the argv."),
        ],
        ctx: Context[Any, Any],
        cwd: GuestPath | None = None,
        env: dict[str, str] | None = None,
        stdin: Annotated[str | None, Field(max_length=MAX_CODE_CHARS)] = None,
        timeout_s: Seconds = None,
    ) -> dict[str, Any]:
        """Run a command in a sandbox and wait for it; its output arrives as progress
        notifications while it runs. Returns exit_code (-N: ended by signal N), status
        (exited, signaled, killed, timed_out or oom_killed), stdout, stderr, timed_out and
        duration; a non-zero exit is a result, not an error."""
        _check_command(command)
        progress = Progress(ctx)
        req = ExecRequest(argv=command_argv(command), env=env, cwd=cwd,
                          stdin=stdin_bytes(stdin), timeout=timeout_s)
        self.scope.check(sandbox_id)
        frames = self.controller.backend.exec_stream(sandbox_id, req)
        with Revocation(self.token, frames) as revocation:
            r = None
            try:
                for frame in frames:
                    if frame.stdout:
                        progress.on_stdout(frame.stdout)
                    if frame.stderr:
                        progress.on_stderr(frame.stderr)
                    if frame.result is not None:
                        r = frame.result
                        break
            except ForkdError:
                revocation.check()  # the stream was ended for a revocation: say that
                raise
            finally:
                frames.close()  # ends what runs it, if it still does
            revocation.check()
        if r is None:
            raise ForkdError(f"sandbox {sandbox_id}: the command's stream ended without a "
                             "result; run it again")
        # streamed: the result carries no output, the tails have it
        stdout, cut_out = clipped(r.stdout) if r.stdout else progress.stdout.text()
        stderr, cut_err = clipped(r.stderr) if r.stderr else progress.stderr.text()
        return {
            "exit_code": r.exit_code,
            "status": r.status,
            "timed_out": r.timed_out,
            "duration": r.duration,
            "stdout": stdout,
            "stderr": stderr,
            "stdout_cut_chars": cut_out,
            "stderr_cut_chars": cut_err,
        }

    def run_code(
        self,
        sandbox_id: SandboxId,
        code: Annotated[str, Field(min_length=1, max_length=MAX_CODE_CHARS)],
        timeout_s: Seconds = None,
    ) -> CallToolResult:
        """Run a Python cell in the sandbox's warm interpreter (its variables persist from
        one call to the next, and into forks of a branch), like a notebook. Returns stdout,
        stderr, the value of the last expression, the error with its traceback (a result,
        not a tool error), and rich results: matplotlib figures as PNG images, pandas
        DataFrames as HTML and text. timeout_s: default 300."""
        sb = self.sandbox(sandbox_id)
        with Revocation(self.token) as revocation:
            r = plain(sb.run_code(code) if timeout_s is None else sb.run_code(code, timeout_s))
            revocation.check()  # a run given up at a revocation says so
        r["stdout"], r["stdout_cut_chars"] = clipped(r.get("stdout", ""))
        r["stderr"], r["stderr_cut_chars"] = clipped(r.get("stderr", ""))
        r = CellBudget(MAX_CELL_CHARS).bounded(r)
        images: list[ImageContent] = []
        shown = dict(r, results=[])
        for result in r.get("results", []):
            brief = dict(result)
            for kind in ("png", "jpeg"):
                if result.get(kind):
                    images.append(ImageContent(type="image", data=result[kind],
                                               mime_type=f"image/{kind}"))
                    brief[kind] = f"(image {len(images)}, {len(result[kind])} base64 chars)"
            shown["results"].append(brief)
        # compact: indented, each level of nesting adds a space to every line inside it
        text = TextContent(type="text", text=json.dumps(shown, default=str))
        return CallToolResult(content=[text, *images], structured_content=r)

    def read_file(
        self, sandbox_id: SandboxId, path: GuestPath, encoding: Encoding = "utf-8"
    ) -> dict[str, Any]:
        """Read a file of the sandbox: as UTF-8 text, or as base64 for any bytes."""
        data = _read_at_most(self.sandbox(sandbox_id), path, MAX_FILE_BYTES)
        if encoding == "base64":
            return {"path": path, "size": len(data), "base64": base64.b64encode(data).decode()}
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise InvalidInput(
                f"{path} is not UTF-8 text; call read_file again with encoding='base64'"
            ) from None
        return {"path": path, "size": len(data), "text": text}

    def write_file(
        self,
        sandbox_id: SandboxId,
        path: GuestPath,
        content: Annotated[str, Field(max_length=MAX_CONTENT_CHARS)],
        encoding: Encoding = "utf-8",
        mode: Annotated[
            int, Field(ge=0, le=0o7777, description="Permission bits, e.g. 420 (0644).")
        ] = 0o644,
    ) -> dict[str, Any]:
        """Write a file in the sandbox (replacing it): content is UTF-8 text, or base64 of
        any bytes with encoding='base64'."""
        data = _decode(content, encoding)
        if len(data) > MAX_FILE_BYTES:
            raise InvalidInput(
                f"the content is {len(data)} bytes, over the {MAX_FILE_BYTES} "
                "write_file takes; write it in parts (run_command: cat >> FILE)"
            )
        self.sandbox(sandbox_id).files.write(path, data, mode)
        return {"path": path, "size": len(data)}

    def branch_sandbox(
        self, sandbox_id: SandboxId, tag: Tag, force: bool = False
    ) -> dict[str, Any]:
        """Save a running sandbox's whole state (memory, processes, disk) as a new snapshot
        tag, a diff layer of what changed; the sandbox goes on running. fork_from_branch
        then starts sandboxes from it. force: replace the tag if it is one you made with
        branch_sandbox on this server (any other existing tag is refused: pick a new one)."""
        ref = str(parse_ref(tag))
        sb = self.sandbox(sandbox_id)
        with self.branches.branching(ref):
            if force:
                force = self.branches.may_replace(ref)
            with self.branches.admitted(ref):
                result = sb.branch(ref, force=force)
                kept = self.branches.made(ref, result.digest)
        if not kept:
            remove_branches(self.branches, [(ref, result.digest)])
            raise ForkdError(
                f"this MCP session ended while it branched to {shown(ref)}, so the branch "
                "was removed (a session's branches end with it); open a new session")
        return {"branch": plain(result)}

    def kill_sandbox(self, sandbox_id: SandboxId) -> dict[str, Any]:
        """Stop a sandbox and remove everything it had (its disk, its saved state)."""
        self.sandbox(sandbox_id).kill()
        self.scope.forget([sandbox_id])  # its id may come round again: not this client's
        return {"killed": sandbox_id}


class Revocation:
    """While a tool runs a command or a cell for an HTTP caller: once the token it came
    with is revoked (``token.current()`` changes), the run is stopped, and ``check`` raises
    saying so. Without this, the HTTP request was ended at a revocation (TokenWatch) but
    the tool went on, its command running for a caller whose token no longer held. A
    streamed command's frames are abandoned (the backend kills the command: in process,
    or the daemon, whose client went away); a cell or command that waits on its guest is
    given up through backend.CALLER_STOP: in process by the guest request's ``stop``,
    through the daemon by shutting down the request's connection (client.RemoteBackend
    ._stoppable), so the daemon's client goes away and the daemon gives it up in turn.
    A cancelled call (stoppable: its CALL_STOP set) is stopped the same way, for any
    caller, stdio's too."""

    def __init__(self, token: Token | None, frames: Transfer[Any] | None = None) -> None:
        self.token = token
        self.frames = frames
        self.stop = Stop()
        self._done = threading.Event()
        self._reset: contextvars.Token[Stop | None] | None = None
        self._abandoning = contextlib.ExitStack()

    def __enter__(self) -> Revocation:
        # the call's own Stop when it has one (stoppable: set when the call is cancelled),
        # so a cancellation and a revocation stop the run the same way
        self.stop = CALL_STOP.get() or self.stop
        self._reset = CALLER_STOP.set(self.stop)
        if self.frames is not None:
            self._abandoning.enter_context(self.stop.calling(self.frames.abandon))
        if self.token is None:
            return self
        given = self.token.current()

        def watch() -> None:
            while not self._done.wait(REVOCATION_CHECK_S):
                if not token_matches(given, self.token.current() if self.token else b""):
                    self.stop.set("revoked")  # abandons the frames (calling, above)
                    return

        threading.Thread(target=watch, name="forkd-mcp-revocation", daemon=True).start()
        return self

    def check(self) -> None:
        if self.stop():
            raise Stopped(self.stop.reason)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._abandoning.close()
        if self._reset is not None:
            CALLER_STOP.reset(self._reset)


REVOCATION_CHECK_S = 0.5  # how often a running tool checks its caller's token still holds


def _read_at_most(sb: Sandbox, path: str, limit: int) -> bytes:
    """The file's bytes, read only as far as ``limit`` (the transfer stops there: a huge
    file, or /dev/zero, costs this server ``limit`` bytes, not its size). A cancelled call
    (CALL_STOP) ends the transfer, also while it waits for a chunk that never comes (a
    FIFO nobody writes): it waited for ever, holding its guest request."""
    parts: list[bytes] = []
    size = 0
    stop = CALL_STOP.get()
    with contextlib.ExitStack() as ending:
        chunks = ending.enter_context(contextlib.closing(sb.files.transfer(path)))
        if stop is not None:
            ending.enter_context(stop.calling(chunks.abandon))
        for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise InvalidInput(
                    f"{path} is over the {limit} bytes a tool result carries; read part of "
                    "it with run_command (head, tail, split)"
                )
            parts.append(chunk)
    if stop is not None and stop():  # abandoned: what came is not the whole file
        raise Stopped(stop.reason)
    return b"".join(parts)


def _check_command(command: str | list[str]) -> None:
    if isinstance(command, str):
        if not command.strip() or len(command) > MAX_CODE_CHARS:
            raise InvalidInput(f"command must be 1 to {MAX_CODE_CHARS} characters of shell")
    elif not command or sum(len(a) for a in command) > MAX_CODE_CHARS:
        raise InvalidInput(
            f"command must be a non-empty argv of at most {MAX_CODE_CHARS} characters"
        )


def _decode(content: str, encoding: str) -> bytes:
    if encoding == "utf-8":
        return content.encode()
    if len(content) > MAX_CONTENT_CHARS:
        raise InvalidInput(f"the content is over the {MAX_FILE_BYTES} bytes write_file takes")
    try:
        return base64.b64decode(content, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("content is not valid base64 (encoding='base64')") from None


TOOL_NAMES = (
    "list_snapshots",
    "list_sandboxes",
    "create_sandboxes",
    "fork_from_branch",
    "run_command",
    "run_code",
    "read_file",
    "write_file",
    "branch_sandbox",
    "kill_sandbox",
)


def build_server(controller: Controller, token: Token | None = None,
                 calls: ToolCalls | None = None,
                 sandboxes: SandboxShares | None = None,
                 scope: SandboxScope | None = None,
                 branches: BranchTags | None = None) -> MCPServer[Any]:
    """The MCP server with every tool of ``Tools`` on ``controller``; ``token``: the HTTP
    callers' (its revocation stops the commands they run, Revocation); ``calls``: the HTTP
    callers' tool calls in flight, in all and per client (None: not counted, stdio's one
    caller); ``sandboxes``: the sandboxes each HTTP caller runs through a daemon (None:
    not counted here); ``scope``: the sandboxes beyond its own each client may act on
    (SandboxScope; default: none); ``branches``: the branch tags each client made
    (BranchTags; default: a new one)."""
    server: MCPServer[Any] = MCPServer(
        name="forkd",
        version=forkd.__version__,
        log_level="WARNING",  # stderr: a stdio client shows it as the server's log
        instructions=(
            "forkd runs sandboxes: copy-on-write VMs forked from warm snapshots in about a "
            "second. list_snapshots, then create_sandboxes(tag, n); run_command and run_code "
            "in them by id; branch_sandbox saves one's whole state as a tag, fork_from_branch "
            "starts new sandboxes from it. Sandboxes outlive this conversation: kill_sandbox "
            "each one you created when done."
        ),
    )
    tools = Tools(controller, token, sandboxes, scope, branches)
    for name in TOOL_NAMES:
        tool = getattr(tools, name)
        if calls is not None:
            tool = calls.counting(tool)
        server.add_tool(stoppable(tool_errors(tool)), name=name)
    return server


def choose_controller(mode: Literal["auto", "daemon", "local"]) -> Controller:
    """auto: the daemon if it answers on its socket, else in-process (the SDK's default)."""
    return Controller(local={"auto": None, "daemon": False, "local": True}[mode])


def serve_stdio(controller: Controller, scope: SandboxScope | None = None) -> None:
    build_server(controller, scope=scope).run("stdio")


MAX_SESSIONS = 256  # open MCP sessions of one `forkd mcp --transport http`; more: 503
MAX_SESSIONS_PER_CLIENT = MAX_SESSIONS // 2  # of them one client (address, IPv6 /64) holds
SESSION_IDLE_S = 600.0  # a session with no request in flight for this long is closed


def http_server(
    controller: Controller,
    host: str,
    port: int,
    path: str,
    token: Token,
    limits: Limits = DEFAULT_LIMITS,
    max_sessions: int = MAX_SESSIONS,
    session_idle_s: float = SESSION_IDLE_S,
    max_sessions_per_client: int = MAX_SESSIONS_PER_CLIENT,
    sandboxes: SandboxShares | None = None,
    scope: SandboxScope | None = None,
) -> uvicorn.Server:
    """The streamable-HTTP server, not started: the daemon's listener bounds (server.
    bounded_config: head deadline, connection cap, no WebSocket), and at most
    ``max_sessions`` MCP sessions, ``max_sessions_per_client`` of them one client's
    (SessionShare), each closed after ``session_idle_s`` without a request in flight (the
    SDK's: a new session past the limit gets 503 "Too many open sessions"), and the tool
    calls in flight bounded in all and per client (ToolCalls), and through a daemon the
    sandboxes each client runs (``sandboxes``, SandboxShares.of the controller by
    default); ``scope``: the sandboxes beyond its own each client may act on. The
    sandboxes a session created are killed when it ends (kill_when_ended)."""
    scope = scope if scope is not None else SandboxScope()
    branches = BranchTags(controller, everything=scope.everything)
    if not scope.everything:  # there any session forks any branch: they stay
        branches.record = BranchRecord.of_server(controller)
    mcp = build_server(controller, token, ToolCalls.of(controller),
                       sandboxes if sandboxes is not None else SandboxShares.of(controller),
                       scope, branches)
    app = mcp.streamable_http_app(
        streamable_http_path=path, host=host, max_sessions=max_sessions,
        session_idle_timeout=session_idle_s,
    )
    sessions = mcp.session_manager
    kill_when_ended(sessions, scope, controller, branches)
    shared = SessionShare(app, lambda sid: sid in sessions._server_instances,
                          max_sessions_per_client, max_sessions)
    told = SessionErrors(shared, max_sessions, session_idle_s)
    bounded = BodyBound(SessionMark(told), MAX_BODY_BYTES, BodyBudget(BODY_BYTES))
    guarded = TokenWatch(BearerAuth(bounded, token), token)  # a revoked token ends its streams
    config = bounded_config(guarded, limits=limits, host=host, port=port)
    return uvicorn.Server(config)


def kill_when_ended(sessions: Any, scope: SandboxScope, controller: Controller,
                    branches: BranchTags | None = None) -> None:
    """Kill the sandboxes of each MCP session of ``sessions`` (the SDK's session manager)
    once the session ends, by its client's DELETE or closed idle (SandboxScope.ended), and
    remove the branches it made (``branches``, BranchTags.ended), in a thread of their own
    (a kill waits on the engine; the event loop does not). A session ended because the
    server stops leaves its sandboxes (its restart forgets who made what; the operator
    names them with --sandbox) but not its branches: the restarted server, which forgot
    their makers too, would list them to every client and fork them for any; they are
    removed before the server ends. The SDK discards every ended session through
    ``_discard_session``, which this wraps."""
    open_now: Callable[[str], bool] = lambda sid: sid in sessions._server_instances  # noqa: E731
    scope.session_open = open_now
    if branches is not None:
        branches.session_open = open_now
    discard = sessions._discard_session

    def ended(ids: list[str], made: list[tuple[str, str]]) -> None:
        kill_all(controller, ids)
        if branches is not None:
            remove_branches(branches, made)

    async def discarded(session_id: str, transport: Any) -> None:
        await discard(session_id, transport)
        made = branches.ended(session_id) if branches is not None else []
        if sessions._task_group is None:  # the server stops: its branches, before it ends
            if made:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(ended, [], made)
            return
        ids = scope.ended(session_id)
        if ids or made:
            threading.Thread(target=ended, args=(ids, made), daemon=True,
                             name="forkd-mcp-session-ended").start()

    sessions._discard_session = discarded


def serve_http(controller: Controller, host: str, port: int, path: str, token: Token,
               scope: SandboxScope | None = None) -> None:
    """Streamable HTTP at ``http://host:port/path``; every request needs
    ``Authorization: Bearer <token>``."""
    http_server(controller, host, port, path, token, scope=scope).run()


MAX_BODY_BYTES = 32 << 20  # one MCP message over HTTP (write_file's 16 MiB as base64 fits)


def _jsonrpc_error(message: str) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": None,
                       "error": {"code": -32600, "message": message}}).encode()


class BodyBound:
    """ASGI middleware of the MCP HTTP app: a message body is at most ``most`` bytes, and
    the bodies held at once count against ``budget`` (app.BodyBudget: in all, and one
    client, agent_client.REQUEST_CLIENT, half of it). The MCP SDK reads a POST's body whole
    into memory with no bound, so one client with the token made the server hold any size
    it sent. Past ``most``: 413 (a Content-Length at once, a chunked body when it passes
    it); past the budget: 429 past the client's share, 503 past the server's; each saying
    which bound and what to do, the body unread."""

    def __init__(self, app: Any, most: int, budget: BodyBudget) -> None:
        self.app = app
        self.most = most
        self.budget = budget

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        announced = announced_size(scope)
        size = self.most if announced is None else announced
        if size > self.most:
            await self._refuse(send, 413, f"the message is {size} bytes, over the "
                               f"{self.most} one MCP message may be; send large files in parts")
            return
        if size == 0:
            await self.app(scope, receive, send)
            return
        client = REQUEST_CLIENT.get()
        refused = self.budget.take(size, client)
        if refused is not None:
            await self._refuse(send, 429 if isinstance(refused, TooManyRequests) else 503,
                               str(refused))
            return
        try:
            if announced is None:  # chunked: read here, within the bound, then passed on
                body = bytearray()
                more = True
                while more:
                    message = await receive()
                    if message["type"] != "http.request":
                        return  # the client left
                    body += message.get("body", b"")
                    more = bool(message.get("more_body"))
                    if len(body) > self.most:
                        await self._refuse(send, 413, f"the message is over the {self.most} "
                                           "bytes one MCP message may be; send large files "
                                           "in parts")
                        return
                whole = {"type": "http.request", "body": bytes(body), "more_body": False}
                given = False

                async def replay() -> Any:
                    nonlocal given
                    if not given:
                        given = True
                        return whole
                    return await receive()

                await self.app(scope, replay, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.budget.give(size, client)

    @staticmethod
    async def _refuse(send: Any, status: int, message: str) -> None:
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        if status in (429, 503):
            headers.append((b"retry-after", b"1"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": _jsonrpc_error(message)})


class SessionShare:
    """ASGI middleware: one client (server.peer_address: an address, an IPv6 /64) holds at
    most ``per_client`` of the MCP sessions, so it cannot open every one (256, each kept
    10 minutes while idle) and leave the others 503 "Too many open sessions". A client's
    sessions are those it opened that are still open (``live``: the SDK forgets a session
    ended by DELETE or closed idle); a new one past its share gets 503 saying so."""

    def __init__(self, app: Any, live: Callable[[str], bool], per_client: int,
                 max_sessions: int) -> None:
        self.app = app
        self.live = live
        self.per_client = per_client
        self.max_sessions = max_sessions
        self.opened: dict[str, set[str]] = {}
        # requests opening a session, per client, counted from their start: a session
        # counted only once its answer started let a client's initializes sent together
        # each find its share unfilled, and take every session of the server
        self.opening: dict[str, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers = dict(scope.get("headers", [])) if scope.get("type") == "http" else {}
        if (scope.get("type") != "http" or b"mcp-session-id" in headers
                or self.per_client >= self.max_sessions):
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        peer = server_peer(str(client[0])) if client else "-"
        # one set per client, changed in place: a request that replaced it with a copy
        # dropped the sessions other requests of the client noted in the old one meanwhile
        mine = self.opened.setdefault(peer, set())
        mine.difference_update([sid for sid in mine if not self.live(sid)])
        held = len(mine) + self.opening.get(peer, 0)
        if held >= self.per_client:
            message = (f"this client ({peer}) holds {held} MCP sessions (open, or being "
                       f"opened), the most one "
                       f"client may ({self.per_client} of {self.max_sessions}); end sessions "
                       "you no longer use (HTTP DELETE with their mcp-session-id) or reuse one")
            body = json.dumps({"jsonrpc": "2.0", "id": None,
                               "error": {"code": -32603, "message": message}}).encode()
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return

        counted = True  # as being opened: until its session is noted, or the request ends

        def opened() -> None:
            nonlocal counted
            if counted:
                counted = False
                self.opening[peer] -= 1
                if not self.opening[peer]:
                    del self.opening[peer]

        async def noted(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                for key, value in message.get("headers", []):
                    if key.lower() == b"mcp-session-id":
                        self.opened.setdefault(peer, set()).add(value.decode("latin-1"))
                opened()  # counted as open from now on (or not a session)
            await send(message)

        self.opening[peer] = self.opening.get(peer, 0) + 1
        try:
            await self.app(scope, receive, noted)
        finally:
            opened()
        if not self.opened.get(peer) and not self.opening.get(peer):
            self.opened.pop(peer, None)
        if sum(len(ids) for ids in self.opened.values()) > 2 * self.max_sessions:
            self._forget_ended()

    def _forget_ended(self) -> None:
        """Drop the sessions that have ended (what is kept is then the open ones, at most
        max_sessions, whichever clients come back)."""
        for peer in list(self.opened):
            self.opened[peer] = {sid for sid in self.opened[peer] if self.live(sid)}
            if not self.opened[peer]:
                del self.opened[peer]


class SessionErrors:
    """ASGI middleware: the MCP SDK's own session errors say what to do. The SDK answers a
    new session past ``max_sessions`` with 503 "Too many open sessions" and an unknown or
    expired session id with 404 "Session not found", and a client shows just that; here
    the message says why and what to do, and the 503 has ``Retry-After``."""

    def __init__(self, app: Any, max_sessions: int, idle_s: float) -> None:
        self.app = app
        self.told = {
            "Too many open sessions": (
                f"Too many open sessions: this server keeps at most {max_sessions} MCP "
                "sessions open at once; end sessions you no longer use (HTTP DELETE with "
                "their mcp-session-id), or retry once idle ones have closed (after "
                f"{idle_s:g} s without a request), docs/mcp.md Limits"),
            "Session not found": (
                "Session not found: this mcp-session-id is unknown or its session has closed "
                f"(sessions close after {idle_s:g} s without a request, or when ended); start "
                "a new session with initialize, without the mcp-session-id header"),
        }

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] | None = None

        async def told(message: dict[str, Any]) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] in (404, 503):
                held = message  # its body decides: the SDK's error, or another answer
                return
            if held is not None and message["type"] == "http.response.body":
                start, held = held, None
                body = message.get("body", b"")
                if not message.get("more_body"):
                    start, body = self._rewritten(start, body)
                await send(start)
                await send({**message, "body": body})
                return
            await send(message)

        await self.app(scope, receive, told)

    def _rewritten(self, start: dict[str, Any], body: bytes) -> tuple[dict[str, Any], bytes]:
        try:
            answer = json.loads(body)
            said = answer["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return start, body
        if not isinstance(said, str) or said not in self.told:
            return start, body
        answer["error"]["message"] = self.told[said]
        new = json.dumps(answer).encode()
        headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(new)).encode()))
        if start["status"] == 503:
            headers.append((b"retry-after", b"1"))
        return {**start, "headers": headers}, new


class BearerAuth:
    """ASGI middleware: HTTP requests without the bearer token get 401 (compared in
    constant time); the MCP app sees only the ones that carry it. Deny by default: only
    ``lifespan`` (the server's own start and stop) passes without the token; a WebSocket
    or any scope type an ASGI server may add is refused (closed) unless it carries the
    token, so no route the MCP SDK adds later is reached around the check."""

    def __init__(self, app: Any, token: Token) -> None:
        self.app = app
        self.token = token

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        kind = scope.get("type")
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind == "websocket" and not self._allowed(scope):
            await send({"type": "websocket.close", "code": 1008})  # policy violation
            return
        if kind not in ("http", "websocket"):
            return  # a scope this middleware does not know: never passed on
        if kind == "http" and not self._allowed(scope):
            await send(
                {
                    "type": "http.response.start",
                    "status": 401,
                    "headers": [
                        (b"content-type", b"text/plain; charset=utf-8"),
                        (b"www-authenticate", b'Bearer realm="forkd-mcp"'),
                    ],
                }
            )
            await send(
                {
                    "type": "http.response.body",
                    "body": b"forkd mcp: send Authorization: Bearer <token> (docs/mcp.md)\n",
                }
            )
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: dict[str, Any]) -> bool:
        return token_matches(scope_token(scope), self.token.current())
