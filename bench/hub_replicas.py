"""Hub replicas: manifest GET/s and blob GET MB/s with 1 vs 3 replicas behind HAProxy, one run.

Starts PostgreSQL (Debian's), a moto S3 server and HAProxy with the test suite's own
helpers (tests/hub/hub_support.py, tests/s3_support.py, tests/hub/replica_support.py),
pushes one public artifact, then loads the balancer with the closed-loop load generator
of bench/hub_transfer.py (``latency``: keep-alive asyncio clients on raw sockets) for
``--seconds`` per round: 1 replica behind HAProxy, then 3 (the same database and bucket),
and, as the balancer's cost, the single replica addressed directly.

What the ratio can show here: this machine has 2 cores, shared by the load generator,
HAProxy, PostgreSQL, moto and the replicas, so 3 replicas cannot serve 3 times as much;
a ratio near 1 means the balancer and the shared state (one PostgreSQL, one bucket) cost
little, one well under 1 that they cost a lot. Blob GETs stream from moto, a Python
process of its own, which bounds MB/s whatever the replica count. Real scale-out needs
replicas on cores (hosts) of their own.

    python bench/hub_replicas.py [--seconds 5] [--clients 32] [--blob-kib 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "hub")]

import hub_support  # noqa: E402  (the tests' helpers, on the path above)
from hub_support import ADMIN, artifact  # noqa: E402
from hub_transfer import latency  # noqa: E402
from replica_support import ReplicaSet, start_replicas  # noqa: E402
from s3_support import MotoServer  # noqa: E402

REPO = "library/bench"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@contextlib.contextmanager
def postgres() -> Iterator[Callable[[], str]]:
    """The tests' throwaway PostgreSQL cluster (hub_support.postgres_server)."""
    with contextlib.contextmanager(hub_support.postgres_server.__wrapped__)() as new_database:
        yield new_database


def rates(
    target: ReplicaSet, via: str, blob: str, size: int, clients: int, seconds: float
) -> tuple[float, float]:
    """(manifest GET/s, blob GET MB/s) of ``via`` (host:port)."""
    from forkd.registry.reference import Hub

    hub = Hub(via, "http")
    manifests, _ = latency(hub, "GET", f"/v2/{REPO}/manifests/v1", OCI_MANIFEST, clients, seconds)
    blobs, _ = latency(hub, "GET", f"/v2/{REPO}/blobs/{blob}", "*/*", max(1, clients // 4), seconds)
    return len(manifests) / seconds, len(blobs) * size / seconds / 1e6


def measure(
    root: Path,
    new_database: Callable[[], str],
    moto: MotoServer,
    count: int,
    args: argparse.Namespace,
) -> dict[str, tuple[float, float]]:
    replicas = start_replicas(root / f"set{count}", new_database, moto, count=count)
    try:
        payload = os.urandom(args.blob_kib << 10)
        with replicas.client(ADMIN) as c:
            artifact(c, REPO, payload, tag="v1")
        replicas.cli("repo", "visibility", REPO, "public")
        blob = hub_support.sha(payload)
        out = {"balanced": rates(replicas, replicas.address, blob, len(payload), args.clients,
                                 args.seconds)}  # fmt: skip
        if count == 1:
            out["direct"] = rates(
                replicas, replicas.replicas[0].address, blob, len(payload), args.clients,
                args.seconds,
            )  # fmt: skip
        return out
    finally:
        replicas.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of one load round")
    ap.add_argument("--clients", type=int, default=32, help="manifest clients (blob: a quarter)")
    ap.add_argument("--blob-kib", type=int, default=1024)
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="forkd-bench-replicas-") as tmp,
        postgres() as new_database,
    ):
        moto = MotoServer(Path(tmp)).start()
        try:
            one = measure(Path(tmp), new_database, moto, 1, args)
            three = measure(Path(tmp), new_database, moto, 3, args)
        finally:
            moto.stop()
    (m1, b1), (m3, b3) = one["balanced"], three["balanced"]
    md, bd = one["direct"]
    print(f"{'':28} {'manifest GET/s':>15} {'blob GET MB/s':>14}")
    print(f"{'1 replica, direct':28} {md:15.0f} {bd:14.1f}")
    print(f"{'1 replica behind HAProxy':28} {m1:15.0f} {b1:14.1f}")
    print(f"{'3 replicas behind HAProxy':28} {m3:15.0f} {b3:14.1f}")
    print(f"{'ratio 3 / 1 (balanced)':28} {m3 / m1:15.2f} {b3 / b1:14.2f}")
    print(f"{'ratio balanced / direct':28} {m1 / md:15.2f} {b1 / bd:14.2f}")
    print(
        f"\n{os.cpu_count()} cores: the load generator, HAProxy, PostgreSQL, moto and every "
        "replica share them, so the 3/1 ratio cannot show real scale-out; it shows what the "
        "balancer and the shared state (one database, one bucket) cost. Blob MB/s is bounded "
        "by moto, one Python process."
    )


if __name__ == "__main__":
    main()
