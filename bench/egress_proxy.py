"""The egress proxy's cost, as ratios measured in one run: through the proxy vs direct.

Two stand-in model servers (HTTPS, certificates from a throw-away CA) run on loopback:
one bound to a secret (the proxy terminates TLS, swaps the placeholder, re-encrypts),
one only allowed (the proxy tunnels raw bytes). For a small chat completion (keep-alive
client, median of --requests) and for a --download-mib download (best of 3), it prints
the time from the host directly and through the proxy, and their ratio. Target: a small
completion within 1.2x of direct. No assertions. It also prints the proxy process's CPU
time (user + system) per proxied request or download: on a shared, loaded machine the
wall-clock ratios swing with the load, the CPU the proxy spends does much less.

    python bench/egress_proxy.py [--requests 200] [--download-mib 10]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import socket
import ssl
import statistics
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path

import httpx

from forkd.engine.egress import EgressCA, EgressPolicy, EgressProxy, SecretStore
from forkd.engine.egress.standin import StandinModel

KEY = "sk-bench-0123456789abcdef"
CHAT = {"model": "standin", "messages": [{"role": "user", "content": "hi"}]}


def serve(proxy: EgressProxy) -> tuple[str, BaseProcess]:
    """Run ``proxy`` in its own process (as on a host, not sharing the client's GIL)."""
    sock = socket.create_server(("127.0.0.1", 0))
    port = int(sock.getsockname()[1])
    process = multiprocessing.get_context("fork").Process(
        target=_run, args=(proxy, sock), daemon=True
    )
    process.start()
    sock.close()
    return f"http://127.0.0.1:{port}", process


def _run(proxy: EgressProxy, sock: socket.socket) -> None:
    async def forever() -> None:
        server = await proxy.serve(sock)
        await server.serve_forever()

    asyncio.run(forever())


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def completion_seconds(client: httpx.Client, base: str, key: str, n: int) -> float:
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base}/v1/chat/completions"
    client.post(url, json=CHAT, headers=headers).raise_for_status()  # connect, warm up
    times = []
    for _ in range(n):
        start = time.perf_counter()
        client.post(url, json=CHAT, headers=headers).raise_for_status()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def download_seconds(client: httpx.Client, base: str, size: int) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        got = 0
        with client.stream("GET", f"{base}/download?bytes={size}") as r:
            r.raise_for_status()
            for chunk in r.iter_raw(1 << 16):
                got += len(chunk)
        if got != size:
            raise SystemExit(f"download returned {got} bytes, not {size}")
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--download-mib", type=int, default=10)
    args = parser.parse_args()
    size = args.download_mib << 20
    with tempfile.TemporaryDirectory() as tmp:
        upstream_ca = EgressCA.load_or_create(Path(tmp) / "upstream-ca")
        store = SecretStore(Path(tmp) / "secrets")
        proxy_ca = EgressCA.load_or_create(store.root / "ca")
        upstream_trust = ssl.create_default_context(cadata=upstream_ca.cert_pem.decode())
        guest_trust = ssl.create_default_context(cadata=proxy_ca.cert_pem.decode())
        leaf = upstream_ca.leaf_context("127.0.0.1")
        with StandinModel(api_key=KEY, tls=leaf) as bound, StandinModel(tls=leaf) as free:
            secret = store.set("OPENAI_API_KEY", KEY, [f"127.0.0.1:{bound.port}"])
            policy = EgressPolicy.parse([f"127.0.0.1:{bound.port}", f"127.0.0.1:{free.port}"])
            proxy_url, process = serve(
                EgressProxy(policy, [secret], None, proxy_ca, "bench", upstream_trust)
            )
            direct = httpx.Client(verify=upstream_trust, trust_env=False, timeout=60)
            tunnel = httpx.Client(proxy=proxy_url, verify=upstream_trust, trust_env=False)
            terminated = httpx.Client(proxy=proxy_url, verify=guest_trust, trust_env=False)
            n = args.requests
            pid = process.pid

            def proxied(measure: Callable[[], float], per: int) -> tuple[float, float]:
                """(seconds, proxy CPU seconds per ``per`` requests) of one measurement."""
                before = cpu_seconds(pid)
                seconds = measure()
                return seconds, (cpu_seconds(pid) - before) / per

            with direct, tunnel, terminated:
                rows = [
                    (
                        "small completion, TLS terminated",
                        completion_seconds(direct, bound.url, KEY, n),
                        *proxied(lambda: completion_seconds(
                            terminated, bound.url, secret.placeholder, n), n + 1),
                    ),
                    (
                        "small completion, raw tunnel",
                        completion_seconds(direct, free.url, "-", n),
                        *proxied(lambda: completion_seconds(tunnel, free.url, "-", n), n + 1),
                    ),
                ]
                base = download_seconds(direct, free.url, size)
                downloads = [
                    (
                        f"{args.download_mib} MiB download, raw tunnel",
                        base,
                        *proxied(lambda: download_seconds(tunnel, free.url, size), 3),
                    ),
                    (
                        f"{args.download_mib} MiB download, TLS terminated",
                        base,
                        *proxied(lambda: download_seconds(terminated, bound.url, size), 3),
                    ),
                ]
            process.terminate()
            process.join()
    print(f"{'':40} {'direct':>10} {'proxy':>10} {'ratio':>7} {'added':>9} {'proxy CPU':>10}")
    for label, a, b, cpu in rows + downloads:
        print(f"{label:40} {a * 1e3:8.2f}ms {b * 1e3:8.2f}ms {b / a:6.2f}x {(b - a) * 1e3:7.2f}ms "
              f"{cpu * 1e3:8.2f}ms")
    for label, a, b, _ in downloads:
        print(f"{label}: {size / a / 2**20:.0f} MiB/s direct, {size / b / 2**20:.0f} MiB/s proxied")


if __name__ == "__main__":
    main()
