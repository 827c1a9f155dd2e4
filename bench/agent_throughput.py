"""Guest → host throughput of the agent, protocol v2 next to the old path, in one run.

One child of the tiny recipe. For each size it times, guest → host:

- **stdout, v2**: `exec_stream` of `yes | head -c SIZE` (event frames of up to 1 MiB,
  raw payloads spliced from the command's pipe into the port, while it runs); also
  with one writer, `head -c SIZE /dev/zero` (8 KiB writes) and `dd bs=1M` (1 MiB
  writes: the least guest CPU per byte written), and the writer alone (`yes | head -c SIZE
  > /dev/null` in the guest: the ceiling the producer itself puts on the stdout figure,
  both share the guest's one vCPU);
- **stdout, v1 form**: the same command as a protocol-1 `exec` (the whole output in one
  reply line);
- **file, v2**: a streamed `get` (1 MiB chunk events, sent from the page cache);
- **file, v1 form**: a protocol-1 `get` (the whole file in one reply; at most 32 MiB).

With `--old-agent REV` it also builds a snapshot whose agent is engine/guest/agent.py at
git revision REV (the agent lives in the snapshot's memory) and times the same protocol-1
requests against that agent: today's figure before v2 (its write loop re-sliced its
buffer, quadratic: keep its sizes small with --old-sizes). No assertions; MB/s and the
ratio to the old path, with the 1-minute load average (the machine may be shared).

    python -P bench/agent_throughput.py [--sizes 4,16,64] [--old-agent a10ab1f --old-sizes 1,4]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _mbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / 1e6 / seconds


def _timed(fn: Callable[[], int]) -> tuple[int, float]:
    t0 = time.monotonic()
    n = fn()
    return n, time.monotonic() - t0


STDOUT_WRITERS = {
    # printable bytes: a protocol-1 reply carries stdout as a JSON string, where a NUL
    # would take 6 bytes (\u0000)
    "yes | head": "yes | head -c {size}",  # two guest processes and a pipe between them
    "head /dev/zero": "head -c {size} /dev/zero",  # one writer, 8 KiB writes
    "dd bs=1M": "dd if=/dev/zero bs=1M count={mib} status=none",  # 1 MiB writes: cheapest
}


def _stdout(child_id: str, cmd: list[str], v2: bool) -> tuple[int, float]:
    """(bytes, seconds) of cmd's stdout: streamed (v2) or in the reply (v1 form)."""
    from forkd.engine import children as ch

    if not v2:
        return _timed(lambda: len(ch.exec_in(child_id, cmd)["stdout"]))
    got = [0]

    def count(b: bytes) -> None:
        got[0] += len(b)

    return _timed(lambda: (ch.exec_stream(child_id, cmd, on_stdout=count), got[0])[1])


def measure(child_id: str, size: int, *, v2: bool) -> dict[str, float]:
    from forkd.engine import children as ch

    out: dict[str, float] = {}
    for name, shell in STDOUT_WRITERS.items():
        if not v2 and (name != "yes | head" or size > 32 << 20):
            continue  # a protocol-1 reply holds at most 32 MiB of stdout
        n, dt = _stdout(child_id, ["sh", "-c", shell.format(size=size, mib=size >> 20)], v2)
        assert n == size, f"{n} of {size} bytes arrived"
        out[f"stdout {name}"] = _mbps(size, dt)
    if v2:  # the producer alone, its output dropped in the guest: the ceiling for stdout
        cmd = ["sh", "-c", f"{STDOUT_WRITERS['yes | head'].format(size=size)} > /dev/null"]
        _, dt = _timed(lambda: ch.exec_in(child_id, cmd)["exit_code"])
        out["yes | head > /dev/null"] = _mbps(size, dt)
    ch.exec_in(child_id, ["sh", "-c", f"head -c {size} /dev/urandom > /root/bench.bin"])
    with ch.agent(child_id) as a:
        if v2:
            n, dt = _timed(lambda: len(a.get("/root/bench.bin")))
        elif size <= 32 << 20:
            n, dt = _timed(lambda: len(a.get_v1("/root/bench.bin", timeout=600)))
        else:
            n, dt = size, float("nan")
    ch.exec_in(child_id, ["rm", "-f", "/root/bench.bin"])
    out["file"] = _mbps(size, dt)
    shown = ", ".join(f"{k} {v:.2f} MB/s" for k, v in out.items())
    print(f"  {'v2' if v2 else 'v1 form'} {size >> 20} MiB: {shown}", flush=True)
    return out


def one_child(tag: str, recipe_path: Path, sizes: list[int], forms: tuple[bool, ...],
              store_home: Path) -> dict[bool, dict[int, dict[str, float]]]:
    """Build tag, fork one child, time each size in each form (True: v2, False: v1)."""
    from forkd.engine import children as ch
    from forkd.engine import recipe
    from forkd.engine.build import build
    from forkd.store.store import Store

    store = Store.open(store_home)
    t0 = time.monotonic()
    build(store, recipe.load(recipe_path), tag)
    print(f"  {tag}: built in {time.monotonic() - t0:.0f} s", flush=True)
    child = ch.fork(store, tag, 1).children[0]
    try:
        return {v2: {s: measure(child.id, s, v2=v2) for s in sizes} for v2 in forms}
    finally:
        ch.kill(child.id, store)


def old_agent_run(rev: str, sizes: list[int], home: Path) -> dict[int, dict[str, float]]:
    """The same protocol-1 requests against the agent at git revision rev (built into its
    own snapshot: the host speaks protocol 1 to it)."""
    from forkd.engine import agent_client, build, children, image

    old = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:engine/guest/agent.py"],
                         capture_output=True, check=True).stdout
    saved = (image.agent_source, agent_client.PROTOCOL, build.PROTOCOL, children.PROTOCOL)
    image.agent_source = lambda: old
    agent_client.PROTOCOL = build.PROTOCOL = children.PROTOCOL = 1
    try:
        return one_child("bench-old-agent:v1", REPO / "recipes" / "tiny.toml", sizes,
                         (False,), home)[False]
    finally:
        (image.agent_source, agent_client.PROTOCOL, build.PROTOCOL,
         children.PROTOCOL) = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="4,16,64", help="MiB, comma-separated")
    ap.add_argument("--old-agent", default=None, metavar="REV",
                    help="also time the agent at this git revision (e.g. a10ab1f, protocol 1)")
    ap.add_argument("--old-sizes", default="1,4", help="MiB for the old agent (quadratic)")
    args = ap.parse_args()
    sizes = [int(s) << 20 for s in args.sizes.split(",")]
    base = Path(tempfile.mkdtemp(prefix="forkd-bench-agent-"))
    os.environ.setdefault("FORKD_HOME", str(base / "home"))
    os.environ.setdefault("FORKD_RUN", str(base / "run"))
    home = Path(os.environ["FORKD_HOME"])
    load_before = os.getloadavg()[0]
    print("guest → host throughput, MB/s (one tiny child, TCG or KVM as the host has)")
    both = one_child("bench-agent:v2", REPO / "recipes" / "tiny.toml", sizes, (True, False),
                     home)
    v2, v1_form = both[True], both[False]
    print(f"1-minute load average: {load_before:.2f} before, {os.getloadavg()[0]:.2f} after "
          f"({os.cpu_count()} CPUs, shared)")
    print(f"{'size':>8} {'stdout v2':>10} {'v1 form':>9} {'ratio':>6}   "
          f"{'file v2':>8} {'v1 form':>9} {'ratio':>6}   {'head /dev/zero':>14} "
          f"{'dd bs=1M':>9}   {'writer alone':>12}")
    for s in sizes:
        a, b = v2[s], v1_form[s]
        key = "stdout yes | head"
        old = b.get(key, float("nan"))
        print(f"{s >> 20:>5} MiB {a[key]:>10.1f} {old:>9.2f} {a[key] / old:>6.1f}   "
              f"{a['file']:>8.1f} {b['file']:>9.2f} {a['file'] / b['file']:>6.1f}   "
              f"{a['stdout head /dev/zero']:>14.1f} {a['stdout dd bs=1M']:>9.1f}   "
              f"{a['yes | head > /dev/null']:>12.1f}")
    print("stdout: `yes | head -c SIZE`; head /dev/zero, dd bs=1M: one writer (8 KiB, 1 MiB "
          "writes); writer alone: `yes | head -c SIZE > /dev/null` in the guest (the "
          "producer's own ceiling); v1 forms up to 32 MiB")
    if args.old_agent:
        old_sizes = [int(s) << 20 for s in args.old_sizes.split(",")]
        old = old_agent_run(args.old_agent, old_sizes, home)
        print(f"agent at {args.old_agent} (protocol 1), the same requests:")
        for s in old_sizes:
            o = old[s]
            ref = v2.get(s)
            ratio = (f"   v2 is {ref['stdout yes | head'] / o['stdout yes | head']:.0f}x stdout, "
                     f"{ref['file'] / o['file']:.0f}x file") if ref else ""
            print(f"{s >> 20:>5} MiB stdout {o['stdout yes | head']:>8.2f}   "
                  f"file {o['file']:>8.2f}{ratio}")


if __name__ == "__main__":
    main()
