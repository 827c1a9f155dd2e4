#!/usr/bin/env python3
"""Cold-boot N VMs vs fork N children of the same warm python-numpy snapshot, in one run.

Prints the pack's stored size per component (forkd inspect), then, for N in --ns: time
until all N answer an eval (cold boot includes the warm-up import of numpy, fork includes
restore + entropy fixup), first eval, warm eval round trip, host memory per child (QEMU
PSS, and guest copy-on-write = `Anonymous` of the RAM mapping in smaps). Ratios are against
the cold-boot baseline measured in the same run. Then, per N, the same fork with a
prewarmed pool of N waiting processes (engine/pool.py), filled before the clock starts, in
both pool modes: "ahead" (restored, pinged and paused in the pool: a spawn does cont +
fixup) and "incoming" (`-incoming defer`: a spawn does migrate-incoming + cont + fixup);
ratio = fork without a pool / fork with one, same run.

Then the branch pause (p50, p90) with ~20 and ~200 MiB dirty (--branch-dirty-mib) on a guest
of --branch-memory-mib (512: the recipe is built again with that memory, in this run): live
(engine/precopy.py) next to stop-the-world, the baseline, in the same run, on the same child;
ratio = stop-the-world p50 / live p50. The 1-minute load average is printed with it: on a
shared host every context switch in the pause waits its turn. Needs root; not a pass/fail test.

usage: sudo python bench/fork_fanout.py [--ns 1,10,50] [--cold-ns 1,10,50] [--recipe PATH]
                                        [--pool-modes ahead,incoming] [--only-pool]
                                        [--only-branch] [--branch-dirty-mib 20,200]
                                        [--branch-memory-mib 512] [--branch-rounds 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from forkd.engine import children as ch
from forkd.engine import image, recipe
from forkd.engine.agent_client import AgentClient
from forkd.engine.branch import anon_kib, branch
from forkd.engine.build import build
from forkd.engine.pool import Pool
from forkd.engine.qemu import QemuVM, VMConfig, create_overlay, kernel_cmdline
from forkd.store.store import Store

REPO = Path(__file__).resolve().parents[1]


def pss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    return 0


def cold_boot(n: int, r: recipe.Recipe, accel: str, work: Path) -> dict[str, float]:
    """Boot n fresh VMs concurrently; each is ready when numpy is warm and it answered."""
    g = image.build_guest(r)
    vms: list[QemuVM] = []
    first: list[float] = []
    errors: list[str] = []
    t0 = time.monotonic()

    def one(i: int) -> None:
        d = work / f"cold{i}"
        d.mkdir()
        disk = d / "disk.qcow2"
        create_overlay(disk, g.root, "raw")
        vm = QemuVM(
            d / "vm",
            VMConfig(
                memory_mib=r.memory_mib,
                vcpus=r.vcpus,
                accel=accel,
                mem_path=d / "mem",
                share=False,
                disk=disk,
                kernel=g.kernel.vmlinux,
                initrd=g.initrd,
                cmdline=kernel_cmdline(accel),
            ),
        )
        vms.append(vm)
        try:
            vm.launch(qmp_timeout=120)
            a = AgentClient(vm.dir / "agent.sock", alive=vm.alive)
            a.wait_hello(600, vm.alive)
            a.eval(r.warmup, timeout=600)
            t = time.monotonic()
            a.eval("1+1")
            first.append((time.monotonic() - t) * 1000)
            a.close()
        except Exception as e:
            errors.append(str(e)[:200])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_ready = time.monotonic() - t0
    for vm in vms:
        vm.shutdown(timeout=3)
    return {
        "all_ready_s": all_ready,
        "first_eval_ms": statistics.median(first) if first else -1,
        "errors": len(errors),
    }


def fork_n(store: Store, tag: str, n: int) -> dict[str, float]:
    # all ready = every child restored, fixed up, and answered an agent request
    res = ch.fork(store, tag, n)
    all_ready = res.total_ms / 1000
    firsts = []
    for c in res.children:
        t = time.monotonic()
        ch.eval_in(c.id, "np.zeros(5).tolist()")
        firsts.append((time.monotonic() - t) * 1000)
    c0 = res.children[0]
    warm = []
    with ch.agent(c0.id) as a:
        for _ in range(20):
            t = time.monotonic()
            a.eval("np.zeros(5).tolist()")
            warm.append((time.monotonic() - t) * 1000)
    time.sleep(1.0)  # let the children go idle before measuring memory
    pss = [pss_kib(c.pid) / 1024 for c in res.children]
    cow = [anon_kib(c.pid, Path(c.memory)) / 1024 for c in res.children]
    out = {
        "all_ready_s": all_ready,
        "first_eval_ms": statistics.median(firsts),
        "warm_eval_ms": statistics.median(warm),
        "pss_mib_per_child": statistics.median(pss),
        "cow_mib_per_child": statistics.median(cow),
        "errors": len(res.errors),
    }
    for c in res.children:
        ch.kill(c.id)
    return out


def pool_fork_n(store: Store, tag: str, n: int, restore_ahead: bool) -> dict[str, float]:
    """Fill a pool of n for tag (not timed), then fork n from it: all restored, fixed up and
    answering. The pool is removed right after, so its refill does not disturb the rest."""
    pool = Pool(store, restore_ahead=restore_ahead)
    try:
        t = time.monotonic()
        pool.fill(tag, n, wait=True, timeout=600)
        fill_s = time.monotonic() - t
        res = ch.fork(store, tag, n, pool=pool)
        all_ready = res.total_ms / 1000
        pool.remove(tag)
    finally:
        pool.close()
    firsts = []
    for c in res.children:
        t = time.monotonic()
        ch.eval_in(c.id, "1 + 1")
        firsts.append((time.monotonic() - t) * 1000)
    pooled = sum(1 for c in res.children if "prestarted_ms" in c.timings_ms)
    for c in res.children:
        ch.kill(c.id)
    return {
        "all_ready_s": all_ready,
        "fill_s": fill_s,
        "from_pool": pooled,
        "first_eval_ms": statistics.median(firsts),
        "errors": len(res.errors),
    }


def _p(xs: list[float], q: int) -> float:
    """The q-th percentile (inclusive method: within the samples)."""
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


def branch_bench(store: Store, tag: str, rounds: int, dirty_mib: int) -> dict[str, float]:
    """Pause of a live branch and of a stop-the-world branch of the same child, with a guest
    process holding dirty_mib MiB it rewrites before each branch (then idles)."""
    c = ch.fork(store, tag, 1).children[0]
    live: list[float] = []
    stop: list[float] = []
    pause_pages: list[float] = []
    diffs: list[float] = []
    forced = 0
    try:
        ch.eval_in(c.id, f"A = np.ones(({dirty_mib} << 20) // 8)")
        for k in range(rounds):
            ch.eval_in(c.id, f"A[:] = {k + 2}")
            res = branch(store, c.id, f"bench-branch:live{k}", force=True)
            live.append(res.pause_ms)
            pause_pages.append(res.pause_pages)
            diffs.append(res.diff_bytes / 2**20)
            forced += res.forced
            ch.eval_in(c.id, f"A[:] = {k + 102}")
            stop.append(branch(store, c.id, f"bench-branch:stop{k}", force=True,
                               live=False).pause_ms)
    finally:
        ch.kill(c.id)
    return {
        "dirty_mib": dirty_mib,
        "rounds": rounds,
        "live_pause_ms_p50": statistics.median(live),
        "live_pause_ms_p90": _p(live, 90),
        "live_pause_ms_max": max(live),
        "live_pause_pages_p50": statistics.median(pause_pages),
        "live_forced": forced,
        "stop_pause_ms_p50": statistics.median(stop),
        "stop_pause_ms_p90": _p(stop, 90),
        "diff_mib": statistics.median(diffs),
        "load_avg_1m": os.getloadavg()[0],
    }


def branch_guest(store: Store, r: recipe.Recipe, tag: str, memory_mib: int) -> str:
    """The snapshot the branch pause is measured on: the recipe's own, or the same recipe
    with more guest memory (built here, in the same run) so the large dirty size fits."""
    if r.memory_mib >= memory_mib:
        return tag
    big = dataclasses.replace(r, memory_mib=memory_mib)
    big_tag = f"{tag.rsplit(':', 1)[0]}-{memory_mib}m:{tag.rsplit(':', 1)[1]}"
    t = time.monotonic()
    build(store, big, big_tag)
    print(f"built {big_tag} ({memory_mib} MiB guest) for the branch pause in "
          f"{time.monotonic() - t:.1f} s", flush=True)
    return big_tag


def print_branch(br: dict[str, float], memory_mib: int) -> None:
    live, stop = br["live_pause_ms_p50"], br["stop_pause_ms_p50"]
    print(
        f"branch of a {memory_mib} MiB guest, {br['dirty_mib']:.0f} MiB dirty "
        f"({br['diff_mib']:.1f} MiB diff), {br['rounds']:.0f} rounds: live pause p50 "
        f"{live:.1f} ms p90 {br['live_pause_ms_p90']:.1f} (max {br['live_pause_ms_max']:.1f}, "
        f"{br['live_pause_pages_p50']:.0f} pages in the pause, {br['live_forced']:.0f} forced) | "
        f"stop-the-world p50 {stop:.1f} ms p90 {br['stop_pause_ms_p90']:.1f} → {stop / live:.1f}x"
        f" | forkd live anchor 56 ms (KVM) → {56 / live:.1f}x | load {br['load_avg_1m']:.1f}",
        flush=True,
    )


def pack_sizes(store: Store, tag: str) -> dict[str, object]:
    """The pack's stored size (distinct blobs, as pushed) and its components, printed."""
    info = store.inspect(tag)
    comps = {name: c["stored_bytes"] for name, c in info["components"].items()}
    parts = ", ".join(f"{name} {b / 2**20:.1f}" for name, b in comps.items() if b)
    print(f"pack {tag}: {info['stored_bytes'] / 2**20:.1f} MiB stored ({parts} MiB) for "
          f"{info['logical_bytes'] / 2**20:.0f} MiB of memory + disk", flush=True)
    return {"stored_bytes": info["stored_bytes"], "components": comps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ns", default="1,10,50")
    ap.add_argument("--cold-ns", default=None, help="N values for cold boot (default: --ns)")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "python-numpy.toml")
    ap.add_argument("--branch-rounds", type=int, default=7)
    ap.add_argument("--branch-dirty-mib", default="20,200",
                    help="dirty sizes for the branch pause (empty: no branch figures)")
    ap.add_argument("--branch-memory-mib", type=int, default=512,
                    help="guest memory for the branch pause: the recipe is built again with "
                         "this much if it has less (each dirty size must leave 256 MiB free)")
    ap.add_argument(
        "--pool-modes",
        default="ahead,incoming",
        help="pool modes to measure: ahead, incoming (empty: none)",
    )
    ap.add_argument(
        "--only-pool",
        action="store_true",
        help="fork with and without a pool only (no cold boot, no branch)",
    )
    ap.add_argument(
        "--only-branch",
        action="store_true",
        help="the pack size and the branch pause only (no fork, cold boot or pool)",
    )
    ap.add_argument("--json", action="store_true")
    o = ap.parse_args()
    dirty_mibs = [int(x) for x in o.branch_dirty_mib.split(",") if x]
    r = recipe.load(o.recipe)
    branch_mib = max(r.memory_mib, o.branch_memory_mib)
    too_big = [d for d in dirty_mibs if d + 256 > branch_mib]
    if too_big and not o.only_pool:
        ap.error(f"--branch-dirty-mib {too_big} does not fit a {branch_mib} MiB guest with "
                 "256 MiB for the rest; raise --branch-memory-mib")
    if o.only_branch:
        o.ns, o.cold_ns, o.pool_modes = "", "", ""
    ns = [int(x) for x in o.ns.split(",") if x]
    cold_ns = ([int(x) for x in (o.cold_ns or o.ns).split(",") if x]
               if not o.only_pool else [])
    modes = [m for m in o.pool_modes.split(",") if m]
    work = Path(tempfile.mkdtemp(prefix="forkd-bench-", dir="/dev/shm"))
    os.environ.setdefault("FORKD_HOME", str(work / "home"))
    os.environ.setdefault("FORKD_RUN", str(work / "run"))
    store = Store.open()
    tag = f"bench-{r.name}:{secrets.token_hex(2)}"
    results: dict[str, object] = {}
    try:
        b = build(store, r, tag)
        results["build"] = {"boot_s": b.boot_s, "snapshot_ms": b.snapshot_ms, "accel": b.accel}
        print(
            f"built {tag}: cold boot to agent {b.boot_s:.2f} s, snapshot {b.snapshot_ms:.1f} ms "
            f"({b.accel})",
            flush=True,
        )
        results["pack"] = pack_sizes(store, tag)
        t = time.monotonic()
        store.assemble(tag)  # once per snapshot, cached by digest for every later fork
        print(f"assembled the memory image once: {time.monotonic() - t:.2f} s", flush=True)
        for n in sorted(set(ns) | set(cold_ns)):
            row: dict[str, object] = {}
            if n in ns:
                row["fork"] = fork_n(store, tag, n)
            if n in cold_ns:
                cw = work / f"cold-{n}"
                cw.mkdir()
                row["cold"] = cold_boot(n, r, b.accel, cw)
                shutil.rmtree(cw, ignore_errors=True)
            results[f"n={n}"] = row
            f, c = row.get("fork"), row.get("cold")
            line = f"N={n:3}:"
            if isinstance(c, dict):
                line += f" cold all-ready {c['all_ready_s']:7.2f} s |"
            if isinstance(f, dict):
                line += (
                    f" fork all-ready {f['all_ready_s']:6.2f} s, first eval "
                    f"{f['first_eval_ms']:5.1f} ms, warm eval {f['warm_eval_ms']:4.2f} ms, "
                    f"PSS {f['pss_mib_per_child']:5.1f} MiB/child, guest CoW "
                    f"{f['cow_mib_per_child']:4.2f} MiB/child"
                )
            if isinstance(c, dict) and isinstance(f, dict):
                ratio = c["all_ready_s"] / f["all_ready_s"]
                row["speedup"] = ratio
                line += f" | fork {ratio:5.1f}x faster"
            print(line, flush=True)
            for mode in modes:
                if n not in ns or not isinstance(f, dict):
                    continue
                pf = pool_fork_n(store, tag, n, restore_ahead=mode == "ahead")
                pf["ratio"] = f["all_ready_s"] / pf["all_ready_s"]
                row[f"pool_{mode}"] = pf
                print(
                    f"N={n:3}: pool ({mode:8}) of {n}: all-ready {pf['all_ready_s']:6.2f} s "
                    f"({pf['from_pool']:.0f} from the pool, filled in {pf['fill_s']:.2f} s), "
                    f"first eval {pf['first_eval_ms']:5.1f} ms | without a pool "
                    f"{f['all_ready_s']:6.2f} s → {pf['ratio']:4.1f}x faster",
                    flush=True,
                )
        if o.only_pool:
            if o.json:
                print(json.dumps(results, indent=1))
            return
        if dirty_mibs:
            btag = branch_guest(store, r, tag, branch_mib)
            for mib in dirty_mibs:
                br = branch_bench(store, btag, o.branch_rounds, mib)
                results[f"branch_{mib}mib"] = br
                print_branch(br, branch_mib)
        if o.json:
            print(json.dumps(results, indent=1))
    finally:
        ch.kill_all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
