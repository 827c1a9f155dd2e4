"""The Python SDK: ``from forkd import Sandbox, Controller``.

``Controller()`` talks to the daemon (``forkd serve``) when one answers on its
socket (or at ``url=``), and otherwise drives the engine in this process.
``Sandbox`` is a context manager familiar to e2b users::

    with Sandbox("python-numpy") as sb:
        print(sb.commands.run("uname -r").stdout)
        print(sb.eval("import numpy; numpy.zeros(3).tolist()"))
        sb.files.write("/tmp/x.txt", "hello")
        child_tag = sb.branch("python-numpy-after").ref

Requests and answers are the types of forkd.controller.api (the REST API's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, overload

from forkd.controller.api import (
    EVAL_TIMEOUT_S,
    BranchRequest,
    BranchResult,
    EvalRequest,
    ExecRequest,
    ExecResult,
    ExtendRequest,
    LayerInfo,
    PoolRequest,
    PoolStatus,
    ProcessInfo,
    ProcessKillRequest,
    ProcessStartRequest,
    ProcessStdinRequest,
    ProcessWaitRequest,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SpawnRequest,
)
from forkd.controller.backend import MAX_SANDBOXES, Backend, LocalBackend, Transfer
from forkd.controller.client import RemoteBackend
from forkd.errors import ForkdError, InvalidInput

Output = Callable[[str], object]  # a streaming callback: called with each piece of output
Cmd = str | list[str]  # a string runs through /bin/sh -c, a list is the argv


def command_argv(cmd: Cmd) -> list[str]:
    """The argv of a command: a string runs through ``/bin/sh -c``, a list is the argv."""
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)


def stdin_bytes(stdin: bytes | str | None) -> bytes | None:
    """A command's stdin as bytes (a string is UTF-8)."""
    return stdin.encode() if isinstance(stdin, str) else stdin


class EvalError(ForkdError):
    """Code evaluated in the sandbox raised; ``.type``, ``.traceback`` tell what."""

    def __init__(self, error: Any) -> None:
        super().__init__(f"{error.type}: {error.message}")
        self.type = str(error.type)
        self.traceback = str(error.traceback)


class SpawnError(ForkdError):
    """Some of the sandboxes asked for did not start (``.errors``: one line each). The ones
    that did were killed: a spawn gives all it was asked for or none."""

    def __init__(self, asked: int, errors: list[str]) -> None:
        lines = "\n".join(errors[:5])
        super().__init__(f"{len(errors)} of {asked} sandboxes did not start:\n{lines}")
        self.errors = errors


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False
    duration: float | None = None  # seconds the command ran in the guest
    status: str = "exited"  # exited, signaled, killed, timed_out or oom_killed

    @classmethod
    def of(cls, r: ExecResult) -> CommandResult:
        return cls(r.stdout, r.stderr, r.exit_code, r.timed_out, r.duration, r.status)


def spawn_request(tag: str, n: int, options: dict[str, Any]) -> SpawnRequest:
    """A SpawnRequest from keyword options: any field of api.SpawnRequest."""
    try:
        return SpawnRequest(tag=tag, n=n, **options)
    except TypeError as exc:
        known = ", ".join(f for f in SpawnRequest.__struct_fields__ if f not in ("tag", "n"))
        raise InvalidInput(f"{exc}; the spawn options are {known}") from None


class Controller:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        socket: Path | None = None,
        local: bool | None = None,
        plain_http: bool = False,
    ) -> None:
        """Daemon at ``url`` or ``socket`` if it answers (unless ``local=True``), else local.
        plain_http: send the token over ``http://`` to another host than this one (the
        token is refused there otherwise: client.check_plain_http)."""
        self.backend: Backend
        if local:
            self.backend = LocalBackend(max_sandboxes=MAX_SANDBOXES)
            return
        remote = RemoteBackend(url=url, token=token, socket=socket, plain_http=plain_http)
        if url or remote.alive():
            self.backend = remote
        elif local is False:
            raise ForkdError(f"no controller answers at {remote.where}; start `forkd serve`")
        else:
            remote.close()
            self.backend = LocalBackend(max_sandboxes=MAX_SANDBOXES)

    @property
    def remote(self) -> bool:
        return isinstance(self.backend, RemoteBackend)

    def prewarm(self, tag: str, k: int, *, wait: bool = True) -> PoolStatus:
        """Keep ``k`` restored-ahead VMs of ``tag`` waiting in the daemon (spawns take them)."""
        return self._daemon("prewarm").fill_pool(PoolRequest(tag=tag, k=k, wait=wait))

    def pools(self) -> list[PoolStatus]:
        return self._daemon("pools").pools()

    def _daemon(self, what: str) -> RemoteBackend:
        if not isinstance(self.backend, RemoteBackend):
            raise ForkdError(f"{what} needs the controller daemon: start `forkd serve`")
        return self.backend

    def spawn_sandboxes(self, tag: str, n: int = 1, **options: Any) -> list[Sandbox]:
        """Fork ``n`` sandboxes of ``tag``; all of them or SpawnError (the ones that started
        are then killed). ``options``: the fields of api.SpawnRequest (docs/api.md):
        ``memory_limit_mib``, ``netns``, ``timeout`` (s) and ``on_timeout`` ("kill" or
        "pause"), ``cpus``, ``pids_max``, ``disk_bps``, ``disk_iops``, ``net_kbit``;
        ``prewarm=K`` (daemon only) then keeps K more waiting."""
        req = spawn_request(tag, n, options)
        backend = self._daemon("prewarm") if req.prewarm is not None else self.backend
        result = backend.spawn(req)
        started = [Sandbox(controller=self, sandbox_id=s.id) for s in result.sandboxes]
        if result.errors or len(started) != n:
            for sb in started:
                with contextlib.suppress(ForkdError):
                    sb.kill()
            raise SpawnError(n, result.errors or [f"{n - len(started)} missing, no error given"])
        return started

    def sandboxes(self) -> list[Sandbox]:
        return [Sandbox(controller=self, sandbox_id=s.id) for s in self.backend.sandboxes()]

    def branch_sandbox(self, sandbox_id: str, tag: str, *, force: bool = False) -> BranchResult:
        """Save the sandbox as a diff layer tagged ``tag``; ``force`` replaces that tag."""
        return self.backend.branch(sandbox_id, BranchRequest(tag=tag, force=force))

    def snapshots(self) -> list[LayerInfo]:
        return self.backend.snapshots()


class CommandHandle:
    """A background command (``commands.run(..., background=True)``) in its own process
    group: wait for it, write to its stdin, signal it."""

    def __init__(self, sandbox: Sandbox, info: ProcessInfo) -> None:
        self._sb = sandbox
        self.handle = info.handle
        self.pid = info.pid
        self.argv = info.argv

    def wait(self, timeout: float | None = None) -> CommandResult | None:
        """Its result once it ends (then the handle is forgotten: NotFound afterwards);
        None if it still runs after ``timeout`` seconds (None: wait until it ends)."""
        r = self._sb.controller.backend.process_wait(
            self._sb.id, self.handle, ProcessWaitRequest(timeout=timeout)
        )
        if r.running:
            return None
        return CommandResult(
            r.stdout, r.stderr, int(r.exit_code or 0), r.timed_out, r.duration, r.status or "exited"
        )

    def send_stdin(self, data: str | bytes, *, close: bool = False) -> None:
        """Write to its stdin; Conflict once it ended or its stdin is closed."""
        raw = data.encode() if isinstance(data, str) else data
        req = ProcessStdinRequest(data=raw, close=close)
        self._sb.controller.backend.process_stdin(self._sb.id, self.handle, req)

    def close_stdin(self) -> None:
        req = ProcessStdinRequest(close=True)
        self._sb.controller.backend.process_stdin(self._sb.id, self.handle, req)

    def kill(self, signal: int | str = "SIGKILL") -> None:
        """Signal its whole process group; Conflict when it has ended."""
        req = ProcessKillRequest(signal=signal)
        self._sb.controller.backend.process_kill(self._sb.id, self.handle, req)

    def __repr__(self) -> str:
        return f"CommandHandle({self.handle!r}, pid={self.pid})"


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def start(
        self,
        cmd: Cmd,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        pty: bool = False,
    ) -> CommandHandle:
        """Start a command in the background (``commands.run(..., background=True)``)."""
        req = ProcessStartRequest(argv=command_argv(cmd), env=env, cwd=cwd,
                                  stdin=stdin_bytes(stdin), pty=pty)
        return CommandHandle(self._sb, self._sb.controller.backend.process_start(self._sb.id, req))

    def list(self) -> list[ProcessInfo]:
        """The background commands: running, or ended and not waited for yet."""
        return self._sb.controller.backend.processes(self._sb.id)

    @overload
    def run(
        self,
        cmd: Cmd,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        on_stdout: Output | None = None,
        on_stderr: Output | None = None,
        background: Literal[False] = False,
    ) -> CommandResult: ...

    @overload
    def run(
        self,
        cmd: Cmd,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        on_stdout: Output | None = None,
        on_stderr: Output | None = None,
        background: Literal[True],
    ) -> CommandHandle: ...

    def run(
        self,
        cmd: Cmd,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
        on_stdout: Output | None = None,
        on_stderr: Output | None = None,
        background: bool = False,
    ) -> CommandResult | CommandHandle:
        """Run a command (a string goes through ``/bin/sh -c``); never raises for a non-zero
        exit. ``timeout`` (s): the command (its whole process group) is killed then; none:
        it may run for as long as it takes (no client deadline is shorter).
        ``on_stdout``/``on_stderr``: called with the output as the sandbox sends it (the
        result's stdout/stderr are then empty). ``background=True``: start it and return a
        CommandHandle at once (``commands.start``)."""
        if background:
            if timeout is not None or on_stdout is not None or on_stderr is not None:
                raise InvalidInput(
                    "a background command takes no timeout or callbacks: "
                    "give them to its handle's wait() or kill() it"
                )
            return self.start(cmd, env=env, cwd=cwd, stdin=stdin)
        req = ExecRequest(argv=command_argv(cmd), env=env, cwd=cwd, stdin=stdin_bytes(stdin),
                          timeout=timeout)
        backend = self._sb.controller.backend
        if on_stdout is None and on_stderr is None:
            return CommandResult.of(backend.exec(self._sb.id, req))
        # closed however this ends (a callback that raises too): the command is killed
        with contextlib.closing(backend.exec_stream(self._sb.id, req)) as frames:
            for frame in frames:
                if frame.stdout and on_stdout is not None:
                    on_stdout(frame.stdout)
                if frame.stderr and on_stderr is not None:
                    on_stderr(frame.stderr)
                if frame.result is not None:
                    return CommandResult.of(frame.result)
        raise ForkdError(f"sandbox {self._sb.id}: the command's stream ended without a result")


class Files:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._sb.controller.backend.write_file(self._sb.id, path, raw, mode)

    def read(self, path: str) -> bytes:
        """The file's bytes; forkd.errors.NotFound when there is no such file."""
        return b"".join(self.stream(path))

    def stream(self, path: str) -> Generator[bytes, None, None]:
        """The file's bytes in chunks (up to 1 MiB) as they arrive, for a file too large
        to hold whole; forkd.errors.NotFound at the first when there is no such file.
        Closing the generator early ends the transfer."""
        with contextlib.closing(self.transfer(path)) as chunks:
            yield from chunks

    def transfer(self, path: str) -> Transfer[bytes]:
        """``stream``'s chunks as a Transfer: close it when done (``contextlib.closing``);
        its ``abandon`` ends the transfer from another thread, also while a read waits for
        a chunk that never comes (a FIFO nobody writes)."""
        return self._sb.controller.backend.read_file(self._sb.id, path)


class Sandbox:
    """One child VM. ``Sandbox(tag)`` forks a new one; ``sandbox_id=`` attaches to one."""

    def __init__(
        self,
        tag: str | None = None,
        *,
        controller: Controller | None = None,
        sandbox_id: str | None = None,
        **options: Any,
    ) -> None:
        """``options``: the fields of api.SpawnRequest, e.g. ``timeout`` (seconds: the
        sandbox is killed then, or paused with ``on_timeout="pause"``; ``extend()`` moves
        it), ``memory_limit_mib``, ``netns``, ``cpus``, ``pids_max``, ``disk_bps``,
        ``disk_iops``, ``net_kbit`` (docs/engine.md, "Limits"); ``lazy=True`` with a hub
        reference ``HUB/NS/NAME[:TAG]`` forks before its pack is here (docs/engine.md, "Lazy
        fork")."""
        self.controller = controller or Controller()
        if sandbox_id is None:
            if tag is None:
                raise ForkdError("Sandbox needs a snapshot tag (or sandbox_id= to attach)")
            result = self.controller.backend.spawn(spawn_request(tag, 1, options))
            if not result.sandboxes:
                raise SpawnError(1, result.errors)
            sandbox_id = result.sandboxes[0].id
        elif options:
            raise InvalidInput(f"spawn options {sorted(options)} need a tag, not sandbox_id=")
        self.id = sandbox_id
        self.commands = Commands(self)
        self.files = Files(self)

    @property
    def info(self) -> SandboxInfo:
        return self.controller.backend.sandbox(self.id)

    def eval(self, code: str, timeout: float = EVAL_TIMEOUT_S) -> Any:
        """Evaluate in the warm interpreter; returns the trailing expression's value."""
        reply = self.controller.backend.eval(self.id, EvalRequest(code=code, timeout=timeout))
        if reply.error is not None:
            raise EvalError(reply.error)
        return reply.value

    def run_code(self, code: str, timeout: float | None = EVAL_TIMEOUT_S) -> RunCodeResult:
        """A code-interpreter cell: ``results`` (matplotlib figures as PNG, DataFrames as
        HTML and text, the last expression as ``is_main_result``), ``stdout``, ``stderr``,
        ``error`` (type, message, traceback; not raised), ``value``."""
        req = RunCodeRequest(code=code, timeout=timeout)
        return self.controller.backend.run_code(self.id, req)

    def branch(self, tag: str, *, force: bool = False) -> BranchResult:
        """Save this sandbox as a diff layer tagged ``tag``; ``force`` replaces that tag."""
        return self.controller.branch_sandbox(self.id, tag, force=force)

    def extend(self, seconds: float) -> SandboxInfo:
        """Move the sandbox's deadline ``seconds`` later (from now if it had none)."""
        return self.controller.backend.extend(self.id, ExtendRequest(seconds=seconds))

    def time_left(self) -> float | None:
        """Seconds until the deadline, None without one."""
        return self.info.time_left_s

    def pause(self) -> SandboxInfo:
        """Save memory, processes and disk into the store and free the VM."""
        return self.controller.backend.pause(self.id)

    def resume(self) -> SandboxInfo:
        """Bring a paused sandbox back under the same id, as it was."""
        return self.controller.backend.resume(self.id)

    def kill(self) -> None:
        self.controller.backend.kill(self.id)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()

    def __repr__(self) -> str:
        return f"Sandbox({self.id!r})"
