"""A prewarmed pool: per tag, K QEMU processes already started and waiting for the restore.

``Pool.fill(tag, k)`` starts processes with `-incoming defer` on the tag's assembled
snapshot (overlay disk copied, cgroup and netns made, QMP and the agent socket connected,
device state passed as an fd): ``children.launch_waiting``, the same code as a plain fork's
first half. By default (``restore_ahead``) each is then restored, runs one throwaway
fixup and is paused (``children.restore_ahead``). ``fork(..., pool=pool)`` takes them first
(``take``) and finishes them with ``children.become_child`` (the plain fork's second half):
``cont`` (or ``migrate-incoming`` + ``cont``) + fixup + ping; the pool then refills in a
background thread.

Each tag's pool remembers the snapshot digest it was filled for: when the tag moves (a new
build or branch with ``--force``), its waiting processes are discarded, never handed out.
Waiting processes live in ``$FORKD_RUN/children/<id>/`` with ``waiting.json`` (owner pid)
instead of ``child.json``: they are not children (``forkd ls`` does not list them) until
taken. ``close()`` kills every waiting process and removes its files; a new Pool sweeps the
leftovers of an owner that died without closing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forkd.engine import children as ch
from forkd.engine.errors import EngineError
from forkd.engine.lifecycle import CHILD_FILE, WAITING_FILE, ChildVM, Limits, new_id
from forkd.engine.paths import children_dir
from forkd.engine.qemu import create_overlay, pid_alive
from forkd.errors import InvalidInput
from forkd.jsondoc import is_integer
from forkd.names import parse_ref
from forkd.store.store import Assembled, Store

MAX_POOL = 256
LAUNCH_PARALLEL = 8  # concurrent process starts while filling (2 cores: more only thrashes)


@dataclass(frozen=True)
class PoolSpec:
    """The options a waiting process was started with; a fork takes only matching ones."""

    limits: Limits = field(default_factory=Limits)
    sandbox: bool = True
    with_netns: bool = False

    @property
    def memory_limit_mib(self) -> int | None:
        return self.limits.memory_mib


@dataclass
class _TagPool:
    ref: str
    target: int
    spec: PoolSpec
    digest: str | None = None
    waiting: list[ch.Waiting] = field(default_factory=list)
    launching: int = 0
    refilling: int = 0  # refills scheduled but not yet launching
    overlay_dir: Path | None = None
    last_error: str | None = None
    taken: int = 0
    generation: int = 0  # bumped on every re-fill/removal: stale launches discard themselves


class Pool:
    """Waiting QEMU processes per tag. Thread-safe; close() is idempotent."""

    def __init__(self, store: Store, *, restore_ahead: bool = True, sweep: bool = True) -> None:
        """restore_ahead: restore each waiting process as soon as it started, run one
        throwaway fixup in it and pause it (a take then only does cont + fixup: several times
        less guest CPU on the spawn's path under TCG); False: processes wait in
        `-incoming defer` (a take does migrate-incoming + cont + fixup)."""
        self.store = store
        self.restore_ahead = restore_ahead
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pools: dict[str, _TagPool] = {}
        self._threads: set[threading.Thread] = set()
        self._closed = False
        if sweep:
            sweep_orphans()

    # ------------------------------------------------------------------ public
    def fill(self, tag: str, k: int, *, memory_limit_mib: int | None = None,
             limits: Limits | None = None, sandbox: bool = True, with_netns: bool = False,
             wait: bool = True, timeout: float = 300.0) -> dict[str, Any]:
        """Keep k processes waiting for tag (k = 0 empties it). wait: block until they are
        started (else fill in the background). Refuses k out of range and unknown tags."""
        if not is_integer(k, 0, MAX_POOL):
            raise InvalidInput(f"prewarm must be between 0 and {MAX_POOL}, got {k!r}")
        ref = str(parse_ref(tag))
        if k == 0:
            self.remove(ref)
            return self._status_of(ref)
        limits = ch.with_memory(limits, memory_limit_mib)
        # settles netns for NIC snapshots and fails early on unknown tags, corrupt blobs or an
        # incompatible host
        asm, with_netns = ch.prepare(self.store, ref, limits=limits, with_netns=with_netns)
        spec = PoolSpec(limits, sandbox, with_netns)
        drop: list[ch.Waiting] = []
        with self._lock:
            self._check_open()
            tp = self._pools.get(ref)
            if tp is None:
                tp = self._pools[ref] = _TagPool(ref, k, spec)
            if tp.spec != spec or tp.digest != asm.digest:
                drop += tp.waiting
                tp.waiting = []
                tp.generation += 1
                tp.spec = spec
            tp.target = k
            while len(tp.waiting) > k:
                drop.append(tp.waiting.pop())
            gen = tp.generation
        self._discard_async(drop)
        self._launch(ref, asm, gen)
        if wait:
            self.wait_filled(ref, timeout)
        return self._status_of(ref)

    def take(self, ref: str, n: int, *, digest: str, limits: Limits | None = None,
             sandbox: bool = True, with_netns: bool = False) -> list[ch.Waiting]:
        """Up to n live waiting processes of ref started on this digest with these options.
        Stale ones (the tag moved since they started) are discarded, never returned."""
        ref = str(parse_ref(ref))
        spec = PoolSpec(limits or Limits(), sandbox, with_netns)
        out: list[ch.Waiting] = []
        drop: list[ch.Waiting] = []
        with self._lock:
            tp = self._pools.get(ref)
            if tp is None or self._closed:
                return []
            if tp.digest is not None and tp.digest != digest:  # the tag moved
                drop += tp.waiting
                tp.waiting = []
                tp.generation += 1
                tp.digest = None  # the next refill resolves the tag again
            if tp.spec == spec:
                while tp.waiting and len(out) < n:
                    w = tp.waiting.pop(0)
                    if w.alive() and w.info.digest == digest:
                        out.append(w)
                    else:
                        drop.append(w)
                tp.taken += len(out)
        self._discard_async(drop)
        return out

    def refill(self, ref: str) -> None:
        """Top ref's pool up to its target in a background thread (after a take)."""
        ref = str(parse_ref(ref))
        with self._lock:
            tp = self._pools.get(ref)
            if self._closed or tp is None:
                return
            tp.refilling += 1
        self._spawn_thread(self._refill, tp)

    def wait_filled(self, ref: str, timeout: float = 300.0) -> None:
        """Block until nothing is launching for ref (its pool is full or a launch failed)."""
        ref = str(parse_ref(ref))
        deadline = time.monotonic() + timeout
        with self._idle:
            while True:
                tp = self._pools.get(ref)
                if tp is None or (tp.launching == 0 and tp.refilling == 0):
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineError(f"pool {ref}: {tp.launching} processes still starting "
                                      f"after {timeout:.0f} s")
                self._idle.wait(left)

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            refs = sorted(self._pools)
        return [self._status_of(r) for r in refs]

    def remove(self, tag: str) -> bool:
        """Empty and forget tag's pool: its waiting processes are killed. False if none."""
        ref = str(parse_ref(tag))
        with self._lock:
            tp = self._pools.pop(ref, None)
            if tp is None:
                return False
            tp.generation += 1
            drop, tp.waiting = tp.waiting, []
        self._discard(drop)
        deadline = time.monotonic() + 120
        with self._idle:  # launches in flight see the pool gone and discard themselves
            while tp.launching > 0 and time.monotonic() < deadline:
                self._idle.wait(max(0.01, deadline - time.monotonic()))
        if tp.overlay_dir is not None:
            shutil.rmtree(tp.overlay_dir, ignore_errors=True)
        return True

    def close(self, timeout: float = 120.0) -> None:
        """Kill every waiting process and remove its files; wait for launches in flight
        (they discard themselves). Idempotent."""
        with self._lock:
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
            drop = [w for tp in pools for w in tp.waiting]
            for tp in pools:
                tp.waiting = []
                tp.generation += 1
        self._discard(drop)
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._threads)
            if not threads:
                break
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() > deadline:
                break
        for tp in pools:
            if tp.overlay_dir is not None:
                shutil.rmtree(tp.overlay_dir, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ----------------------------------------------------------------- internal
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError("the pool is closed")

    def _status_of(self, ref: str) -> dict[str, Any]:
        with self._lock:
            tp = self._pools.get(ref)
            if tp is None:
                return {"tag": ref, "target": 0, "waiting": 0, "starting": 0, "digest": None,
                        "memory_limit_mib": None, "limits": {}, "sandbox": True,
                        "netns": False, "taken": 0, "last_error": None}
            dead = [w for w in tp.waiting if not w.alive()]
            tp.waiting = [w for w in tp.waiting if w not in dead]
            out = {"tag": ref, "target": tp.target, "waiting": len(tp.waiting),
                   "starting": tp.launching, "digest": tp.digest,
                   "memory_limit_mib": tp.spec.memory_limit_mib,
                   "limits": tp.spec.limits.shown(), "sandbox": tp.spec.sandbox,
                   "netns": tp.spec.with_netns, "taken": tp.taken, "last_error": tp.last_error}
        self._discard(dead)
        return out

    def _refill(self, tp: _TagPool) -> None:
        try:
            self._refill_one(tp)
        finally:
            with self._idle:
                tp.refilling -= 1
                self._idle.notify_all()

    def _refill_one(self, tp: _TagPool) -> None:
        ref = tp.ref
        with self._lock:
            if self._stale(tp, tp.generation):
                return
            spec = tp.spec
        try:
            asm, _ = ch.prepare(self.store, ref, limits=spec.limits, with_netns=spec.with_netns)
        except Exception as e:  # the tag was removed, or the host changed: record, stop
            with self._lock:
                tp.last_error = str(e)
            return
        drop: list[ch.Waiting] = []
        with self._lock:
            if tp.digest != asm.digest:
                drop, tp.waiting = tp.waiting, []
                tp.generation += 1
            gen = tp.generation
        self._discard(drop)
        self._launch(ref, asm, gen)

    def _launch(self, ref: str, asm: Assembled, gen: int) -> None:
        """Start the missing processes of ref's pool (in background threads)."""
        with self._lock:
            tp = self._pools.get(ref)
            if tp is None or self._closed or tp.generation != gen:
                return
            if tp.digest != asm.digest or tp.overlay_dir is None:
                if tp.overlay_dir is not None:
                    shutil.rmtree(tp.overlay_dir, ignore_errors=True)
                tp.overlay_dir = None
                tp.digest = asm.digest
            missing = tp.target - len(tp.waiting) - tp.launching
            if missing <= 0:
                return
            tp.launching += missing
            if tp.overlay_dir is None:
                tp.overlay_dir = children_dir() / f".pool-{secrets.token_hex(4)}"
                tp.overlay_dir.mkdir()
                (tp.overlay_dir / "owner").write_text(str(os.getpid()))
                overlay_dir = tp.overlay_dir
                make_overlay = True
            else:
                overlay_dir = tp.overlay_dir
                make_overlay = False
            spec = tp.spec
        overlay = overlay_dir / "empty.qcow2"
        try:
            if make_overlay:
                assert asm.disk is not None
                create_overlay(overlay, asm.disk, "raw")
        except Exception as e:
            with self._idle:
                tp.launching -= missing
                tp.last_error = str(e)
                self._idle.notify_all()
            return
        sem = threading.Semaphore(LAUNCH_PARALLEL)

        def one() -> None:
            w: ch.Waiting | None = None
            try:
                with sem:
                    if self._stale(tp, gen):
                        return
                    w = ch.launch_waiting(asm, ref, new_id(ref), overlay, spec.limits,
                                          spec.sandbox, spec.with_netns, pooled=True)
                    if self.restore_ahead:
                        try:
                            ch.restore_ahead(w)  # discards it on failure
                        except BaseException:
                            w = None
                            raise
            except Exception as e:
                with self._lock:
                    tp.last_error = str(e)
            finally:
                with self._idle:
                    tp.launching -= 1
                    keep = w is not None and not self._stale(tp, gen)
                    if keep and w is not None:
                        tp.waiting.append(w)
                    self._idle.notify_all()
                if w is not None and not keep:
                    w.discard()

        for _ in range(missing):
            self._spawn_thread(one)

    def _stale(self, tp: _TagPool, gen: int) -> bool:
        return (self._closed or tp.generation != gen
                or self._pools.get(tp.ref) is not tp)

    def _spawn_thread(self, fn: Any, *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            finally:
                with self._lock:
                    self._threads.discard(threading.current_thread())

        t = threading.Thread(target=run, name="forkd-pool", daemon=True)
        with self._lock:
            self._threads.add(t)
        t.start()

    def _discard(self, ws: list[ch.Waiting]) -> None:
        if not ws:
            return
        threads = [threading.Thread(target=w.discard) for w in ws]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _discard_async(self, ws: list[ch.Waiting]) -> None:
        if ws:
            self._spawn_thread(self._discard, ws)


def sweep_orphans() -> list[str]:
    """Remove waiting processes whose owner (the process that filled a pool) is gone, and
    overlay dirs of pools nobody owns any more. Returns the ids removed."""
    removed: list[str] = []
    for d in children_dir().iterdir():
        if d.name.startswith(".pool-"):
            with contextlib.suppress(OSError, ValueError):
                if not pid_alive(int((d / "owner").read_text())):
                    shutil.rmtree(d, ignore_errors=True)
            continue
        if not (d / WAITING_FILE).is_file() or (d / CHILD_FILE).exists():
            continue
        try:
            w = ChildVM.adopt(d, WAITING_FILE)
        except (OSError, ValueError, KeyError, TypeError, EngineError):
            continue
        if w.owner is not None and pid_alive(w.owner):
            continue
        with contextlib.suppress(EngineError):
            w.cleanup()
        removed.append(d.name)
    return removed
