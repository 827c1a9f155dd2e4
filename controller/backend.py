"""What a controller can do, and the local implementation (the engine and store in-process).

The daemon serves ``LocalBackend`` over REST; the SDK and the CLI use either
``LocalBackend`` directly or ``RemoteBackend`` (forkd.controller.client) when a
daemon runs. Both speak the same plain shapes (dicts of JSON types), so the
REST API is these methods and nothing more.
"""

from __future__ import annotations

import base64
import threading
from dataclasses import asdict
from typing import Any, Protocol

from forkd.engine import children as ch
from forkd.engine import lifetimes, watchdog
from forkd.engine.branch import branch as branch_child
from forkd.engine.lifecycle import ChildInfo, Lifetime, Limits
from forkd.engine.pause import pause as pause_child
from forkd.engine.pause import resume as resume_child
from forkd.engine.pool import MAX_POOL, Pool
from forkd.errors import InvalidInput, NotFound
from forkd.store.store import Store

SWEEP_INTERVAL_S = 1.0  # the daemon's sweeper acts on passed deadlines within this


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
        prewarm: int | None = None,
        *,
        timeout: float | None = None,
        on_timeout: str = "kill",
        cpus: float | None = None,
        pids_max: int | None = None,
        disk_bps: int | None = None,
        disk_iops: int | None = None,
        net_kbit: int | None = None,
    ) -> dict[str, Any]: ...
    def sandboxes(self) -> list[dict[str, Any]]: ...
    def extend(self, sandbox_id: str, seconds: float) -> dict[str, Any]: ...
    def pause(self, sandbox_id: str) -> dict[str, Any]: ...
    def resume(self, sandbox_id: str) -> dict[str, Any]: ...
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


class PoolBackend(Backend, Protocol):
    """What the daemon serves on top of Backend: spawns that (re)fill a prewarmed pool, and
    the pools themselves (docs/api.md). Only a long-running process can keep a pool."""

    def pools(self) -> list[dict[str, Any]]: ...
    def fill_pool(
        self,
        tag: str,
        k: int,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
        wait: bool = False,
    ) -> dict[str, Any]: ...
    def remove_pool(self, tag: str) -> dict[str, Any]: ...


def sandbox_view(info: ChildInfo) -> dict[str, Any]:
    view = asdict(info)
    view["status"] = info.state() if info.status == "running" else info.status
    view["time_left_s"] = lifetimes.time_left(info)
    return view


class LocalBackend:
    """The engine and the store in this process."""

    def __init__(
        self, store: Store | None = None, pool: Pool | None = None, *, sweeper: bool = False
    ) -> None:
        """pool: prewarmed processes per tag (the daemon has one; in-process use does not).
        sweeper: enforce sandbox deadlines in a thread of this process (the daemon does);
        without it a deadline set here starts the engine's watchdog (engine/watchdog.py)."""
        self.store = store or Store.open()
        self.pool = pool
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
        prewarm: int | None = None,
        *,
        timeout: float | None = None,
        on_timeout: str = "kill",
        cpus: float | None = None,
        pids_max: int | None = None,
        disk_bps: int | None = None,
        disk_iops: int | None = None,
        net_kbit: int | None = None,
    ) -> dict[str, Any]:
        """prewarm=K: after serving, fill (or refill) the tag's pool to K in the background.
        timeout: seconds until each sandbox is killed or paused (on_timeout); cpus, pids_max,
        disk_bps, disk_iops, net_kbit: limits (docs/engine.md, "Limits")."""
        if prewarm is not None:
            self._check_prewarm(prewarm)
        limits = Limits(memory_limit_mib, cpus, pids_max, disk_bps, disk_iops, net_kbit)
        lifetime = Lifetime(timeout, on_timeout)
        result = ch.fork(
            self.store,
            tag,
            n,
            limits=limits,
            lifetime=lifetime,
            with_netns=netns,
            sandbox=sandbox,
            pool=self.pool,
        )
        if timeout is not None:
            self._deadlines_changed()
        if prewarm is not None and self.pool is not None:
            self.pool.fill(tag, prewarm, limits=limits, sandbox=sandbox, with_netns=netns,
                           wait=False)
        return {
            "sandboxes": [sandbox_view(c) for c in result.children],
            "assemble_ms": round(result.assemble_ms, 1),
            "total_ms": round(result.total_ms, 1),
            "errors": result.errors,
        }

    def sandboxes(self) -> list[dict[str, Any]]:
        return [sandbox_view(c) for c in ch.list_children()]

    def _check_prewarm(self, k: int) -> Pool:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_POOL:
            raise InvalidInput(f"prewarm must be between 0 and {MAX_POOL}, got {k!r}")
        if self.pool is None:
            raise InvalidInput(
                "prewarm needs a long-running controller: start `forkd serve` "
                "(an in-process engine exits with its command)"
            )
        return self.pool

    def pools(self) -> list[dict[str, Any]]:
        return self.pool.status() if self.pool is not None else []

    def fill_pool(
        self,
        tag: str,
        k: int,
        memory_limit_mib: int | None = None,
        netns: bool = False,
        sandbox: bool = True,
        wait: bool = False,
    ) -> dict[str, Any]:
        pool = self._check_prewarm(k)
        return pool.fill(
            tag, k, memory_limit_mib=memory_limit_mib, sandbox=sandbox, with_netns=netns, wait=wait
        )

    def remove_pool(self, tag: str) -> dict[str, Any]:
        if self.pool is None or not self.pool.remove(tag):
            raise NotFound(f"no prewarmed pool for {tag}; GET /v1/pools lists them")
        return {"tag": tag, "removed": True}

    def sandbox(self, sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(ch.get(sandbox_id))

    def kill(self, sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(ch.kill(sandbox_id, self.store))

    def extend(self, sandbox_id: str, seconds: float) -> dict[str, Any]:
        info = lifetimes.extend(sandbox_id, seconds)
        self._deadlines_changed()
        return sandbox_view(info)

    def pause(self, sandbox_id: str) -> dict[str, Any]:
        return sandbox_view(pause_child(self.store, sandbox_id))

    def resume(self, sandbox_id: str) -> dict[str, Any]:
        info = resume_child(self.store, sandbox_id)
        if info.deadline is not None:
            self._deadlines_changed()
        return sandbox_view(info)

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
