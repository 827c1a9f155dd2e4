#!/usr/bin/env python3
"""Eager next to lazy fork of a pack this host has never seen, one run, loopback hub
(issue 14, item 4): python-numpy and langgraph-react.

Both recipes are built into a publisher store (cached by recipe content: pass a store that
holds them with --publisher-home) and pushed to a `forkd hub serve` on loopback (the repos
made public: the lazy server fetches without a login). Then, per pack, each figure from the
command to the answers, each in an empty store:

- **local fork** (the baseline: the pack is in the store, its images assembled): one child,
  then ten, answering an eval;
- **eager** (pull the whole pack, assemble, fork): one child, then ten, answering;
- **lazy** (`forkd fork HUB/NS/NAME --lazy`: manifests, maps and device state only, then
  memory and disk on first access): one child, then ten, answering; each pack's first lazy
  fork starts its own server (forked from this process, as `forkd fork --lazy` does: the
  spare an earlier pack left is ended first), the later ones find the spare server the one
  before left (engine/lazy/spare.py), so "lazy, spare server" is the first child again
  with one;
- **bytes fetched before the first answer**: the eager pull's bytes; for lazy, the blob
  bytes the hub sent from the command to just after the first answer (its /metrics);
- **warm eval** after the prefetch completed, median of 20 round trips, lazy child next to a
  local one.
Page cache: this host's kernel evicts file pages nobody touched for a while (DAMON), so
the local figures come after an untimed local fork (a host that forks a snapshot has its
images cached) and every eager and lazy figure after a read of the hub's blobs (a hub
serving a pack has it cached). Ratios against the local fork of the same run. Needs
root; not a pass/fail test; the machine is shared, so one run is one sample.

    sudo python3 -P bench/lazy_fork.py [--publisher-home DIR] [--n 10] [--packs A,B] [--phases]
                                       [--no-recorded-order] [--json]

By default the publisher records each pack's access order (engine/lazy/record.py: one lazy
child of its own store, up to its first answer) and publishes it with the pack, so even the
first lazy fork prefetches its working set from the start; --no-recorded-order leaves it
to the first lazy fork.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from forkd.engine import children as ch
from forkd.engine import recipe
from forkd.engine.build import build
from forkd.engine.lazy import fork as lazy
from forkd.engine.lazy import record, spare
from forkd.engine.paths import run_dir
from forkd.errors import ForkdError
from forkd.registry import credentials
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_packs import (  # one loopback hub and pack list for both benches
    ADMIN,
    PACKS,
    SECRET,
    embedded_hub,
    eval_ok,
)

PREFETCH_TIMEOUT = 600.0


def make_public(data: Path, repo: str) -> None:
    subprocess.run(["forkd", "hub", "repo", "visibility", "--data", str(data), repo, "public"],
                   check=True, capture_output=True, stdin=subprocess.DEVNULL)


def hub_bytes_sent(hub: Hub) -> int:
    """The blob bytes the hub has sent so far (its forkd_hub_blob_bytes_sent counter, read
    as its site admin): what a lazy fork fetched, wherever the server keeps it (fetched
    chunks wait in memory for the store until the children are started)."""
    r = httpx.get(f"{hub.url}/metrics", auth=(ADMIN, SECRET), timeout=10)
    r.raise_for_status()
    for line in r.text.splitlines():
        if line.startswith("forkd_hub_blob_bytes_sent_total "):
            return int(float(line.split()[1]))
    raise RuntimeError("the hub's /metrics has no forkd_hub_blob_bytes_sent_total")


def blob_bytes(store: Store) -> int:
    return sum(store.blobs.size(d) for d in store.blobs.digests())


def warm(directory: Path) -> None:
    """Read every file under ``directory`` (the hub's blobs): this host's kernel evicts
    page cache nobody touched for a while, and a hub serving a pack others pull has it in
    its cache. Untimed, before each eager and lazy figure alike."""
    for path in directory.rglob("*"):
        if path.is_file():
            with contextlib.suppress(OSError), path.open("rb") as f:
                while f.read(1 << 20):
                    pass


log = logging.getLogger("forkd.bench.lazy_fork")  # --phases: each first child's timings


def ids(res: ch.ForkResult) -> list[str]:
    """The children's ids; a child that did not start is an error of the run, with why."""
    if res.children:
        log.debug("%s: %s ms", res.children[0].id, res.children[0].timings_ms)
    if res.errors:
        for c in res.children:
            with contextlib.suppress(ForkdError):
                ch.kill(c.id)
        raise RuntimeError("children did not start: " + "; ".join(res.errors))
    return [c.id for c in res.children]


def timed(n: int, probe: str, start: Callable[[], list[str]],
          started: list[str]) -> tuple[float, float]:
    """Seconds from now to the first child answering ``probe`` and to all n answering."""
    t0 = time.perf_counter()
    ids = start()
    started.extend(ids)
    if len(ids) != n:
        raise RuntimeError(f"{len(ids)} of {n} children started")
    eval_ok(ids[0], probe)
    first = time.perf_counter() - t0
    for i in ids[1:]:
        eval_ok(i, probe)
    return first, time.perf_counter() - t0


def warm_ms(child_id: str) -> float:
    with ch.agent(child_id) as a:
        a.eval("1")
        times = []
        for _ in range(20):
            t = time.perf_counter()
            a.eval("1 + 1")
            times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times)


def wait_prefetch(store: Store) -> dict[str, Any]:
    report = next((store.home / "lazy").iterdir()) / "prefetch.json"
    deadline = time.monotonic() + PREFETCH_TIMEOUT
    while time.monotonic() < deadline:
        if report.exists():
            got: dict[str, Any] = json.loads(report.read_text())
            if got["state"] in ("done", "failed"):
                return got
        time.sleep(0.2)
    raise RuntimeError("the prefetch did not finish")


def wait_spare(timeout: float = 60.0) -> None:
    """Until the spare lazy server a lazy fork left is loaded and waiting."""
    sock = spare.spare_dir() / spare.SOCKET
    deadline = time.monotonic() + timeout
    while not sock.exists():
        if time.monotonic() > deadline:
            raise RuntimeError("no spare lazy server came up")
        time.sleep(0.05)


def no_spare(timeout: float = 30.0) -> None:
    """End the spare an earlier pack's lazy forks left, so the next lazy fork starts its
    own server, as the first lazy fork on a host does."""
    run = run_dir()
    deadline = time.monotonic() + timeout
    while spare.spares_of(run):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the spare lazy servers {spare.spares_of(run)} did not end")
        for pid in spare.spares_of(run):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(0.1)


def wait_unmounted(work: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            if not any(line.startswith("forkd-lazy ") and str(work) in line for line in f):
                return
        time.sleep(0.2)


SETTLE_S = 2.0  # seconds of quiet after a lazy server exits, before the next figure


def settle(store: Store, timeout: float = 30.0) -> None:
    """Until the lazy server of ``store`` (its children just ended) has unmounted and
    exited (its server.lock is free), then SETTLE_S more: each figure is taken on a host
    no other figure's server still works on (it writes what it fetched to its store and
    exits a second after its last child), as a fork a while after the last one finds it."""
    wait_unmounted(store.home)
    deadline = time.monotonic() + timeout
    for lock in (store.home / "lazy").glob("*/server.lock"):
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{store.home}: its lazy server did not exit") from None
                    time.sleep(0.1)
        finally:
            os.close(fd)
    time.sleep(SETTLE_S)


def measure(name: str, publisher: Store, hub: Hub, client: RegistryClient, work: Path,
            n: int) -> dict[str, float]:
    probe = PACKS[name][1]
    tag = f"{name}:latest"
    remote_text = f"{hub}/bench/{name}:latest"
    remote = parse_remote(remote_text)
    out: dict[str, float] = {}
    stores: list[Store] = []
    hub_data = work / "hub"  # embedded_hub's data directory (main)

    def fresh(label: str) -> Store:
        s = Store.open(work / f"{label}-{name}")
        stores.append(s)
        return s

    started: list[str] = []

    def done_with(store: Store) -> None:
        """End the children just measured: each figure is taken with none of another
        figure's children running (idle TCG guests still take CPU)."""
        for cid in started:
            with contextlib.suppress(ForkdError):
                ch.kill(cid, store)
        started.clear()

    try:
        publisher.assemble(tag)  # the local baseline forks assembled images
        # untimed: a host that forks this snapshot has its images in the page cache (this
        # host's kernel evicts what nobody touched for a while)
        timed(1, probe, lambda: ids(ch.fork(publisher, tag, 1)), started)
        done_with(publisher)
        out["local_first_s"], _ = timed(1, probe, lambda: ids(ch.fork(publisher, tag, 1)), started)
        done_with(publisher)
        _, out["local_n_s"] = timed(n, probe, lambda: ids(ch.fork(publisher, tag, n)), started)
        done_with(publisher)
        pulled: dict[str, int] = {}

        def eager(store: Store, k: int) -> list[str]:
            got = pull(store, remote, client, local=tag)
            pulled["bytes"] = got.bytes_sent
            return ids(ch.fork(store, tag, k))

        warm(hub_data)
        eager1 = fresh("eager1")
        out["eager_first_s"], _ = timed(1, probe, lambda: eager(eager1, 1), started)
        out["eager_bytes_mib"] = pulled["bytes"] / 2**20
        done_with(eager1)
        warm(hub_data)
        eagern = fresh("eagern")
        _, out["eager_n_s"] = timed(n, probe, lambda: eager(eagern, n), started)
        done_with(eagern)

        no_spare()  # the first lazy fork on a host: its own server
        warm(hub_data)
        lazy1 = fresh("lazy1")
        sent = hub_bytes_sent(hub)
        out["lazy_first_s"], _ = timed(1, probe, lambda: ids(lazy.fork(lazy1, remote_text, 1)),
                                       started)
        # read just after the answer: an upper bound (the rest of the chain waits 0.5 s)
        out["lazy_bytes_mib"] = (hub_bytes_sent(hub) - sent) / 2**20
        lazy_child = started[-1]
        got = wait_prefetch(lazy1)
        if got["state"] != "done":
            raise RuntimeError(f"{name}: prefetch failed: {got['error']}")
        out["prefetch_s"] = got["seconds"]
        out["working_set_s"] = got["recorded_seconds"]
        out["pack_mib"] = blob_bytes(lazy1) / 2**20
        eval_ok(lazy_child, probe)  # still running, unchanged, now on the complete chain
        out["warm_lazy_ms"] = warm_ms(lazy_child)
        done_with(lazy1)
        local_child = ch.fork(publisher, tag, 1).children[0].id
        started.append(local_child)
        eval_ok(local_child, probe)
        out["warm_local_ms"] = warm_ms(local_child)
        done_with(publisher)
        settle(lazy1)  # its server writes the fetched chunks and exits after its children
        wait_spare()  # the first lazy fork left it: what any later lazy fork finds
        warm(hub_data)
        lazys = fresh("lazys")
        out["lazy_spare_first_s"], _ = timed(
            1, probe, lambda: ids(lazy.fork(lazys, remote_text, 1)), started)
        done_with(lazys)
        settle(lazys)
        wait_spare()
        warm(hub_data)
        lazyn = fresh("lazyn")
        _, out["lazy_n_s"] = timed(n, probe, lambda: ids(lazy.fork(lazyn, remote_text, n)), started)
        done_with(lazyn)
    finally:
        for s in stores:
            ch.kill_all(s)
        for cid in started:  # the local baseline's (the others went with their store)
            with contextlib.suppress(ForkdError):
                ch.kill(cid, publisher)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--packs", default=",".join(PACKS),
                    help="comma-separated packs to measure (default: all)")
    ap.add_argument("--publisher-home", type=Path, default=None,
                    help="store to build into (default: a fresh one in the work directory)")
    ap.add_argument("--no-recorded-order", action="store_true",
                    help="publish no access order with the pack (the first lazy fork then "
                         "records it; the second prefetches in that order)")
    ap.add_argument("--no-split", action="store_true",
                    help="publish the built layers as they are: no split of their memory "
                         "chunks by the working set (engine/lazy/record.py; the layer an "
                         "earlier run split, if the publisher store still holds it)")
    ap.add_argument("--phases", action="store_true",
                    help="log each lazy fork's phases (chain resolved, server ready, forked) "
                         "and each fork's first child's timings (QMP up, running, ready)")
    o = ap.parse_args()
    if o.phases:
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
        logging.getLogger("forkd.lazy.fork").setLevel(logging.DEBUG)
        log.setLevel(logging.DEBUG)
    work = Path(tempfile.mkdtemp(prefix="forkd-lazy-bench-"))
    os.environ.setdefault("FORKD_RUN", str(work / "run"))
    # the lazy servers log in as the publisher: the first publishes its access order and
    # the second lazy fork (another empty store) prefetches in that order from the start
    os.environ["FORKD_CREDENTIALS"] = str(work / "credentials.json")
    results: dict[str, dict[str, float]] = {}
    packs = {name: PACKS[name] for name in o.packs.split(",")}
    try:
        publisher = Store.open(o.publisher_home or work / "publisher")
        for name, (path, _) in packs.items():
            b = build(publisher, recipe.load(path), f"{name}:latest")
            print(f"built {name}{' (cached)' if b.cached else ''}", flush=True)
            if o.no_split:  # the layer as built (before a split of an earlier run)
                unsplit = record.split_from(publisher, publisher.resolve(f"{name}:latest"))
                if unsplit is not None:
                    publisher.tag(f"{name}:latest", unsplit, force=True)
            elif not o.no_recorded_order:
                t0 = time.perf_counter()
                record.split_working_set(publisher, f"{name}:latest", PACKS[name][1])
                print(f"split the memory chunks of {name} by its working set in "
                      f"{time.perf_counter() - t0:.1f} s", flush=True)
        with embedded_hub(work / "hub") as hub, \
                RegistryClient(hub, Credential(ADMIN, SECRET)) as client:
            credentials.save(hub.host, Credential(ADMIN, SECRET))
            for name in packs:
                push(publisher, f"{name}:latest", parse_remote(f"{hub}/bench/{name}:latest"),
                     client)
                make_public(work / "hub", f"bench/{name}")
                if not o.no_recorded_order:  # as a publisher does: the working set with it
                    t0 = time.perf_counter()
                    record.publish_order(publisher, f"{name}:latest", client, f"bench/{name}",
                                         PACKS[name][1])
                    print(f"recorded and published the access order of {name} in "
                          f"{time.perf_counter() - t0:.1f} s", flush=True)
            for name in packs:
                results[name] = measure(name, publisher, hub, client, work, o.n)
                print(f"measured {name}", flush=True)
    finally:
        spare.end_spare()
        wait_unmounted(work)  # the lazy servers exit a second after their last child
        shutil.rmtree(work, ignore_errors=True)
    rows = [("pack (all blobs)", "pack_mib", "MiB"),
            ("local fork → 1st answer", "local_first_s", "s"),
            ("eager → 1st answer", "eager_first_s", "s"),
            ("lazy → 1st answer", "lazy_first_s", "s"),
            ("lazy, spare server → 1st", "lazy_spare_first_s", "s"),
            (f"local fork → {o.n} answering", "local_n_s", "s"),
            (f"eager → {o.n} answering", "eager_n_s", "s"),
            (f"lazy → {o.n} answering", "lazy_n_s", "s"),
            ("eager: fetched before 1st", "eager_bytes_mib", "MiB"),
            ("lazy: fetched before 1st", "lazy_bytes_mib", "MiB"),
            ("lazy: recorded working set in", "working_set_s", "s"),
            ("lazy: whole prefetch", "prefetch_s", "s"),
            ("warm eval, local child", "warm_local_ms", "ms"),
            ("warm eval, lazy child", "warm_lazy_ms", "ms")]
    for name, r in results.items():
        print(f"\n{name}")
        for label, key, unit in rows:
            print(f"  {label:30} {r[key]:10.3f} {unit}")
        print(f"  lazy 1st / local 1st:   {r['lazy_first_s'] / r['local_first_s']:.2f}x  "
              f"(target <= 2x, <= 1 s)")
        print(f"  lazy 1st / eager 1st:   {r['lazy_first_s'] / r['eager_first_s']:.2f}x")
        print(f"  lazy 1st with a spare server / local 1st: "
              f"{r['lazy_spare_first_s'] / r['local_first_s']:.2f}x")
        print(f"  lazy {o.n} / eager {o.n}:     {r['lazy_n_s'] / r['eager_n_s']:.2f}x")
        print(f"  warm lazy / warm local: {r['warm_lazy_ms'] / r['warm_local_ms']:.2f}x")
    if o.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
