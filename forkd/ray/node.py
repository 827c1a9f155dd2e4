"""The agent of one node: a small Ray actor pinned to its node, the one owner there of the
connection to that node's `forkd serve` (its Unix socket, never reachable from elsewhere).

It runs with the environment its node's ``ray start`` had, so ``FORKD_RUN`` (the socket),
``FORKD_HOME`` (the store) and the hub credentials are that node's. Every call arrives from
a handle (forkd.ray.sandbox) or the placement (forkd.ray.spawn); errors leave it as their
forkd family with the same message, prefixed with the node's name.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from forkd.controller.api import (
    BranchRequest,
    BranchResult,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    SandboxInfo,
)
from forkd.controller.client import TYPES, RemoteBackend, default_socket
from forkd.controller.sdk import Controller
from forkd.errors import Conflict, ForkdError, InvalidInput
from forkd.names import shown
from forkd.registry import credentials
from forkd.registry.client import RegistryClient
from forkd.registry.reference import parse_remote
from forkd.registry.transfer import TransferResult, pull, push
from forkd.store.store import Store

MAX_CALLS = 256  # calls one agent serves at once (exec, eval... each waits on its sandbox)
# Bytes of a guest file one files.read returns: the agent holds them, then Ray's object
# store and the caller; what the guest makes of a file (a sparse 4 GiB, a link to
# /dev/zero) is no reason to hold more.
MAX_READ = 32 << 20

T = TypeVar("T")


def family_of(exc: ForkdError) -> type[ForkdError]:
    """The plain error family of ``exc`` (InvalidInput, NotFound, ...; else ForkdError)."""
    return next((cls for cls in TYPES.values() if isinstance(exc, cls)), ForkdError)


def portable(name: str, exc: ForkdError) -> ForkdError:
    """``exc`` as its plain family (which pickles across Ray), the node named in front."""
    out = family_of(exc)(f"node {name}: {exc}")
    out.exit_code = exc.exit_code
    return out


def on_node(method: Callable[..., T]) -> Callable[..., T]:
    @functools.wraps(method)
    def call(self: NodeAgent, *args: Any) -> T:
        try:
            return method(self, *args)
        except ForkdError as exc:
            raise portable(self.name, exc) from None

    return call


class NodeAgent:
    """One per forkd node (detached, named ``forkd-node-<node id>`` in namespace forkd)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.socket: Path = default_socket()
        self._admit = threading.Lock()  # spawns on this node: free slots checked, then used
        self._connect = threading.Lock()
        self._ctl: Controller | None = None

    def _controller(self) -> Controller:
        """The node's daemon (made on first use: ForkdError when nobody answers there)."""
        with self._connect:
            if self._ctl is None:
                self._ctl = Controller(socket=self.socket, local=False)
            return self._ctl

    def _backend(self) -> RemoteBackend:
        backend = self._controller().backend
        assert isinstance(backend, RemoteBackend)  # Controller(local=False) is remote
        return backend

    def _free(self, slots: int) -> int:
        running = [s for s in self._backend().sandboxes() if s.status == "running"]
        return max(0, slots - len(running))

    @on_node
    def free(self, slots: int) -> int:
        """Slots not taken by a running sandbox of this node's controller (whoever made it)."""
        return self._free(slots)

    @on_node
    def spawn(
        self, tag: str, n: int, slots: int, options: dict[str, Any], remote: bool
    ) -> list[SandboxInfo]:
        """``n`` sandboxes of ``tag`` (a hub reference pulled first when ``remote``), all or
        none; Conflict when fewer than ``n`` slots are free (another spawn took them)."""
        local = self._pull(tag) if remote else tag
        with self._admit:
            free = self._free(slots)
            if free < n:
                raise Conflict(f"{n} sandboxes asked, {free} of {slots} slots free; retry")
            ctl = self._controller()
            return [sb.info for sb in ctl.spawn_sandboxes(local, n, **options)]

    def _pull(self, ref: str) -> str:
        """Pull the hub reference ``ref`` into this node's store; its local tag."""
        remote = parse_remote(ref)
        with RegistryClient(remote.hub, credentials.load(remote.hub.host)) as client:
            return pull(Store.open(), remote, client).ref

    def _push(self, tag: str, ref: str) -> TransferResult:
        """Push local ``tag`` with its chain to the hub reference ``ref``."""
        remote = parse_remote(ref)
        with RegistryClient(remote.hub, credentials.load(remote.hub.host)) as client:
            return push(Store.open(), tag, remote, client)

    @on_node
    def sandboxes(self) -> list[SandboxInfo]:
        return self._backend().sandboxes()

    @on_node
    def sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._backend().sandbox(sandbox_id)

    @on_node
    def kill(self, sandbox_id: str) -> SandboxInfo:
        return self._backend().kill(sandbox_id)

    @on_node
    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return self._backend().exec(sandbox_id, req)

    @on_node
    def eval(self, sandbox_id: str, req: EvalRequest) -> EvalResult:
        return self._backend().eval(sandbox_id, req)

    @on_node
    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int) -> None:
        self._backend().write_file(sandbox_id, path, data, mode)

    @on_node
    def read_file(self, sandbox_id: str, path: str) -> bytes:
        """The file's bytes, at most MAX_READ (InvalidInput past them, the transfer ended)."""
        data = bytearray()
        with contextlib.closing(self._backend().read_file(sandbox_id, path)) as chunks:
            for chunk in chunks:
                data += chunk
                if len(data) > MAX_READ:
                    raise InvalidInput(
                        f"{shown(path)} in sandbox {sandbox_id} is larger than {MAX_READ} "
                        "bytes, more than one read through Ray returns: read it in parts "
                        "(commands.run with `head -c`, `tail -c` or `dd`)"
                    )
        return bytes(data)

    @on_node
    def branch(self, sandbox_id: str, req: BranchRequest, push_to: str | None) -> BranchResult:
        """Branch the sandbox; with ``push_to`` (a hub reference) push the new tag there."""
        result = self._backend().branch(sandbox_id, req)
        if push_to is not None:
            try:
                self._push(result.ref, push_to)
            except ForkdError as exc:
                failed = f"branched {result.ref}, but pushing it to {push_to} failed: {exc}"
                raise family_of(exc)(failed) from None
        return result
