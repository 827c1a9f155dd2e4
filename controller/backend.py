"""What a controller can do, and the local implementation (the engine and store in-process).

The daemon serves ``LocalBackend`` over REST; the SDK and the CLI use either
``LocalBackend`` directly or ``RemoteBackend`` (forkd.controller.client) when a
daemon runs. Both take and answer the types of forkd.controller.api, one method per
``api.OPERATIONS`` entry, so the REST API is these methods and nothing more.
"""

from __future__ import annotations

import codecs
import collections
import contextlib
import contextvars
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from typing import Any, Protocol, TypeVar

import msgspec

from forkd.controller.api import (
    BranchRequest,
    BranchResult,
    CompactRequest,
    EvalRequest,
    EvalResult,
    ExecFrame,
    ExecRequest,
    ExecResult,
    ExtendRequest,
    LayerInfo,
    PoolRemoved,
    PoolRequest,
    PoolStatus,
    ProcessInfo,
    ProcessKillRequest,
    ProcessSignaled,
    ProcessStartRequest,
    ProcessStdinRequest,
    ProcessWaitRequest,
    ProcessWaitResult,
    Removed,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SpawnRequest,
    SpawnResult,
    StdinWritten,
)
from forkd.engine import children as ch
from forkd.engine import lifetimes, watchdog
from forkd.engine.agent_client import (
    REQUEST_CLIENT,
    Abandoned,
    exec_args,
    guest_b64,
    host_wait,
)
from forkd.engine.branch import branch as branch_child
from forkd.engine.commands import check_handle, check_timeout
from forkd.engine.errors import AgentError, TooManyRequests
from forkd.engine.lifecycle import PAUSED_NAME, ChildInfo, Lifetime, Limits, private_owner
from forkd.engine.paths import hidden_host_paths
from forkd.engine.pause import pause as pause_child
from forkd.engine.pause import resume as resume_child
from forkd.engine.pool import MAX_POOL, Pool
from forkd.errors import Conflict, ForkdError, InvalidInput, NotFound
from forkd.jsondoc import is_integer
from forkd.names import inert, parse_ref, shown
from forkd.registry import credentials
from forkd.registry.reference import Hub, default_hub
from forkd.store.store import Store

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)
SWEEP_INTERVAL_S = 1.0  # the daemon's sweeper acts on passed deadlines within this
# VMs at once by default: a daemon's (forkd serve), and an in-process controller's (the SDK
# and `forkd mcp` without a daemon): sandboxes, pool processes, ones starting
MAX_SANDBOXES = 512


def client_share(max_sandboxes: int) -> int:
    """The VMs one client of the daemon may run by default: half of its limit (at least
    one), as it holds half of its guest requests and connections."""
    return max(1, max_sandboxes // 2)


class Transfer(Iterator[T_co], Protocol):
    """What a streamed command (``exec_stream``) or a file read (``read_file``) gives: its
    items as they come. ``close`` (in the reading thread: use ``contextlib.closing``) ends
    it and what produces it (the command is killed, the file's transfer ends); ``abandon``
    does too from any thread, also while another thread waits in ``next`` for an item that
    never comes (a command that prints nothing, a FIFO nobody writes)."""

    def close(self) -> None: ...
    def abandon(self) -> None: ...


class Backend(Protocol):
    """One method per api.OPERATIONS entry (the pools' are PoolBackend's)."""

    def snapshots(self) -> list[LayerInfo]: ...
    def snapshot(self, ref: str) -> dict[str, Any]: ...
    def delete_snapshot(self, ref: str, cascade: bool = False) -> Removed: ...
    def compact(self, req: CompactRequest) -> LayerInfo: ...
    def spawn(self, req: SpawnRequest) -> SpawnResult: ...
    def sandboxes(self) -> list[SandboxInfo]: ...
    def sandbox(self, sandbox_id: str) -> SandboxInfo: ...
    def kill(self, sandbox_id: str) -> SandboxInfo: ...
    def extend(self, sandbox_id: str, req: ExtendRequest) -> SandboxInfo: ...
    def pause(self, sandbox_id: str) -> SandboxInfo: ...
    def resume(self, sandbox_id: str) -> SandboxInfo: ...
    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult: ...
    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Transfer[ExecFrame]: ...
    def eval(self, sandbox_id: str, req: EvalRequest) -> EvalResult: ...
    def run_code(self, sandbox_id: str, req: RunCodeRequest) -> RunCodeResult: ...
    def process_start(self, sandbox_id: str, req: ProcessStartRequest) -> ProcessInfo: ...
    def processes(self, sandbox_id: str) -> list[ProcessInfo]: ...
    def process_wait(
        self, sandbox_id: str, handle: str, req: ProcessWaitRequest
    ) -> ProcessWaitResult: ...
    def process_stdin(
        self, sandbox_id: str, handle: str, req: ProcessStdinRequest
    ) -> StdinWritten: ...
    def process_kill(
        self, sandbox_id: str, handle: str, req: ProcessKillRequest
    ) -> ProcessSignaled: ...
    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...
    def read_file(self, sandbox_id: str, path: str) -> Transfer[bytes]: ...
    def branch(self, sandbox_id: str, req: BranchRequest) -> BranchResult: ...


class PoolBackend(Backend, Protocol):
    """What the daemon serves on top of Backend: spawns that (re)fill a prewarmed pool, and
    the pools themselves (docs/api.md). Only a long-running process can keep a pool."""

    def pools(self) -> list[PoolStatus]: ...
    def fill_pool(self, req: PoolRequest) -> PoolStatus: ...
    def remove_pool(self, tag: str) -> PoolRemoved: ...


SANDBOX_FIELDS = tuple(f.name for f in fields(ChildInfo))  # every one is in api.SandboxInfo


def sandbox_view(info: ChildInfo) -> SandboxInfo:
    view = {name: getattr(info, name) for name in SANDBOX_FIELDS}
    view["status"] = info.state() if info.status == "running" else info.status
    view["time_left_s"] = lifetimes.time_left(info)
    return msgspec.convert(view, SandboxInfo)


def limits_of(req: SpawnRequest) -> Limits:
    return Limits(
        req.memory_limit_mib, req.cpus, req.pids_max, req.disk_bps, req.disk_iops, req.net_kbit
    )


def _local_tag(store: Store, text: str) -> bool:
    """``text`` names a tag of the local store."""
    try:
        store.resolve(text)
    except (InvalidInput, NotFound):
        return False
    return True


def lazy_remote(tag: str) -> Any:
    """The hub reference a lazy spawn's ``tag`` is (registry.reference.Remote), or the
    InvalidInput saying it is none (the MCP server answers a fork of another client's
    hidden branch with it too, as it would a name nobody used)."""
    from forkd.registry.reference import parse_remote

    try:
        return parse_remote(tag)
    except InvalidInput as exc:
        raise InvalidInput(
            "lazy needs a hub reference, [HUB/]NS/NAME[:TAG], as the tag, got "
            f"{shown(tag)}: {exc}"
        ) from None


def _refuse_paused_source(tag: str) -> None:
    """A paused sandbox's saved state (``forkd-paused/ID:a|b``) is that sandbox's alone:
    only its resume starts from it, so no spawn or pool clones it."""
    if private_owner(tag) is not None:
        raise InvalidInput(
            f"{shown(tag)} is the saved state of paused sandbox {private_owner(tag)}, not a "
            "snapshot to fork: resume that sandbox (POST /v1/sandboxes/ID/resume), or branch "
            "it to a tag of your own after the resume"
        )


def _refuse_private(what: str, tag: str) -> None:
    """A tag the caller names to be written may not be a paused sandbox's saved state
    (``forkd-paused/ID:a|b``, written only by pause): a branch or compact there would
    replace another sandbox's state, or plant one for an id not yet given out."""
    if private_owner(tag) is not None:
        raise InvalidInput(
            f"{what} {shown(tag)} is under {PAUSED_NAME}/, where paused sandboxes keep their "
            "saved state; pick a tag outside it"
        )


class Stop:
    """Why a request's work should stop early: its client went away (``gone``) or its
    token was revoked (``revoked``); set once, from any thread (app.CallerWatch and
    app.TokenWatch set it, a guest request asks it twice a second)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def set(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def __call__(self) -> bool:
        return self._event.is_set()

    @contextlib.contextmanager
    def calling(self, callback: Callable[[], None]) -> Iterator[None]:
        """``callback`` is called (once, in the thread that sets this) if this is set while
        the block runs, or at once if it is set already: what a blocking call that cannot
        ask (a request to the daemon waiting for its answer) is ended by."""
        with self._lock:
            now = self._event.is_set()
            if not now:
                self._callbacks.append(callback)
        if now:
            callback()
        try:
            yield
        finally:
            with self._lock:
                if callback in self._callbacks:
                    self._callbacks.remove(callback)


# The Stop of the request this thread serves (the daemon sets it per request, and its
# worker threads see it: they run in a copy of the request's context); None in process.
CALLER_STOP: contextvars.ContextVar[Stop | None] = contextvars.ContextVar(
    "forkd_caller_stop", default=None)


class Stopped(ForkdError):
    """A guest request was given up because its caller went away or its token was revoked
    (Stop.reason): the connection to the guest was closed, so a command was killed with
    its process group (docs/agent-protocol.md, "The relay")."""

    exit_code = 8

    def __init__(self, reason: str | None) -> None:
        self.reason = reason
        why = ("the bearer token was revoked while this request ran" if reason == "revoked"
               else "the client went away")
        super().__init__(f"{why}: its command in the sandbox was stopped; send the request "
                         "again (with the new token)")


def asked(sandbox_id: str, op: str, args: dict[str, Any], wait: float | None) -> dict[str, Any]:
    """One request to a sandbox's guest agent that waits for its answer (exec, eval,
    run_code, proc_wait), given up once the daemon's caller is gone or its token revoked
    (CALLER_STOP): Stopped then, and the relay cancels it in the guest. Without this a
    request waited for its command however long it ran, holding a thread and one of the
    daemon's guest requests for a client that was no longer there."""
    stop = CALLER_STOP.get()
    try:
        with ch.agent(sandbox_id) as client:
            return client.request(op, args, timeout=wait, stop=stop)
    except Abandoned:
        raise Stopped(stop.reason if stop is not None else None) from None


STREAM_QUEUE = 64  # frames of a streamed command waiting for its reader, at most
FILE_QUEUE = 16  # chunks (1 MiB each) of a file read waiting for its reader, at most
STREAM_FRAME_CHARS = 64 << 10  # characters of output in one streamed frame, at most
# Bytes of a stream waiting for a slow reader: one stream's, and all of this process's
# (a stream outlives the request limits: its command may have ended, its frames not read).
# Each stream's first waiting item is outside the process's budget, so slow readers that
# use it up only slow the others down, never stop them. app.relayed, the daemon's other
# queue, has the same bounds of its own.
STREAM_BYTES_EACH = 2 << 20
STREAM_BYTES = 64 << 20


class ByteBudget:
    """Bytes that may wait at once; ``take`` blocks while they would be exceeded."""

    def __init__(self, total: int) -> None:
        self.total, self.used = total, 0
        self._changed = threading.Condition()

    def take(self, n: int, gone: threading.Event, seconds: float | None = None) -> bool:
        """Wait (up to ``seconds``, default as long as it takes) for room for ``n`` bytes
        (an item larger than the total waits until nothing else does), then count them;
        False (nothing counted) once ``gone`` or after ``seconds``."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self._changed:
            while n and self.used and self.used + n > self.total:
                left = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
                if gone.is_set() or left <= 0:
                    return False
                self._changed.wait(left)
            if gone.is_set():
                return False
            self.used += n
            return True

    def give(self, n: int) -> None:
        with self._changed:
            self.used -= n
            self._changed.notify_all()


STREAM_BUDGET = ByteBudget(STREAM_BYTES)


def held_bytes(item: object) -> int:
    """About what ``item`` holds of memory while it waits: a chunk's bytes, a frame's text."""
    if isinstance(item, (bytes, bytearray)):
        return len(item)
    if isinstance(item, ExecFrame):
        return sum(sys.getsizeof(t) for t in (item.stdout, item.stderr) if t)
    return 0


class Waiting:
    """The bytes of one stream's queue (one producer, one reader, first in first out): at
    most ``each``; all but the first waiting item's within ``every``, the process's."""

    def __init__(self, each: int, every: ByteBudget) -> None:
        self.own, self.every = ByteBudget(each), every
        self._charges: collections.deque[tuple[int, int]] = collections.deque()

    def take(self, item: object, gone: threading.Event) -> bool:
        """Count ``item`` before it is queued (waiting for room); False once ``gone``."""
        n = held_bytes(item)
        if not self.own.take(n, gone):
            return False
        shared = 0
        # the process's budget, unless nothing else of this stream waits (its reader would
        # wait for other streams' readers): checked again while it waits for room
        while self.own.used > n:
            if self.every.take(n, gone, 0.05):
                shared = n
                break
            if gone.is_set():
                self.own.give(n)
                return False
        self._charges.append((n, shared))
        return True

    def untake(self) -> None:
        """The item last counted did not go into the queue after all."""
        self._give(self._charges.pop())

    def taken(self) -> None:
        """The oldest item counted left the queue."""
        self._give(self._charges.popleft())

    def _give(self, charge: tuple[int, int]) -> None:
        n, shared = charge
        self.every.give(shared)
        self.own.give(n)


PENDING = object()  # Produced.next_within: no item yet


class Handoff:
    """A bounded queue from a producing thread to one reader, which may go away: then
    ``put`` drops instead of blocking forever. At most ``size`` items wait, and bytes
    within STREAM_BYTES_EACH and, with all other handoffs, STREAM_BYTES (Waiting)."""

    def __init__(self, size: int) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(size)
        self._gone = threading.Event()
        self._bytes = Waiting(STREAM_BYTES_EACH, STREAM_BUDGET)

    def put(self, item: Any) -> bool:
        """Queue ``item`` (waiting while the queue or a byte budget is full); False when
        the reader has gone (the item is dropped)."""
        if not self._bytes.take(item, self._gone):
            return False
        while not self._gone.is_set():
            try:
                self._queue.put(item, timeout=0.5)
            except queue.Full:
                continue
            if self._gone.is_set():  # abandoned while it went in: nobody takes it
                self._drop_waiting()
                return False
            return True
        self._bytes.untake()
        return False

    def get(self, seconds: float | None = None) -> Any:
        """The next item; None once abandoned (from any thread: a reader blocked here for
        an item that never comes is let go); PENDING after ``seconds`` without one."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while not self._gone.is_set():
            step = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                item = self._queue.get(timeout=max(step, 0))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    return PENDING
                continue
            self._bytes.taken()
            return item
        return None

    def abandon(self) -> None:
        self._gone.set()
        self._drop_waiting()

    def abandoned(self) -> bool:
        """The reader has gone: what produces for it should stop (and end what it runs)."""
        return self._gone.is_set()

    def _drop_waiting(self) -> None:
        while True:  # what waits is dropped: its bytes are free for the other streams
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return
            self._bytes.taken()


def _code_args(code: str, timeout: float | None) -> dict[str, Any]:
    """The arguments of an eval or run_code request (AgentClient.eval's), checked."""
    check_timeout("timeout", timeout)
    args: dict[str, Any] = {"code": code}
    if timeout is not None:
        args["timeout"] = timeout
    return args


def guest_answer(reply: Any, answer: type[T], op: str) -> T:
    """A guest agent's reply to ``op`` as the API's ``answer`` type; an AgentError saying
    so when it does not fit (the guest is the untrusted side: a reply of another shape is
    its fault, told as such, never an unexplained internal error)."""
    try:
        return msgspec.convert(reply, answer)
    except msgspec.ValidationError as exc:
        raise AgentError(
            f"the guest agent's answer to {op} does not match the protocol ({exc}); its "
            "sandbox may be damaged: kill it"
        ) from None


class ReaderGone(Exception):
    """The reader of a produced stream stopped reading: what produces it may stop."""


class Produced(Iterator[Any]):
    """What ``work`` puts into a Handoff of ``size`` items, run in a thread of its own
    (named ``name``), as the caller reads it; an exception of ``work`` is raised in the
    caller's thread after the items it put before. A caller that stops reading abandons
    the handoff, ``work``'s puts return False from then on and its ``stop`` (the
    handoff's ``abandoned``) says True: by ``close`` in the reading thread, or by
    ``abandon`` from any thread, also while another thread waits in ``next`` for an item
    that never comes (a command that prints nothing; app.relayed's thread)."""

    def __init__(self, name: str, work: Callable[[Handoff], None], size: int) -> None:
        self._items = Handoff(size)
        self._ended = False

        def run() -> None:
            try:
                work(self._items)
            except BaseException as exc:  # handed to the caller's thread in __next__
                self._items.put(exc)
            finally:
                self._items.put(None)

        # in the caller's context: its guest request counts against its client's share
        # (agent_client.REQUEST_CLIENT) as the same request unstreamed would
        context = contextvars.copy_context()
        threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()

    def __next__(self) -> Any:
        return self.next_within(None)

    def next_within(self, seconds: float | None) -> Any:
        """The next item, or PENDING when none came within ``seconds`` (None: wait)."""
        item = None if self._ended else self._items.get(seconds)
        if item is PENDING:
            return item
        if item is None:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        return item

    def close(self) -> None:
        self._ended = True
        self._items.abandon()

    abandon = close  # safe from any thread: sets an event, drops what waits


def produced(name: str, work: Callable[[Handoff], None], size: int) -> Produced:
    """Produced(name, work, size)."""
    return Produced(name, work, size)


def output_frame(stream: str, text: str) -> ExecFrame:
    return ExecFrame(stdout=text) if stream == "stdout" else ExecFrame(stderr=text)


LAZY_HUBS_ENV = "FORKD_LAZY_HUBS"  # comma-separated HOST[:PORT]: more hubs lazy spawns use


def check_lazy_hub(hub: Hub) -> None:
    """Refuse a lazy spawn from a hub this host was not told to use: a caller (an API
    token's holder, an agent through MCP) names the hub, and the spawn connects to it
    from this host, which would reach any address it can, past the sandboxes' egress
    rules. Allowed: the default hub, a hub this user has logged in to (forkd login), and
    those ``$FORKD_LAZY_HUBS`` lists."""
    listed = {h.strip().lower() for h in os.environ.get(LAZY_HUBS_ENV, "").split(",")}
    default = default_hub()
    if (hub.host.lower() in listed or (default is not None and default.host == hub.host)
            or credentials.load(hub.host) is not None):
        return
    raise InvalidInput(
        f"lazy spawns fetch only from the default hub, hubs this host has logged in to and "
        f"those ${LAZY_HUBS_ENV} lists, and {inert(hub.host)} is none of them: add it to "
        f"{LAZY_HUBS_ENV} where the daemon runs (comma-separated HOST[:PORT]), log in to it "
        "there (forkd login), or pull the pack and spawn the local tag"
    )


class LocalBackend:
    """The engine and the store in this process."""

    def __init__(
        self,
        store: Store | None = None,
        pool: Pool | None = None,
        *,
        sweeper: bool = False,
        max_sandboxes: int | None = None,
        max_per_client: int | None = None,
    ) -> None:
        """pool: prewarmed processes per tag (the daemon has one; in-process use does not).
        sweeper: enforce sandbox deadlines in a thread of this process (the daemon does);
        without it a deadline set here starts the engine's watchdog (engine/watchdog.py).
        max_sandboxes: how many QEMUs may run at once (running sandboxes, pool targets and
        the ones starting; `forkd serve --max-sandboxes`), None for no limit.
        max_per_client: how many of them one client of the daemon (agent_client
        .REQUEST_CLIENT: a uid on the Unix socket, an address on TCP) may have started and
        still run (`--max-sandboxes-per-client`); by default half of max_sandboxes. An
        in-process caller (no client) has no share to keep."""
        if max_sandboxes is not None and not is_integer(max_sandboxes, 1):
            raise InvalidInput(f"the sandbox limit must be a positive integer, got "
                               f"{max_sandboxes!r}")
        if max_per_client is not None and (
            isinstance(max_per_client, bool) or not isinstance(max_per_client, int)
            or max_per_client < 1
        ):
            raise InvalidInput(f"the per-client sandbox limit must be a positive integer, got "
                               f"{max_per_client!r}")
        self.store = store or Store.open()
        self.pool = pool
        self.max_sandboxes = max_sandboxes
        self.max_per_client = (max_per_client if max_per_client is not None
                               else client_share(max_sandboxes) if max_sandboxes else None)
        self._admitting = threading.Lock()
        self._starting = 0  # QEMUs admitted and not yet counted as running or pooled
        # who started what (a client as agent_client.REQUEST_CLIENT names it): the sandboxes
        # it spawned or resumed, the pools whose target it set, the VMs it has starting.
        # In memory: what ran before the daemon started is nobody's.
        self._owners: dict[str, str] = {}
        self._pool_owners: dict[str, str] = {}
        self._starting_for: dict[str, int] = {}
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        if sweeper:
            lifetimes.sweep_once(self.store)  # deadlines that passed while nobody watched
            self._sweeper = threading.Thread(target=self._sweep, name="forkd-sweeper", daemon=True)
            self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            lifetimes.sweep_once(self.store)

    def _deadlines_changed(self) -> None:
        """A deadline was set here: someone must enforce it."""
        if self._sweeper is None:
            watchdog.ensure_running()

    def close(self) -> None:
        """Drain the pool: every waiting QEMU killed, its files removed; stop the sweeper
        (handing remaining deadlines to the watchdog). Idempotent."""
        if self.pool is not None:
            self.pool.close()
        if self._sweeper is not None:
            self._stop.set()
            self._sweeper.join(30)
            self._sweeper = None
            if lifetimes.next_deadline() is not None:
                watchdog.ensure_running()

    def _in_use(self, but_pool: str | None) -> int:
        """QEMUs this daemon counts against max_sandboxes: every running sandbox of the run
        directory, every pool's target (its tag's ``but_pool`` left out: it is being set),
        and the ones admitted that are still starting."""
        running = sum(1 for c in ch.list_children() if c.status == "running")
        pools = self.pool.status() if self.pool is not None else []
        pooled = sum(int(s["target"]) for s in pools if s["tag"] != but_pool)
        return running + pooled + self._starting

    def _client_uses(self, client: str, but_pool: str | None) -> int:
        """QEMUs counted against ``client``'s share: the running sandboxes it spawned or
        resumed, the targets of the pools it last set (``but_pool`` left out), and its
        ones starting. Sandboxes that no longer exist are forgotten here."""
        children = {c.id: c.status for c in ch.list_children()}
        for gone in [i for i in self._owners if i not in children]:
            del self._owners[gone]
        running = sum(1 for i, who in self._owners.items()
                      if who == client and children.get(i) == "running")
        pools = self.pool.status() if self.pool is not None else []
        pooled = sum(int(s["target"]) for s in pools if s["tag"] != but_pool
                     and self._pool_owners.get(str(s["tag"])) == client)
        return running + pooled + self._starting_for.get(client, 0)

    @contextlib.contextmanager
    def _admitted(self, n: int, what: str, pool_tag: str | None = None) -> Iterator[None]:
        """Room for ``n`` more QEMUs while the block runs (a spawn, a pool fill, a resume),
        or Conflict saying the limit, or TooManyRequests (429) when the request's client
        would pass its share (max_per_client); counted until the block ends, when they are
        running (or in a pool) and counted there (the block calls ``_own`` for them)."""
        if self.max_sandboxes is None:
            yield
            return
        but_pool = str(parse_ref(pool_tag)) if pool_tag is not None else None
        client = REQUEST_CLIENT.get()
        counted = False  # against the client's share
        with self._admitting:
            used = self._in_use(but_pool)
            if used + n > self.max_sandboxes:
                raise Conflict(
                    f"{what} needs {n} more VMs and this daemon runs {used} (sandboxes, pool "
                    f"processes and ones starting), its limit is {self.max_sandboxes} "
                    "(forkd serve --max-sandboxes): kill or pause sandboxes, or shrink a pool"
                )
            if client is not None and self.max_per_client is not None:
                mine = self._client_uses(client, but_pool)
                if mine + n > self.max_per_client:
                    raise TooManyRequests(
                        f"{what} needs {n} more VMs and this client ({client}) runs {mine} "
                        "(sandboxes it spawned or resumed, pools it filled, ones starting); "
                        f"one client's share is {self.max_per_client} of the daemon's "
                        f"{self.max_sandboxes} (forkd serve --max-sandboxes-per-client): "
                        "kill or pause some of its sandboxes, or shrink its pools; the other "
                        "clients keep the rest"
                    )
                self._starting_for[client] = self._starting_for.get(client, 0) + n
                counted = True
            self._starting += n
        try:
            yield
        finally:
            with self._admitting:
                self._starting -= n
                if counted and client is not None:
                    self._starting_for[client] -= n
                    if self._starting_for[client] <= 0:
                        del self._starting_for[client]

    def _own(self, ids: list[str] | None = None, pool_tag: str | None = None) -> None:
        """The sandboxes ``ids`` (spawned, resumed) or the pool of ``pool_tag`` (its target
        set) count against the request's client's share from now on."""
        client = REQUEST_CLIENT.get()
        with self._admitting:
            for i in ids or []:
                if client is None:
                    self._owners.pop(i, None)
                else:
                    self._owners[i] = client
            if pool_tag is not None:
                tag = str(parse_ref(pool_tag))
                if client is None:
                    self._pool_owners.pop(tag, None)
                else:
                    self._pool_owners[tag] = client

    def snapshots(self) -> list[LayerInfo]:
        return self.store.images()

    def snapshot(self, ref: str) -> dict[str, Any]:
        return self.store.inspect(ref)

    def delete_snapshot(self, ref: str, cascade: bool = False) -> Removed:
        """Conflict when it (or, with cascade, a tag built on it) is a sandbox's saved
        state: that sandbox's resume would have nothing to start from."""
        return Removed(removed=self.store.remove(ref, cascade=cascade,
                                                 refuse=ch.refuse_saved_state))

    def compact(self, req: CompactRequest) -> LayerInfo:
        _refuse_paused_source(req.ref)  # a copy of it would be a snapshot anyone may fork
        _refuse_private("compact's to", req.to)
        return self.store.compact(req.ref, req.to)

    def spawn(self, req: SpawnRequest) -> SpawnResult:
        """prewarm=K: after serving, fill (or refill) the tag's pool to K in the background.
        timeout: seconds until each sandbox is killed or paused (on_timeout); cpus, pids_max,
        disk_bps, disk_iops, net_kbit: limits (docs/engine.md, "Limits")."""
        ch.check_count(req.n)
        _refuse_paused_source(req.tag)
        if req.prewarm is not None:
            self._check_prewarm(req.prewarm)
        limits = limits_of(req)
        fork = self._lazy_fork(req) if req.lazy else functools.partial(ch.fork, pool=self.pool)
        more = req.n + (req.prewarm or 0)
        with self._admitted(more, f"spawning {req.n} of {req.tag}",
                            req.tag if req.prewarm is not None else None):
            result = fork(
                self.store,
                req.tag,
                req.n,
                limits=limits,
                lifetime=Lifetime(req.timeout, req.on_timeout),
                with_netns=req.netns,
                sandbox=req.sandbox,
                egress=req.egress,
            )
            self._own([c.id for c in result.children])
            if req.timeout is not None:
                self._deadlines_changed()
            if req.prewarm is not None and self.pool is not None:
                self._own(pool_tag=req.tag)
                self.pool.fill(
                    req.tag,
                    req.prewarm,
                    limits=limits,
                    sandbox=req.sandbox,
                    with_netns=req.netns,
                    wait=False,
                )
        return SpawnResult(
            sandboxes=[sandbox_view(c) for c in result.children],
            assemble_ms=round(result.assemble_ms, 1),
            total_ms=round(result.total_ms, 1),
            errors=[hidden_host_paths(e, self.store.home) for e in result.errors],
        )

    def _lazy_fork(self, req: SpawnRequest) -> Callable[..., ch.ForkResult]:
        """``lazy``: the fork of children of a hub's pack before it has arrived
        (docs/engine.md, "Lazy fork"), once the request is checked: the tag must name a hub
        reference and no pool (its processes wait on a local tag)."""
        from forkd.engine.lazy import fork as lazy_fork

        if req.prewarm is not None:
            raise InvalidInput(
                "lazy and prewarm do not go together: a pool keeps processes of a local tag; "
                "spawn lazily without prewarm, then prewarm the local tag once it is complete"
            )
        if _local_tag(self.store, req.tag):
            raise InvalidInput(
                f"lazy needs a hub reference, [HUB/]NS/NAME[:TAG], and {shown(req.tag)} is a local "
                "snapshot tag: spawn it without lazy, or name the hub it comes from"
            )
        check_lazy_hub(lazy_remote(req.tag).hub)
        return lazy_fork.fork

    def sandboxes(self) -> list[SandboxInfo]:
        return [sandbox_view(c) for c in ch.list_children()]

    def _check_prewarm(self, k: int) -> Pool:
        if not is_integer(k, 0, MAX_POOL):
            raise InvalidInput(f"prewarm must be between 0 and {MAX_POOL}, got {k!r}")
        if self.pool is None:
            raise InvalidInput(
                "prewarm needs a long-running controller: start `forkd serve` "
                "(an in-process engine exits with its command)"
            )
        return self.pool

    def pools(self) -> list[PoolStatus]:
        statuses = self.pool.status() if self.pool is not None else []
        return [msgspec.convert(s, PoolStatus) for s in statuses]

    def fill_pool(self, req: PoolRequest) -> PoolStatus:
        _refuse_paused_source(req.tag)
        pool = self._check_prewarm(req.k)
        with self._admitted(req.k, f"a pool of {req.k} for {req.tag}", req.tag):
            status = pool.fill(
                req.tag,
                req.k,
                memory_limit_mib=req.memory_limit_mib,
                sandbox=req.sandbox,
                with_netns=req.netns,
                wait=req.wait,
            )
            self._own(pool_tag=req.tag)
        return msgspec.convert(status, PoolStatus)

    def remove_pool(self, tag: str) -> PoolRemoved:
        parse_ref(tag)  # a malformed tag is a 400 naming it shortened, pool or not
        if self.pool is None or not self.pool.remove(tag):
            raise NotFound(f"no prewarmed pool for {shown(tag)}; GET /v1/pools lists them")
        return PoolRemoved(tag=tag, removed=True)

    def sandbox(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_view(ch.get(sandbox_id))

    def kill(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_view(ch.kill(sandbox_id, self.store))

    def extend(self, sandbox_id: str, req: ExtendRequest) -> SandboxInfo:
        info = lifetimes.extend(sandbox_id, req.seconds)
        self._deadlines_changed()
        return sandbox_view(info)

    def pause(self, sandbox_id: str) -> SandboxInfo:
        return sandbox_view(pause_child(self.store, sandbox_id))

    def resume(self, sandbox_id: str) -> SandboxInfo:
        with self._admitted(1, f"resuming {sandbox_id}"):
            info = resume_child(self.store, sandbox_id)
            self._own([info.id])
        if info.deadline is not None:
            self._deadlines_changed()
        return sandbox_view(info)

    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        if not req.argv:
            raise InvalidInput("nothing to execute: give a command (argv)")
        args = exec_args(req.argv, req.env, req.cwd, req.stdin, req.timeout, False)
        result = asked(sandbox_id, "exec", args, host_wait(req.timeout))
        return guest_answer(result, ExecResult, "exec")

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Transfer[ExecFrame]:
        """The command's output as frames while it runs (UTF-8, a character split between
        two chunks is kept whole), then its result. The command runs in a thread of its
        own; at most STREAM_QUEUE frames wait for the caller (a slow reader slows the
        command's output, not the host's memory). A caller that stops reading (closes the
        iterator: the REST client went away) ends the command within a second, killed with
        its process group, as any agent client that goes away does (docs/agent-protocol.md,
        "The relay"): nobody can receive its output or its result any more, and a command
        without a timeout would hold its request (of MAX_REQUESTS) and a thread for ever."""

        def run(frames: Handoff) -> None:
            decoders: list[tuple[str, codecs.IncrementalDecoder]] = []

            def output(name: str) -> Callable[[bytes], None]:
                decoder = codecs.getincrementaldecoder("utf-8")("replace")
                decoders.append((name, decoder))

                def put(data: bytes) -> None:
                    text = decoder.decode(data)  # a guest event is up to 2 MiB: in pieces
                    for at in range(0, len(text), STREAM_FRAME_CHARS):
                        frame = output_frame(name, text[at : at + STREAM_FRAME_CHARS])
                        if not frames.put(frame):
                            raise ReaderGone(f"the reader of an exec in {sandbox_id} went away")

                return put

            result = ch.exec_stream(
                sandbox_id,
                req.argv,
                env=req.env,
                cwd=req.cwd,
                stdin=req.stdin,
                timeout=req.timeout,
                on_stdout=output("stdout"),
                on_stderr=output("stderr"),
                stop=frames.abandoned,
            )
            for name, decoder in decoders:
                if rest := decoder.decode(b"", final=True):
                    frames.put(output_frame(name, rest))
            frames.put(ExecFrame(result=guest_answer(asdict(result), ExecResult, "exec")))

        return produced(f"forkd-exec-{sandbox_id}", run, STREAM_QUEUE)

    def eval(self, sandbox_id: str, req: EvalRequest) -> EvalResult:
        reply = asked(sandbox_id, "eval", _code_args(req.code, req.timeout),
                      host_wait(req.timeout))
        return guest_answer(reply, EvalResult, "eval")

    def run_code(self, sandbox_id: str, req: RunCodeRequest) -> RunCodeResult:
        reply = asked(sandbox_id, "run_code", _code_args(req.code, req.timeout),
                      host_wait(req.timeout))
        return guest_answer(reply, RunCodeResult, "run_code")

    def process_start(self, sandbox_id: str, req: ProcessStartRequest) -> ProcessInfo:
        reply = ch.process_start(
            sandbox_id, req.argv, env=req.env, cwd=req.cwd, stdin=req.stdin, pty=req.pty
        )
        return guest_answer(reply, ProcessInfo, "proc_start")

    def processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return guest_answer(ch.process_list(sandbox_id), list[ProcessInfo], "proc_list")

    def process_wait(
        self, sandbox_id: str, handle: str, req: ProcessWaitRequest
    ) -> ProcessWaitResult:
        check_handle(handle)
        check_timeout("timeout", req.timeout)
        args: dict[str, Any] = {"handle": handle, "stream": False}
        if req.timeout is not None:
            args["timeout"] = req.timeout
        reply = asked(sandbox_id, "proc_wait", args, host_wait(req.timeout))
        for name in ("stdout", "stderr"):
            reply[name] = guest_b64(reply.get(name), "proc_wait").decode("utf-8", "replace")
        return guest_answer(reply, ProcessWaitResult, "proc_wait")

    def process_stdin(self, sandbox_id: str, handle: str, req: ProcessStdinRequest) -> StdinWritten:
        reply = ch.process_stdin(sandbox_id, handle, req.data or b"", close=req.close)
        return guest_answer(reply, StdinWritten, "proc_stdin")

    def process_kill(
        self, sandbox_id: str, handle: str, req: ProcessKillRequest
    ) -> ProcessSignaled:
        reply = ch.process_kill(sandbox_id, handle, req.signal)
        return guest_answer(reply, ProcessSignaled, "proc_kill")

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        ch.write_file(sandbox_id, path, data, mode)

    def read_file(self, sandbox_id: str, path: str) -> Transfer[bytes]:
        """The file's bytes in chunks (up to 1 MiB each) as the guest sends them; NotFound
        (404 in REST) before the first when the guest has no such file. The read runs in a
        thread of its own and at most FILE_QUEUE chunks wait for the caller, so a file of
        any size (up to 4 GiB) costs the daemon that much memory, not the file's size; a
        caller that stops reading ends the transfer, within a second even while no chunk
        comes (a FIFO nobody writes)."""

        def run(chunks: Handoff) -> None:
            def put(data: bytes) -> None:
                if not chunks.put(data):
                    raise ReaderGone(f"the reader of {path} in {sandbox_id} went away")

            ch.read_file_chunks(sandbox_id, path, put, stop=chunks.abandoned)

        return produced(f"forkd-read-{sandbox_id}", run, FILE_QUEUE)

    def branch(self, sandbox_id: str, req: BranchRequest) -> BranchResult:
        _refuse_private("the branch's tag", req.tag)
        return branch_child(self.store, sandbox_id, req.tag, force=req.force)
