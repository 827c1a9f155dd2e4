"""The Python SDK: ``from forkd import Sandbox, Controller``.

``Controller()`` talks to the daemon (``forkd serve``) when one answers on its
socket (or at ``url=``), and otherwise drives the engine in this process.
``Sandbox`` is a context manager familiar to e2b users::

    with Sandbox("python-numpy") as sb:
        print(sb.commands.run("uname -r").stdout)
        print(sb.eval("import numpy; numpy.zeros(3).tolist()"))
        sb.files.write("/tmp/x.txt", "hello")
        child_tag = sb.branch("python-numpy-after")["ref"]
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from forkd.controller.backend import Backend, LocalBackend
from forkd.controller.client import RemoteBackend
from forkd.errors import ForkdError


class EvalError(ForkdError):
    """Code evaluated in the sandbox raised; ``.type``, ``.traceback`` tell what."""

    def __init__(self, error: dict[str, Any]) -> None:
        super().__init__(f"{error.get('type')}: {error.get('message')}")
        self.type = str(error.get("type"))
        self.traceback = str(error.get("traceback", ""))


@dataclass(frozen=True)
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    timed_out: bool = False


class Controller:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        socket: Path | None = None,
        local: bool | None = None,
    ) -> None:
        """Daemon at ``url`` or ``socket`` if it answers (unless ``local=True``), else local."""
        self.backend: Backend
        if local:
            self.backend = LocalBackend()
            return
        remote = RemoteBackend(url=url, token=token, socket=socket)
        if url or remote.alive():
            self.backend = remote
        elif local is False:
            raise ForkdError(f"no controller answers at {remote.where}; start `forkd serve`")
        else:
            remote.close()
            self.backend = LocalBackend()

    @property
    def remote(self) -> bool:
        return isinstance(self.backend, RemoteBackend)

    def prewarm(self, tag: str, k: int, *, wait: bool = True) -> dict[str, Any]:
        """Keep ``k`` restored-ahead VMs of ``tag`` waiting in the daemon (spawns take them)."""
        return self._daemon("prewarm").fill_pool(tag, k, wait=wait)

    def pools(self) -> list[dict[str, Any]]:
        return self._daemon("pools").pools()

    def _daemon(self, what: str) -> RemoteBackend:
        if not isinstance(self.backend, RemoteBackend):
            raise ForkdError(f"{what} needs the controller daemon: start `forkd serve`")
        return self.backend

    def spawn_sandboxes(
        self,
        tag: str,
        n: int = 1,
        *,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        prewarm: int | None = None,
        timeout: float | None = None,
        on_timeout: str = "kill",
        **limits: Any,
    ) -> list[Sandbox]:
        """Fork ``n`` sandboxes; with ``prewarm=K`` the daemon then keeps K more waiting.
        ``timeout`` (seconds): each is then killed, or paused with ``on_timeout="pause"``;
        ``limits``: ``cpus``, ``pids_max``, ``disk_bps``, ``disk_iops``, ``net_kbit``."""
        backend = self._daemon("prewarm") if prewarm is not None else self.backend
        result = backend.spawn(
            tag,
            n,
            memory_limit_mib,
            netns,
            prewarm=prewarm,
            timeout=timeout,
            on_timeout=on_timeout,
            **_limits(limits),
        )
        return [Sandbox(controller=self, sandbox_id=s["id"]) for s in result["sandboxes"]]

    def sandboxes(self) -> list[Sandbox]:
        return [Sandbox(controller=self, sandbox_id=s["id"]) for s in self.backend.sandboxes()]

    def branch_sandbox(self, sandbox_id: str, tag: str) -> dict[str, Any]:
        return self.backend.branch(sandbox_id, tag)

    def snapshots(self) -> list[dict[str, Any]]:
        return self.backend.snapshots()


LIMIT_NAMES = ("cpus", "pids_max", "disk_bps", "disk_iops", "net_kbit")


def _limits(given: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(given) - set(LIMIT_NAMES))
    if unknown:
        raise ForkdError(f"unknown limit {', '.join(unknown)}; the limits are "
                         f"{', '.join(LIMIT_NAMES)} (and memory_limit_mib)")
    return given


class Commands:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def run(
        self,
        cmd: str | list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run a command (a string goes through ``/bin/sh -c``)."""
        argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        data = stdin.encode() if isinstance(stdin, str) else stdin
        r = self._sb.controller.backend.exec(self._sb.id, argv, env, cwd, data, timeout)
        return CommandResult(
            r["stdout"], r["stderr"], int(r["exit_code"]), bool(r.get("timed_out", False))
        )


class Files:
    def __init__(self, sandbox: Sandbox) -> None:
        self._sb = sandbox

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._sb.controller.backend.write_file(self._sb.id, path, raw, mode)

    def read(self, path: str) -> bytes:
        return self._sb.controller.backend.read_file(self._sb.id, path)


class Sandbox:
    """One child VM. ``Sandbox(tag)`` forks a new one; ``sandbox_id=`` attaches to one."""

    def __init__(
        self,
        tag: str | None = None,
        *,
        controller: Controller | None = None,
        sandbox_id: str | None = None,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        timeout: float | None = None,
        on_timeout: str = "kill",
        **limits: Any,
    ) -> None:
        """``timeout`` (seconds): the sandbox is killed then, or paused with
        ``on_timeout="pause"``; ``extend()`` moves it. ``limits``: ``cpus``, ``pids_max``,
        ``disk_bps``, ``disk_iops``, ``net_kbit`` (docs/engine.md, "Limits")."""
        self.controller = controller or Controller()
        if sandbox_id is None:
            if tag is None:
                raise ForkdError("Sandbox needs a snapshot tag (or sandbox_id= to attach)")
            result = self.controller.backend.spawn(
                tag,
                1,
                memory_limit_mib,
                netns,
                timeout=timeout,
                on_timeout=on_timeout,
                **_limits(limits),
            )
            sandbox_id = str(result["sandboxes"][0]["id"])
        self.id = sandbox_id
        self.commands = Commands(self)
        self.files = Files(self)

    @property
    def info(self) -> dict[str, Any]:
        return self.controller.backend.sandbox(self.id)

    def eval(self, code: str, timeout: float = 300.0) -> Any:
        """Evaluate in the warm interpreter; returns the trailing expression's value."""
        reply = self.controller.backend.eval(self.id, code, timeout)
        if reply.get("error"):
            raise EvalError(reply["error"])
        return reply.get("value")

    def branch(self, tag: str) -> dict[str, Any]:
        return self.controller.backend.branch(self.id, tag)

    def extend(self, seconds: float) -> dict[str, Any]:
        """Move the sandbox's deadline ``seconds`` later (from now if it had none)."""
        return self.controller.backend.extend(self.id, seconds)

    def time_left(self) -> float | None:
        """Seconds until the deadline, None without one."""
        left = self.info.get("time_left_s")
        return None if left is None else float(left)

    def pause(self) -> dict[str, Any]:
        """Save memory, processes and disk into the store and free the VM."""
        return self.controller.backend.pause(self.id)

    def resume(self) -> dict[str, Any]:
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
