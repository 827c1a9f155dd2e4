#!/usr/bin/env python3
"""Sandboxes ready per second through forkd.ray on 2 Ray nodes vs 1, in one run.

One local cluster of two forkd nodes on this machine (tests/ray/ray_cluster.py: each its
own `forkd serve`, FORKD_HOME/FORKD_RUN, `ray start` with forkd_slots = N). The tiny
recipe is built on node a and pushed to a hub started here, and both nodes pull it in a
warm-up round that is not timed. Then, for --rounds rounds, in alternating order:

- "1 node": ``forkd.ray.spawn(ref, N, on=["a"])``, all N on node a;
- "2 nodes": ``forkd.ray.spawn(ref, N)``, N/2 on each node (both have N free slots).

A sandbox is ready when the spawn returns: the controller answers once each child has
restored, had its fixup and answered a ping. Sandboxes ready/s = N / that time (median
over the rounds). Each round's sandboxes are killed before the next one starts. The
baseline is the same N through the node's controller directly, without Ray
(forkd.Controller on node a's socket), also in this run.

What the ratio can and cannot show on this machine: both "nodes" share the same 2 cores
and one disk, and a TCG restore is CPU-bound. So 2 nodes vs 1 cannot show the scale-out
that two real hosts give (there it approaches 2x, each host restoring its own share). It
shows what the placement costs and whether splitting over two controllers holds the rate
when no CPU is added: a ratio near 1.0 means the split is free, below 1.0 is the
overhead of two daemons and the Ray hop, and above 1.0 is two controllers overlapping
the parts of a fork that wait rather than compute. "via Ray / direct" is the Ray hop's
cost on one node.

usage: sudo python3 -P bench/ray_fanout.py [--n 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "ray"), str(REPO / "tests")]

from hub_server import ADMIN, HubServer  # noqa: E402
from ray_cluster import LocalCluster  # noqa: E402

import forkd.ray  # noqa: E402
from forkd import Controller  # noqa: E402
from forkd.errors import ForkdError  # noqa: E402

TAG = "tiny:bench-ray"


def timed(spawn: Callable[[], list[Any]]) -> float:
    """Seconds until ``spawn`` returned its ready sandboxes; they are killed after."""
    start = time.perf_counter()
    boxes = spawn()
    seconds = time.perf_counter() - start
    for sb in boxes:
        try:
            sb.kill()
        except ForkdError as exc:
            print(f"  kill failed: {exc}", file=sys.stderr)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8, help="sandboxes per spawn (even)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    n = args.n - args.n % 2
    cluster = LocalCluster.create({"a": n, "b": n})
    hub = HubServer(Path(tempfile.mkdtemp(prefix="forkd-bench-hub-"))).start()
    try:
        for node in cluster.nodes:
            node.forkd("login", hub.address, "--username", ADMIN[0], "--password-stdin",
                       stdin=ADMIN[1] + "\n", timeout=120)
        cluster.head.forkd("build", str(REPO / "recipes" / "tiny.toml"), "--tag", TAG)
        ref = f"{hub.address}/bench/tiny:base"
        cluster.head.forkd("push", TAG, ref, timeout=600)
        cluster.start()
        cluster.connect()
        for sb in forkd.ray.spawn(ref, 2, pull=True):  # warm-up: both nodes pull, agents up
            sb.kill()
        local = "bench/tiny:base"  # the tag the pull gave it on each node
        direct = Controller(socket=cluster.head.socket, local=False)
        runs: dict[str, list[float]] = {"direct": [], "1 node": [], "2 nodes": []}
        for r in range(args.rounds):
            order = ["1 node", "2 nodes"] if r % 2 == 0 else ["2 nodes", "1 node"]
            for mode in order:
                on = ["a"] if mode == "1 node" else None
                runs[mode].append(timed(lambda on=on: forkd.ray.spawn(local, n, on=on)))
            runs["direct"].append(timed(lambda: direct.spawn_sandboxes(local, n)))
            print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()))
        rate = {k: n / statistics.median(v) for k, v in runs.items()}
        print(f"\n{n} sandboxes per spawn, tiny recipe, {args.rounds} rounds (median), TCG, "
              "2 cores shared by both nodes")
        for k in ("direct", "1 node", "2 nodes"):
            print(f"  {k:8} {rate[k]:6.2f} sandboxes ready/s")
        print(f"  ratio 2 nodes / 1 node: {rate['2 nodes'] / rate['1 node']:.2f}x "
              "(same 2 cores: this is the cost of the split, not the gain of a second host)")
        print(f"  ratio via Ray / direct (1 node): {rate['1 node'] / rate['direct']:.2f}x")
    finally:
        cluster.stop()
        hub.stop()
        left = cluster.leftovers()
        if left:
            print(f"warning: processes left: {left} (in {cluster.base})", file=sys.stderr)
        else:
            cluster.remove()


if __name__ == "__main__":
    main()
