"""What a controller can do, and the local implementation (the engine and store in-process).

The daemon serves ``LocalBackend`` over REST; the SDK and the CLI use either
``LocalBackend`` directly or ``RemoteBackend`` (forkd.controller.client) when a
daemon runs. Both speak the same plain shapes (dicts of JSON types), so the
REST API is these methods and nothing more.
"""

from __future__ import annotations

import base64
from dataclasses import asdict
from typing import Any, Protocol

from forkd.engine import children as ch
from forkd.engine.branch import branch as branch_child
from forkd.errors import InvalidInput
from forkd.store.store import Store


class Backend(Protocol):
    def snapshots(self) -> list[dict[str, Any]]: ...
    def snapshot(self, ref: str) -> dict[str, Any]: ...
    def delete_snapshot(self, ref: str, cascade: bool = False) -> list[str]: ...
    def compact(self, ref: str, to: str) -> dict[str, Any]: ...
    def spawn(
        self,
        tag: str,
        n: int = 1,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
    ) -> dict[str, Any]: ...
    def sandboxes(self) -> list[dict[str, Any]]: ...
    def sandbox(self, sandbox_id: str) -> dict[str, Any]: ...
    def kill(self, sandbox_id: str) -> dict[str, Any]: ...
    def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]: ...
    def eval(self, sandbox_id: str, code: str, timeout: float = 300.0) -> dict[str, Any]: ...
    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None: ...
    def read_file(self, sandbox_id: str, path: str) -> bytes: ...
    def branch(self, sandbox_id: str, tag: str, force: bool = False) -> dict[str, Any]: ...


def sandbox_view(info: ch.ChildInfo) -> dict[str, Any]:
    view = asdict(info)
    view["status"] = info.state() if info.status == "running" else info.status
    return view


class LocalBackend:
    """The engine and the store in this process."""

    def __init__(self, store: Store | None = None) -> None:
        self.store = store or Store.open()

    def snapshots(self) -> list[dict[str, Any]]:
        return [asdict(info) for info in self.store.images()]

    def snapshot(self, ref: str) -> dict[str, Any]:
        return self.store.inspect(ref)

    def delete_snapshot(self, ref: str, cascade: bool = False) -> list[str]:
        return self.store.remove(ref, cascade=cascade)

    def compact(self, ref: str, to: str) -> dict[str, Any]:
        return asdict(self.store.compact(ref, to))

    def spawn(
        self,
        tag: str,
        n: int = 1,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
    ) -> dict[str, Any]:
        result = ch.fork(
            self.store, tag, n, memory_limit_mib=memory_limit_mib, with_netns=netns, sandbox=sandbox
        )
        return {
            "sandboxes": [sandbox_view(c) for c in result.children],
            "assemble_ms": round(result.assemble_ms, 1),
            "total_ms": round(result.total_ms, 1),
            "errors": result.errors,
        }

    def sandboxes(self) -> list[dict[str, Any]]:
        return [sandbox_view(c) for c in ch.list_children()]

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(ch.get(sandbox_id))

    def kill(self, sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(ch.kill(sandbox_id))

    def exec(
        self,
        sandbox_id: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        return ch.exec_in(sandbox_id, argv, timeout=timeout, stdin=stdin, env=env, cwd=cwd)

    def eval(self, sandbox_id: str, code: str, timeout: float = 300.0) -> dict[str, Any]:
        return ch.eval_in(sandbox_id, code, timeout=timeout)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        if not path.startswith("/"):
            raise InvalidInput(f"guest path {path!r} must be absolute")
        with ch.agent(sandbox_id) as agent:
            agent.put(path, data, mode)

    def read_file(self, sandbox_id: str, path: str) -> bytes:
        if not path.startswith("/"):
            raise InvalidInput(f"guest path {path!r} must be absolute")
        with ch.agent(sandbox_id) as agent:
            return agent.get(path)

    def branch(self, sandbox_id: str, tag: str, force: bool = False) -> dict[str, Any]:
        return asdict(branch_child(self.store, sandbox_id, tag, force=force))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError as exc:
        raise InvalidInput(f"{what} is not valid base64") from exc
