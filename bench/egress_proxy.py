"""The egress proxy's cost, as ratios measured in one run: through the proxy vs direct.

Two stand-in model servers (HTTPS, certificates from a throw-away CA) run on loopback:
one bound to a secret (the proxy terminates TLS, swaps the placeholder, re-encrypts),
one only allowed (the proxy tunnels raw bytes). The stand-ins answer at once, so the
difference is the proxy's own cost. For a small chat completion (keep-alive clients,
--requests pairs) and a --download-mib download (best of 3 pairs) it prints the time
from the host directly and through the proxy, their ratio and the milliseconds the proxy
adds. Direct and proxied requests alternate (one of each per pair), so a load change on
the shared machine hits both sides alike; for a completion the ratio is of the medians
and "added" the median of the per-pair differences, for a download both are of the best
of each side. Target: a small completion within 1.2x of direct.
No assertions. It also prints the proxy process's CPU time (user + system) per proxied
request or download, which swings much less with the load than wall-clock figures, and
the 1-minute load average before and after. The proxy runs on the event loop the
proxy process uses (proxy.new_event_loop).

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
from forkd.engine.egress.proxy import new_event_loop
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

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(forever())


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def load_average() -> float:
    return os.getloadavg()[0]


Timed = Callable[[], float]


def paired(direct: Timed, proxied: Timed, n: int) -> tuple[list[float], list[float]]:
    """n direct and n proxied timings, alternating (the first of each is a warm-up)."""
    direct(), proxied()
    a, b = [], []
    for _ in range(n):
        a.append(direct())
        b.append(proxied())
    return a, b


def completion(client: httpx.Client, base: str, key: str) -> Timed:
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{base}/v1/chat/completions"

    def once() -> float:
        start = time.perf_counter()
        client.post(url, json=CHAT, headers=headers).raise_for_status()
        return time.perf_counter() - start

    return once


def download(client: httpx.Client, base: str, size: int) -> Timed:
    def once() -> float:
        start = time.perf_counter()
        got = 0
        with client.stream("GET", f"{base}/download?bytes={size}") as r:
            r.raise_for_status()
            for chunk in r.iter_raw(1 << 16):
                got += len(chunk)
        if got != size:
            raise SystemExit(f"download returned {got} bytes, not {size}")
        return time.perf_counter() - start

    return once


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

            def row(label: str, host: Timed, via_proxy: Timed, n: int, best: bool
                    ) -> tuple[str, float, float, float, float]:
                """(label, direct s, proxied s, added s, proxy CPU s per proxied request)."""
                before = cpu_seconds(pid)
                a, b = paired(host, via_proxy, n)
                cpu = (cpu_seconds(pid) - before) / (n + 1)
                if best:  # a download: best of each side
                    return label, min(a), min(b), min(b) - min(a), cpu
                added = statistics.median(y - x for x, y in zip(a, b, strict=True))
                return label, statistics.median(a), statistics.median(b), added, cpu

            with direct, tunnel, terminated:
                load_before = load_average()
                rows = [
                    row("small completion, TLS terminated", completion(direct, bound.url, KEY),
                        completion(terminated, bound.url, secret.placeholder), n, best=False),
                    row("small completion, raw tunnel", completion(direct, free.url, "-"),
                        completion(tunnel, free.url, "-"), n, best=False),
                ]
                downloads = [
                    row(f"{args.download_mib} MiB download, raw tunnel",
                        download(direct, free.url, size), download(tunnel, free.url, size),
                        3, best=True),
                    row(f"{args.download_mib} MiB download, TLS terminated",
                        download(direct, free.url, size), download(terminated, bound.url, size),
                        3, best=True),
                ]
                load_after = load_average()
            process.terminate()
            process.join()
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after "
          f"({os.cpu_count()} CPUs, shared)")
    print(f"{'':40} {'direct':>10} {'proxy':>10} {'ratio':>7} {'added':>9} {'proxy CPU':>10}")
    for label, a, b, added, cpu in rows + downloads:
        print(f"{label:40} {a * 1e3:8.2f}ms {b * 1e3:8.2f}ms {b / a:6.2f}x "
              f"{added * 1e3:7.2f}ms {cpu * 1e3:8.2f}ms")
    for label, a, b, _, _ in downloads:
        print(f"{label}: {size / a / 2**20:.0f} MiB/s direct, {size / b / 2**20:.0f} MiB/s proxied")


if __name__ == "__main__":
    main()
