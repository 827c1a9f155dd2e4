"""How long the hub's other requests wait while big manifests are pushed.

A manifest's JSON is checked and parsed at Python speed; one of 4 MiB of small objects
(``manifest_max_bytes``, pushable by any account into its own namespace) is about a
second of work. The hub parses documents over ``jsondoc.INLINE_MAX`` in a worker thread,
so ``/healthz`` should hardly notice. One run, one hub: ``/healthz`` latency while the
hub is idle (the baseline) and while 4 MiB manifests are pushed, the ratio of the worst
waits, and the worst wait against a push's own time (near 1 when the parse holds the
event loop, as it did before: /healthz waited for the whole parse). Every push is
refused after its parse (no config, no layers), so no blob is needed.

    python3 bench/hub_manifest_stall.py [--pushes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from hub_transfer import BENCH_SECRET, forkd_hub

MANIFEST = "application/vnd.oci.image.manifest.v1+json"


def manifest_of(size: int) -> bytes:
    head = b'{"schemaVersion":2,"mediaType":"' + MANIFEST.encode() + b'","annotations":{"a":['
    return head + b"{}," * (size // 3) + b"{}]}}"


def healthz_during(
    base: str, body: bytes, pushes: int, idle_s: float = 0.0
) -> tuple[list[float], list[float]]:
    """/healthz latencies (s) while ``pushes`` PUTs of ``body`` run (after ``idle_s`` of
    probes alone), and the PUTs' times (s)."""
    waits: list[float] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=base, timeout=60) as c:
            while not stop.is_set():
                t = time.perf_counter()
                c.get("/healthz")
                waits.append(time.perf_counter() - t)
                time.sleep(0.01)

    thread = threading.Thread(target=probe)
    thread.start()
    time.sleep(idle_s)
    took = []
    with httpx.Client(base_url=base, auth=("bench", BENCH_SECRET), timeout=120) as c:
        for _ in range(pushes):
            t = time.perf_counter()
            r = c.put("/v2/bench/stall/manifests/v1", content=body,
                      headers={"Content-Type": MANIFEST})
            took.append(time.perf_counter() - t)
            assert r.status_code == 400, r.text  # parsed, then refused
    stop.set()
    thread.join()
    return waits, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pushes", type=int, default=3)
    args = parser.parse_args()
    command = (f"{sys.executable} -P -m forkd.cli hub serve --data {{data}} "
               "--listen 127.0.0.1:{port}")
    with tempfile.TemporaryDirectory() as root, forkd_hub(Path(root) / "hub", command) as hub:
        base = f"http://{hub.address}"
        big = manifest_of((4 << 20) - 256)
        healthz_during(base, manifest_of(4 << 10), 1)  # warm: imports, the first login
        loaded, took = healthz_during(base, big, args.pushes)
        idle, _ = healthz_during(base, b"", 0, idle_s=sum(took))
        for label, waits in (("idle", idle), ("4 MiB pushes", loaded)):
            print(f"{label:13} /healthz median {statistics.median(waits) * 1000:.1f} ms, "
                  f"worst {max(waits) * 1000:.1f} ms ({len(waits)} probes)")
        print(f"a 4 MiB push takes {statistics.mean(took):.3f} s (mean of {len(took)})")
        print(f"worst /healthz wait, pushing / idle: {max(loaded) / max(idle):.1f}x; "
              f"against a push's time: {max(loaded) / statistics.mean(took):.2f} "
              "(near 1: the parse held the event loop)")


if __name__ == "__main__":
    main()
