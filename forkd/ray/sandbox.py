"""``RaySandbox``: a handle to a sandbox on some node of the Ray cluster, usable from any
Ray task or actor on any node (and picklable: it is its node's id and name and the
sandbox's id). Every call goes through the node's agent (forkd.ray.node), the only one
that reaches that node's `forkd serve`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from forkd.controller.api import (
    EVAL_TIMEOUT_S,
    BranchRequest,
    BranchResult,
    EvalRequest,
    EvalResult,
    ExecRequest,
    ExecResult,
    SandboxInfo,
)
from forkd.controller.sdk import Cmd, CommandResult, EvalError, command_argv, stdin_bytes
from forkd.ray import cluster


@dataclass(frozen=True)
class RaySandbox:
    id: str
    node: str  # the node's name (its forkd_node:NAME marker, else its Ray node id)
    node_id: str  # its Ray node id

    def _call(self, method: str, *args: Any) -> Any:
        return cluster.call(self.node_id, self.node, method, self.id, *args)

    @property
    def commands(self) -> RayCommands:
        return RayCommands(self)

    @property
    def files(self) -> RayFiles:
        return RayFiles(self)

    @property
    def info(self) -> SandboxInfo:
        info: SandboxInfo = self._call("sandbox")
        return info

    def eval(self, code: str, timeout: float = EVAL_TIMEOUT_S) -> Any:
        """Evaluate in the warm interpreter; the trailing expression's value (EvalError)."""
        reply: EvalResult = self._call("eval", EvalRequest(code=code, timeout=timeout))
        if reply.error is not None:
            raise EvalError(reply.error)
        return reply.value

    def branch(self, tag: str, *, force: bool = False, push: str | None = None) -> BranchResult:
        """Save this sandbox as a diff layer tagged ``tag`` in its node's store; with
        ``push`` (a hub reference, ``HUB/NS/NAME:TAG``) also push it there, with the node's
        hub credentials, so that any node can fork it (``spawn(push, n, pull=True)``)."""
        result: BranchResult = self._call("branch", BranchRequest(tag=tag, force=force), push)
        return result

    def kill(self) -> None:
        self._call("kill")

    def __enter__(self) -> RaySandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


@dataclass(frozen=True)
class RayCommands:
    _sb: RaySandbox

    def run(
        self,
        cmd: Cmd,
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | str | None = None,
        timeout: float | None = None,
    ) -> CommandResult:
        """Run a command (a string goes through ``/bin/sh -c``); never raises for a non-zero
        exit. ``timeout`` (s): its process group is killed then; none: no deadline."""
        req = ExecRequest(argv=command_argv(cmd), env=env, cwd=cwd, stdin=stdin_bytes(stdin),
                          timeout=timeout)
        result: ExecResult = self._sb._call("exec", req)
        return CommandResult.of(result)


@dataclass(frozen=True)
class RayFiles:
    _sb: RaySandbox

    def write(self, path: str, data: str | bytes, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._sb._call("write_file", path, raw, mode)

    def read(self, path: str) -> bytes:
        """The file's bytes; forkd.errors.NotFound when there is no such file."""
        data: bytes = self._sb._call("read_file", path)
        return data
