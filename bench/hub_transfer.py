"""Push and pull throughput on loopback: forkd vs skopeo, against the same registry, one run.

A synthetic pack (default 512 MiB of guest memory) and a 3-layer chain are
pushed and pulled by forkd, and the same manifests and blobs are copied by
skopeo, against Debian's docker-registry (and the forkd hub when
``--hub-cmd`` starts one). Prints throughput, the ratio of forkd to skopeo,
the bytes a re-push sends when the registry already has the base, and the
manifest GET and blob HEAD latency under concurrent clients.

The latency load is a closed loop: ``--clients`` keep-alive connections, each sending
its next request (a manifest GET, or in a round of its own a blob HEAD of the chain's
config blob) when the last answer arrived, for ``--seconds``; a sample runs
from the request (the first one: from connecting) to the last byte of the answer. The
clients are asyncio tasks on raw sockets in one thread, so the load generator stays
cheap next to the servers (200 Python threads with an HTTP library saturated their own
GIL first). Rounds alternate between the two registries, both running, and the median
of the rounds' p99 is compared, because the machine is shared and noisy.

    python bench/hub_transfer.py [--size-mib 512] [--clients 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from forkd.pack import mediatypes as mt
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def docker_registry(root: Path) -> Iterator[Hub]:
    port = free_port()
    root.mkdir(parents=True)
    config = root / "config.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {root}/data\n"
        f"http:\n  addr: 127.0.0.1:{port}\nlog:\n  level: error\n"
    )
    proc = subprocess.Popen(
        ["docker-registry", "serve", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/")
        yield Hub(f"127.0.0.1:{port}", "http")
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def forkd_hub(root: Path, command: str) -> Iterator[Hub]:
    """A hub whose admin is ``bench`` (password in BENCH_SECRET); pushes go to ``bench/…``."""
    port = free_port()
    args = command.format(data=root, port=port).split()
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": "bench", "FORKD_HUB_ADMIN_PASSWORD": BENCH_SECRET}
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        env=env,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}/v2/")
        yield Hub(f"127.0.0.1:{port}", "http")
    finally:
        proc.terminate()
        proc.wait(10)


BENCH_SECRET = secrets.token_urlsafe(16)
# A server's start-up on a shared, loaded machine (imports, database migration) can take
# well over 30 s; how long it took is no part of what the bench measures.
READY_TIMEOUT = 180.0


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code in (200, 401):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def skopeo_copy(src: str, dst: str) -> None:
    subprocess.run(
        [
            "skopeo",
            "copy",
            "--quiet",
            "--src-tls-verify=false",
            "--dest-tls-verify=false",
            src,
            dst,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
    )


def latency(
    hub: Hub, method: str, path: str, accept: str, clients: int, seconds: float
) -> tuple[list[float], float]:
    """Per-request latencies of ``method path`` from ``clients`` connections for
    ``seconds``, and the share of a core the load generator used (near 100 %: it is the
    bottleneck, and its own delay in reading answers is in every sample)."""
    host, _, port = hub.host.rpartition(":")
    request = f"{method} {path} HTTP/1.1\r\nHost: {hub.host}\r\nAccept: {accept}\r\n\r\n".encode()
    has_body = method != "HEAD"
    samples: list[float] = []

    async def client(stop: float) -> None:
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while True:
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                status = head.split(b" ", 2)[1]
                lengths = [
                    int(line.split(b":", 1)[1])
                    for line in head.lower().split(b"\r\n")
                    if line.startswith(b"content-length:")
                ]
                if not lengths:
                    raise RuntimeError(f"{method} {path} answered without Content-Length")
                if has_body:
                    await reader.readexactly(lengths[0])
                if status != b"200":
                    raise RuntimeError(f"{method} {path} answered {status.decode()}")
                now = time.perf_counter()
                samples.append(now - start)
                if now >= stop:
                    return
                start = now
        finally:
            writer.close()

    async def load() -> None:
        stop = time.perf_counter() + seconds
        await asyncio.gather(*(client(stop) for _ in range(clients)))

    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(load())
    return samples, (time.process_time() - cpu) / (time.perf_counter() - wall)


def p99(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=100)[98] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--clients", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5.0, help="length of one load round")
    ap.add_argument(
        "--rounds", type=int, default=3, help="load rounds per registry (0: transfers only)"
    )
    ap.add_argument(
        "--hub-cmd",
        default="forkd hub serve --data {data} --listen 127.0.0.1:{port} --workers "
        + str(os.cpu_count() or 1),
        help="command starting a forkd hub ('' to skip the hub)",
    )
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forkd-hub-bench-"))
    try:
        run(work, args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(work: Path, args: argparse.Namespace) -> None:
    store = Store(work / "home")
    size = args.size_mib << 20
    print(f"generating a {args.size_mib} MiB pack and a 3-layer chain in {work}")
    images = [work / "l0.mem", work / "l1.mem", work / "l2.mem"]
    write_base(images[0], size, seed=1, random_share=0.15, repeated_share=0.1)
    write_diff(images[0], images[1], 0.05, seed=1)
    write_diff(images[1], images[2], 0.05, seed=2)
    store.import_layer("bench/base", memory=images[0])
    store.import_layer("bench/l1", memory=images[1], parent="bench/base")
    head = store.import_layer("bench/l2", memory=images[2], parent="bench/l1")
    chain = store.chain(head.digest)
    stored = sum(d.size for link in chain for d in link.manifest.blobs())
    print(f"chain: {len(chain)} layers, {stored / (1 << 20):.1f} MiB of blobs\n")

    with ExitStack() as running:
        hubs = {"docker-registry": running.enter_context(docker_registry(work / "docker-registry"))}
        if args.hub_cmd and shutil.which(args.hub_cmd.split()[0]):
            hubs["forkd hub"] = running.enter_context(forkd_hub(work / "forkd-hub", args.hub_cmd))
        pushes = {
            label: transfer(label, hub, store, chain, stored, work) for label, hub in hubs.items()
        }
        if len(pushes) == 2:
            ours, theirs = pushes["forkd hub"], pushes["docker-registry"]
            print(
                f"push base, forkd hub {ours:.2f} s / docker-registry {theirs:.2f} s: "
                f"{ours / theirs:.2f}x (target <= 1.0x)\n"
            )
        blob = chain[-1].manifest.config.digest
        loads = {
            "manifest GET": ("GET", "/v2/bench/chain/manifests/head", mt.OCI_MANIFEST),
            "blob HEAD": ("HEAD", f"/v2/bench/chain/blobs/{blob}", "*/*"),
        }
        p99s: dict[tuple[str, str], list[float]] = {(lb, k): [] for lb in hubs for k in loads}
        for round_ in range(1, args.rounds + 1):
            for label, hub in hubs.items():
                for kind, (method, path, accept) in loads.items():
                    samples, busy = latency(hub, method, path, accept, args.clients, args.seconds)
                    p99s[label, kind].append(p99(samples))
                    print(
                        f"[{label}] round {round_}: {kind} with {args.clients} clients: "
                        f"{len(samples) / args.seconds:.0f} requests/s, "
                        f"p50 {statistics.median(samples) * 1000:.1f} ms, "
                        f"p99 {p99s[label, kind][-1]:.1f} ms (load generator: {busy:.0%} of a core)"
                    )
    if args.rounds <= 0:
        return
    median = {key: statistics.median(values) for key, values in p99s.items()}
    print(f"\np99 with {args.clients} clients (median of {args.rounds} rounds):")
    for label in hubs:
        get, head_ = median[label, "manifest GET"], median[label, "blob HEAD"]
        print(
            f"  {label}: manifest GET {get:.1f} ms, blob HEAD {head_:.1f} ms "
            f"({head_ / get:.2f}x the manifest GET)"
        )
    if len(hubs) == 2:
        ours, theirs = (
            median["forkd hub", "manifest GET"],
            median["docker-registry", "manifest GET"],
        )
        print(
            f"manifest GET p99, forkd hub {ours:.1f} ms / docker-registry {theirs:.1f} ms: "
            f"{ours / theirs:.2f}x (target <= 1.5x)"
        )


def transfer(
    label: str,
    hub: Hub,
    store: Store,
    chain: list,  # type: ignore[type-arg]
    stored: int,
    work: Path,
) -> float:
    """Push, re-push and pull the chain with forkd, copy it with skopeo; print the figures
    and return the time the base's push took."""
    mib = stored / (1 << 20)
    credential = Credential("bench", BENCH_SECRET) if label == "forkd hub" else None
    with RegistryClient(hub, credential) as client:
        base_ref = parse_remote(f"{hub}/bench/chain:base")
        push_base = timed(lambda: push(store, "bench/base", base_ref, client))
        if label == "forkd hub":  # anonymous pulls (skopeo, the load run) like docker-registry's
            subprocess.run(
                [
                    "forkd",
                    "hub",
                    "repo",
                    "visibility",
                    "bench/chain",
                    "public",
                    "--data",
                    str(work / "forkd-hub"),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
            )
        head_ref = parse_remote(f"{hub}/bench/chain:head")
        repush = push(store, "bench/l2", head_ref, client)
        delta = sum(d.size for link in chain[:2] for d in link.manifest.blobs())
        fresh = Store(work / f"pull-{label.replace(' ', '-')}")
        pull_s = timed(lambda: pull(fresh, head_ref, client))
    # skopeo: the same manifests (each layer of the chain, by digest) registry -> OCI dir.
    oci = work / f"skopeo-{label.replace(' ', '-')}"

    def copy_chain() -> None:
        for i, link in enumerate(chain):
            skopeo_copy(f"docker://{hub}/bench/chain@{link.digest}", f"oci:{oci}:l{i}")

    skopeo_s = timed(copy_chain)
    print(
        f"[{label}] push base {push_base:.2f} s; pull chain {pull_s:.2f} s "
        f"({mib / pull_s:.0f} MiB/s, verification included) vs skopeo copy {skopeo_s:.2f} s "
        f"({mib / skopeo_s:.0f} MiB/s): forkd/skopeo {pull_s / skopeo_s:.2f}x (target <= 1x)"
    )
    print(
        f"[{label}] re-push of the chain with the base already there: "
        f"{repush.bytes_sent / (1 << 20):.1f} MiB sent for {delta / (1 << 20):.1f} MiB of new "
        f"layers ({repush.bytes_sent / delta:.2f}x, target <= 1.1x)"
    )
    os.sync()
    return push_base


if __name__ == "__main__":
    main()
