"""`forkd build`: boot a template from a recipe, warm it, snapshot it into the store."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from forkd import digest
from forkd.engine import image, netns
from forkd.engine.accel import cached_probe
from forkd.engine.agent_client import PROTOCOL, AgentClient
from forkd.engine.errors import AgentError, GuestBuildError, HostError, VMMError
from forkd.engine.paths import cache_dir, work_dir
from forkd.engine.phases import done, phase
from forkd.engine.qemu import (
    CPU_MODEL,
    MACHINE,
    QEMU_IMG,
    QemuVM,
    VMConfig,
    create_overlay,
    kernel_cmdline,
    qemu_version,
)
from forkd.engine.recipe import Recipe
from forkd.errors import ForkdError
from forkd.names import parse_ref
from forkd.pack.chunking import ZSTD_LEVEL_FLAT, Precompressed
from forkd.pack.config import Compat
from forkd.store.store import Store

Progress = Callable[[str], None]
BOOT_TIMEOUT = 180.0
# Bumped whenever the steps that turn a guest image into a snapshot change (build cache key).
SNAPSHOT_LAYOUT = "2"
# Run in the template's agent after `sync`, right before the snapshot: drop the clean page cache
# (files a child reads again come from its disk) and zero the freed pages, so the memory image
# holds what the warm guest uses and no stale copies of file data (docs/recipes.md). Pages are
# zeroed by faulting in anonymous memory (the kernel clears each page it hands out), leaving a
# margin above the watermarks so nothing in use is reclaimed.
SHRINK_MEMORY = """
def _forkd_shrink():
    import ctypes, mmap
    ctypes.CDLL(None).malloc_trim(0)  # the agent's heap returns what the warm-up freed
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1")
    with open("/proc/meminfo") as f:
        free = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemFree:"))
    with open("/proc/sys/vm/min_free_kbytes") as f:
        keep = max(8 << 20, 4 * (int(f.read()) << 10))
    left, maps = free - keep, []
    try:
        while left > 0:
            size = min(4 << 20, left)
            maps.append(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                  | mmap.MAP_POPULATE))
            left -= size
    finally:
        for m in maps:
            m.close()
    return free - max(left, 0) - keep
_forkd_zeroed = _forkd_shrink()
del _forkd_shrink
_forkd_zeroed
"""


@dataclass(frozen=True)
class BuildResult:
    ref: str
    digest: str
    cached: bool
    accel: str
    boot_s: float
    warmup_s: float
    snapshot_ms: float
    total_s: float
    stored_bytes: int


def _noop(_: str) -> None:
    pass


def scratch_dir(prefix: str) -> Path:
    """A private work directory, on tmpfs when there is one (memory files are written there)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else work_dir()
    d = base / f"{prefix}-{secrets.token_hex(4)}"
    d.mkdir(mode=0o700)
    return d


def _cache_files(store: Store, key: str) -> list[Path]:
    """Where the build record of ``key`` lives: the store's own record first (what this
    store built), then the user's shared one (what any store of this user built last).
    One shared record alone is overwritten by every store that builds the recipe, so a
    store would miss the snapshot it holds once another store built the same recipe."""
    name = f"{digest.hex_part(key)[:32]}.json"
    return [store.builds_dir / name, cache_dir() / "builds" / name]


def _record_build(store: Store, key: str, ref: str, snapshot: str) -> None:
    for f in _cache_files(store, key):
        with contextlib.suppress(OSError):  # a record is a shortcut, not a result
            f.parent.mkdir(exist_ok=True)
            f.write_text(json.dumps({"ref": ref, "digest": snapshot}))


def rerecord(store: Store, old: str, new: str) -> None:
    """Builds recorded as snapshot ``old`` are ``new`` in ``store`` from now on (the same
    image: its memory chunks split by the working set, engine/lazy/record.py), so building
    the recipe again tags ``new`` instead of booting anew once ``old`` is collected.
    The store's own records say so; this user's shared ones are left as they are (another
    store may hold ``old`` alone): one that names ``old`` gets a record of the store's
    own, which is read first, unless the store has one of its own already."""
    for shared in (False, True):
        for f in _cache_files_of(store, shared):
            own = store.builds_dir / f.name
            if shared and own.exists():
                continue
            with contextlib.suppress(ValueError, KeyError, OSError, TypeError):
                doc = json.loads(f.read_text())
                if doc["digest"] == old:
                    own.parent.mkdir(exist_ok=True)
                    own.write_text(json.dumps({"ref": doc["ref"], "digest": new}))


def _cache_files_of(store: Store, shared: bool) -> list[Path]:
    """The build records ``store`` keeps, or (``shared``) this user's shared ones."""
    d = cache_dir() / "builds" if shared else store.builds_dir
    return sorted(d.glob("*.json")) if d.is_dir() else []


def _cache_key(recipe: Recipe, accel: str) -> str:
    # Everything the snapshot depends on besides the recipe: the guest code, the
    # accelerator, QEMU, and the kernel command line the engine boots templates with.
    return recipe.content_digest(
        image.guest_code_digest() + accel + qemu_version()
        + kernel_cmdline(accel, "") + SNAPSHOT_LAYOUT
    )


def cached_snapshot(store: Store, recipe: Recipe) -> str | None:
    """The digest of the snapshot ``recipe`` built before, if ``store`` holds it (then
    `build` only tags it), else None."""
    return _recorded_snapshot(store, _cache_key(recipe, cached_probe().accel))


def _recorded_snapshot(store: Store, key: str) -> str | None:
    for f in _cache_files(store, key):
        with contextlib.suppress(ValueError, KeyError, OSError, ForkdError):
            prev_digest = str(json.loads(f.read_text())["digest"])
            store.chain(prev_digest)  # the manifest and its chain are in this store
            return prev_digest
    return None


@dataclass
class DiskAhead:
    """The root disk's chunks compressed in a thread while the template boots and warms up
    (TCG runs its one vCPU on one core; zstd takes the other): the import then compresses
    only the regions the guest wrote (chunking.Precompressed)."""

    ready: Precompressed
    thread: threading.Thread
    stopped: threading.Event

    @classmethod
    def start(cls, root: Path) -> DiskAhead:
        ready, stopped = Precompressed(ZSTD_LEVEL_FLAT), threading.Event()

        def work() -> None:
            with contextlib.suppress(OSError, ForkdError):  # the import compresses it then
                ready.add_image(str(root), stopped.is_set)

        thread = threading.Thread(target=work, name="forkd-disk-ahead", daemon=True)
        thread.start()
        return cls(ready, thread, stopped)

    def stop(self) -> Precompressed:
        """Stop compressing (what is done is kept) and hand over the frames."""
        self.stopped.set()
        self.thread.join()
        return self.ready


def build(store: Store, recipe: Recipe, tag: str, *, force: bool = False,
          progress: Progress = _noop) -> BuildResult:
    t_start = time.monotonic()
    ref = str(parse_ref(tag))
    verdict = cached_probe()
    key = _cache_key(recipe, verdict.accel)  # hashes the guest code: once per build
    # The build cache maps recipe content to the snapshot it produced. Any store that holds
    # that snapshot (its own record, or the one shared by every store of this user) just
    # tags it.
    if not force and (prev_digest := _recorded_snapshot(store, key)) is not None:
        _record_build(store, key, ref, prev_digest)
        with contextlib.suppress(ForkdError):
            if store.tags.read().get(ref) == prev_digest:
                progress(f"cached: {ref} is already built from this recipe")
            else:
                progress(f"cached: tagging the snapshot built from this recipe as {ref}")
                store.tag(ref, prev_digest, force=True)
            return BuildResult(ref, prev_digest, True, verdict.accel, 0, 0, 0,
                               time.monotonic() - t_start, 0)
    progress(f"accelerator: {verdict.accel} ({verdict.reason})")
    guest = image.build_guest(recipe, progress)
    work = scratch_dir("forkd-build")
    try:
        mem = work / "memory.img"
        tpl_disk = work / "template.qcow2"
        create_overlay(tpl_disk, guest.root, "raw")
        ns_name: str | None = None
        extra_cmdline = ""
        if recipe.network:
            why = netns.available()
            if why:
                raise HostError(f"recipe {recipe.name} wants a network device but {why}")
            ns_name = f"{netns.PREFIX}build-{secrets.token_hex(3)}"
            netns.create(ns_name)
            extra_cmdline = f"forkd.ip={netns.TEMPLATE_IP}/{netns.GW_PREFIX} forkd.gw={netns.GW_IP}"
        if recipe.tmp_mib != 64:  # the initramfs's default (engine/guest/init)
            extra_cmdline = f"{extra_cmdline} forkd.tmp_mib={recipe.tmp_mib}".strip()
        cfg = VMConfig(memory_mib=recipe.memory_mib, vcpus=recipe.vcpus, accel=verdict.accel,
                       mem_path=mem, share=True, disk=tpl_disk, disk_cache="unsafe",
                       kernel=guest.kernel.vmlinux, initrd=guest.initrd,
                       cmdline=kernel_cmdline(verdict.accel, extra_cmdline),
                       tap="tap0" if recipe.network else None, mac=netns.TEMPLATE_MAC)
        vm = QemuVM(work / "vm", cfg, netns=ns_name)
        ahead = DiskAhead.start(guest.root)
        try:
            progress(f"booting the template ({recipe.memory_mib} MiB, {verdict.accel})")
            t0 = time.monotonic()
            vm.launch()
            agent = AgentClient(vm.dir / "agent.sock", alive=vm.alive)
            try:
                agent.wait_hello(BOOT_TIMEOUT, vm.alive)
            except AgentError as e:
                raise GuestBuildError(f"template did not boot: {e}\n{vm.log_tail()}") from e
            agent.ping()
            boot_s = time.monotonic() - t0
            done("boot", recipe.name, boot_s, progress)
            progress("agent ready; warming up")
            t1 = time.monotonic()
            if recipe.warmup.strip():
                r = agent.eval(recipe.warmup, timeout=900)
                if r.get("error"):
                    raise GuestBuildError("the recipe's warm-up code failed in the guest:\n"
                                          + str(r["error"].get("traceback", r["error"])))
            # move the warm objects out of the collector's reach: a GC pass in a child would
            # otherwise touch (and copy-on-write) every page holding a Python object
            agent.eval("import gc as _gc\n_gc.collect()\n_gc.freeze()", timeout=120)
            agent.request("sync", timeout=60)
            shrink = agent.eval(SHRINK_MEMORY, timeout=300)
            if shrink.get("error"):
                raise GuestBuildError("dropping the template's page cache failed in the guest: "
                                      + str(shrink["error"]))
            agent.eval("del _forkd_zeroed", timeout=60)
            warm_s = time.monotonic() - t1
            done("warm-up", recipe.name, warm_s, progress)
            assert vm.qmp is not None
            t2 = time.monotonic()
            with phase("snapshot", recipe.name, progress):
                vm.qmp.command("stop")
                vm.qmp.command("xen-save-devices-state",
                               {"filename": str(work / "vmstate"), "live": False})
            snap_ms = (time.monotonic() - t2) * 1000
            agent.close()
        finally:
            vm.shutdown()  # the template never runs again after its snapshot
            if ns_name is not None:
                netns.remove(ns_name)
            ready = ahead.stop()
        progress(f"root disk: {ready.held >> 20} MiB compressed ahead, during boot and warm-up")
        raw = work / "disk.raw"
        with phase("disk convert", recipe.name, progress):
            p = subprocess.run([QEMU_IMG, "convert", "-f", "qcow2", "-O", "raw", str(tpl_disk),
                                str(raw)], capture_output=True, text=True, check=False,
                               stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise VMMError(f"qemu-img convert of the template disk failed: {p.stderr.strip()}")
        compat = Compat(vmm="qemu", vmm_version=qemu_version(), machine=MACHINE,
                        cpu_model=CPU_MODEL, accelerators=[verdict.accel],
                        vcpus=recipe.vcpus, memory_mib=recipe.memory_mib,
                        kernel_digest=guest.kernel.digest, agent_protocol=PROTOCOL)
        progress("storing the base layer (chunked, compressed)")
        # No kernel or initramfs blobs: a fork restores RAM and never boots (QEMU gets no
        # -kernel); the config records the kernel's digest and the recipe rebuilds the guest.
        with phase("store layer", recipe.name, progress):
            info = store.import_layer(ref, memory=mem, vmstate=work / "vmstate", disk=raw,
                                      compat=compat, description=recipe.description,
                                      recipe=recipe.to_dict(), disk_ready=ready,
                                      force=True)  # a build replaces the tag, like docker build
        _record_build(store, key, ref, info.digest)
        return BuildResult(ref, info.digest, False, verdict.accel, boot_s, warm_s, snap_ms,
                           time.monotonic() - t_start, info.stored_bytes)
    finally:
        shutil.rmtree(work, ignore_errors=True)
