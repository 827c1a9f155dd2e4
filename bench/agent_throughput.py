"""Guest → host throughput of the agent, protocol v2 next to the old path, in one run.

One child of the tiny recipe (160 MiB RAM, a 64 MiB /tmp, 32 MiB free on its disk). For
each size it times, guest → host:

- **stdout, v2**: `exec_stream` of each producer (event frames of up to 1 MiB, spliced
  from the command's pipe into the port, while it runs): `yes | head -c SIZE` (two
  processes and a pipe), `head -c SIZE /dev/zero` (8 KiB writes), `dd bs=1M` (1 MiB
  writes), a python3 loop of `os.write` of a prebuilt 1 MiB buffer, and `cat` of a file
  already in the guest's page cache (/tmp is tmpfs);
- **alone**: each producer writing into a pipe that a trivial reader in the guest drains
  (`PRODUCER | cat > /dev/null`: any stdout passes through one pipe, so /dev/null would
  skip a copy the streamed figure pays). Streamed / alone near 1 says the producer, not
  the agent, is the limit; both share the guest's one vCPU;
- **file, v2**: a streamed `get` (1 MiB chunk events, sent from the page cache);
- **v1 form**: `yes | head` as a protocol-1 `exec` and the file as a protocol-1 `get`
  (the whole output or file in one reply line), up to 4 MiB (V1_MAX): the old path's
  figure. Past that the reply of a non-streamed exec still takes about five times the
  output in guest memory (docs/agent-protocol.md, "Limits").

With `--old-agent REV` it also builds a snapshot whose agent is engine/guest/agent.py at
git revision REV (the agent lives in the snapshot's memory) and times the same protocol-1
requests against that agent: today's figure before v2 (its write loop re-sliced its
buffer, quadratic: keep its sizes small with --old-sizes). No assertions; MB/s, with
the 1-minute load average (the machine may be shared).

    python -P bench/agent_throughput.py [--sizes 4,16,48] [--old-agent a10ab1f --old-sizes 1,4]
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
BENCH_FILE = "/tmp/bench.bin"  # the tiny guest's 64 MiB tmpfs (its disk has 32 MiB free)
V1_MAX = 4 << 20  # v1 forms up to here: see the module doc


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
    "dd bs=1M": "dd if=/dev/zero bs=1M count={mib} status=none",  # 1 MiB writes
    # the fast producers: a file already in the guest's page cache, and one process writing
    # a prebuilt 1 MiB buffer (python3's start is counted alike in both columns)
    "python3 os.write 1M": ("python3 -c 'import os; b = bytes(1 << 20); "
                            "[os.write(1, b) for _ in range({mib})]'"),
    "cat cached file": "cat " + BENCH_FILE,  # last: the file exists from here on
}
# The producer alone: the same command writing into a pipe that a trivial reader in the
# guest drains (any stdout passes through one pipe; /dev/null would skip that copy). When
# the streamed figure is close to this one, the producer, not the agent, is the limit.
ALONE = "{shell} | cat > /dev/null"


def _stdout(child_id: str, cmd: list[str], v2: bool) -> tuple[int, float]:
    """(bytes, seconds) of cmd's stdout: streamed (v2) or in the reply (v1 form)."""
    from forkd.engine import children as ch

    if not v2:
        return _timed(lambda: len(ch.exec_in(child_id, cmd)["stdout"]))
    got = [0]

    def count(b: bytes) -> None:
        got[0] += len(b)

    return _timed(lambda: (ch.exec_stream(child_id, cmd, on_stdout=count), got[0])[1])


def _alone(child_id: str, shell: str) -> float:
    """Seconds the producer takes writing into a pipe drained in the guest (a protocol-2
    exec whose stdout is empty: only the reply crosses to the host)."""
    from forkd.engine import children as ch

    cmd = ["sh", "-c", ALONE.format(shell=shell)]
    res: dict[str, object] = {}
    _, dt = _timed(lambda: len(str(res.setdefault("r", ch.exec_in(child_id, cmd)))))
    out = res["r"]
    assert isinstance(out, dict) and out["exit_code"] == 0, out
    return dt


def measure(child_id: str, size: int, *, v2: bool) -> dict[str, float]:
    from forkd.engine import children as ch

    out: dict[str, float] = {}
    for name, shell in STDOUT_WRITERS.items():
        if shell.startswith("cat "):  # tmpfs: written is in the page cache
            ch.exec_in(child_id, ["sh", "-c", f"head -c {size} /dev/urandom > {BENCH_FILE}"])
        if not v2 and name != "yes | head":
            continue  # the old path: one row is enough
        if not v2 and size > V1_MAX:
            continue  # a protocol-1 reply of n bytes takes ~5n of guest memory (see module doc)
        shell = shell.format(size=size, mib=size >> 20)
        n, dt = _stdout(child_id, ["sh", "-c", shell], v2)
        assert n == size, f"{name}: {n} of {size} bytes arrived"
        out[f"stdout {name}"] = _mbps(size, dt)
        if v2:
            out[f"alone {name}"] = _mbps(size, _alone(child_id, shell))
    if not v2:
        ch.exec_in(child_id, ["sh", "-c", f"head -c {size} /dev/urandom > {BENCH_FILE}"])
    with ch.agent(child_id) as a:
        if v2:
            n, dt = _timed(lambda: len(a.get(BENCH_FILE)))
        elif size <= V1_MAX:
            n, dt = _timed(lambda: len(a.get_v1(BENCH_FILE, timeout=600)))
        else:
            n, dt = size, float("nan")
    assert n == size, f"file: {n} of {size} bytes arrived"
    ch.exec_in(child_id, ["rm", "-f", BENCH_FILE])
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
    ap.add_argument("--sizes", default="4,16,48", help="MiB, comma-separated")
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
    print("stdout streamed (v2) next to the producer alone into a pipe drained in the guest; "
          "ratio = streamed / alone (near 1: the producer is the limit, not the agent)")
    print(f"{'size':>8} {'producer':<20} {'streamed':>9} {'alone':>9} {'ratio':>6}")
    for s in sizes:
        for name in STDOUT_WRITERS:
            streamed, alone = v2[s][f"stdout {name}"], v2[s][f"alone {name}"]
            print(f"{s >> 20:>5} MiB {name:<20} {streamed:>9.1f} {alone:>9.1f} "
                  f"{streamed / alone:>6.2f}")
    print(f"{'size':>8} {'file v2':>8} {'stdout v1 form':>15} {'file v1 form':>13}")
    for s in sizes:
        v1 = v1_form[s]
        print(f"{s >> 20:>5} MiB {v2[s]['file']:>8.1f} "
              f"{v1.get('stdout yes | head', float('nan')):>15.2f} {v1['file']:>13.2f}")
    print("v1 form: the same as protocol-1 replies (the whole output or file in one JSON line), "
          f"up to {V1_MAX >> 20} MiB")
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
