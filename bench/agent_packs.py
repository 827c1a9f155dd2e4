#!/usr/bin/env python3
"""langgraph-react next to python-numpy, one run: pull from an embedded hub + the first
child answering, and branch → three grandchildren ready (issue 12, item 9).

Both recipes are built into a publisher store (cached by their content: a second run only
re-tags) and pushed to a `forkd hub serve` on loopback. Then, per pack, in an empty store:

- **pull + first answer**: pull the pack from the hub, fork one child, first eval answered
  (for langgraph-react: the compiled graph's node names, from the guest's memory);
- **branch → 3 ready**: branch that child (live) and fork three grandchildren from the
  branch, until all three are ready (their agents answered the engine's fixup).

Prints each figure for both packs and the ratio langgraph-react / python-numpy: the price
of the bigger pack and of its network device (a netns + tap per child), with the 1-minute
load average around each measurement. Needs root; not a pass/fail test; the machine is
shared, so read one run as one sample.

    sudo python bench/agent_packs.py [--publisher-home DIR] [--json]

--publisher-home: a store that already holds the builds (they are cached by recipe
content per store: a fresh store builds both, ~5 min at best under TCG).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from forkd.engine import children as ch
from forkd.engine import recipe
from forkd.engine.branch import branch
from forkd.engine.build import build
from forkd.registry.client import RegistryClient
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_remote
from forkd.registry.transfer import pull, push
from forkd.store.store import Store

REPO = Path(__file__).resolve().parents[1]
PACKS = {
    "python-numpy": (REPO / "recipes" / "python-numpy.toml", "numpy.__version__"),
    "langgraph-react": (REPO / "recipes" / "langgraph-react" / "recipe.toml",
                        "sorted(travel_agent.GRAPH.get_graph().nodes)"),
}
ADMIN = "bench"
SECRET = secrets.token_urlsafe(16)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def embedded_hub(data: Path) -> Iterator[Hub]:
    """`forkd hub serve` on loopback (SQLite + filesystem blobs), admin ADMIN."""
    port = free_port()
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": ADMIN, "FORKD_HUB_ADMIN_PASSWORD": SECRET}
    proc = subprocess.Popen(["forkd", "hub", "serve", "--data", str(data), "--listen",
                             f"127.0.0.1:{port}"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the embedded hub did not come up")
            time.sleep(0.1)
        yield Hub(f"127.0.0.1:{port}", "http")
    finally:
        proc.terminate()
        proc.wait(10)


def eval_ok(child_id: str, code: str) -> object:
    r = ch.eval_in(child_id, code, timeout=300)
    if r.get("error"):
        raise RuntimeError(f"eval in {child_id} failed: {r['error'].get('message')}")
    return r.get("value")


def measure(name: str, hub: Hub, client: RegistryClient, work: Path) -> dict[str, float]:
    """Pull + fork + first answer, then branch → 3 grandchildren ready, in a fresh store."""
    store = Store.open(work / f"consumer-{name}")
    remote = parse_remote(f"{hub}/bench/{name}:latest")
    probe = PACKS[name][1]
    started: list[str] = []
    out: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        pull(store, remote, client, local=f"{name}:pulled")
        out["pull_s"] = time.perf_counter() - t0
        child = ch.fork(store, f"{name}:pulled", 1).children[0]
        started.append(child.id)
        eval_ok(child.id, probe)
        out["pull_first_answer_s"] = time.perf_counter() - t0
        out["fork_first_answer_s"] = out["pull_first_answer_s"] - out["pull_s"]
        t1 = time.perf_counter()
        res = branch(store, child.id, f"{name}:branch")
        out["branch_pause_ms"] = res.pause_ms
        kids = ch.fork(store, f"{name}:branch", 3)
        started.extend(c.id for c in kids.children)
        if len(kids.children) != 3:
            raise RuntimeError(f"{name}: grandchildren failed: {kids.errors}")
        out["branch_to_3_ready_s"] = time.perf_counter() - t1
        out["stored_mib"] = store.inspect(f"{name}:pulled")["stored_bytes"] / 2**20
    finally:
        for cid in started:
            ch.kill(cid, store)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--publisher-home", type=Path, default=None,
                    help="store to build into (default: a fresh one in the work directory)")
    o = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forkd-agent-bench-"))
    os.environ.setdefault("FORKD_RUN", str(work / "run"))
    results: dict[str, dict[str, float]] = {}
    load: list[float] = []  # 1-minute load average before each pack's measurement
    try:
        publisher = Store.open(o.publisher_home or work / "publisher")
        for name, (path, _) in PACKS.items():
            b = build(publisher, recipe.load(path), f"{name}:latest")
            print(f"built {name}{' (cached)' if b.cached else ''}", flush=True)
        with embedded_hub(work / "hub") as hub, \
                RegistryClient(hub, Credential(ADMIN, SECRET)) as client:
            for name in PACKS:
                push(publisher, f"{name}:latest", parse_remote(f"{hub}/bench/{name}:latest"),
                     client)
            for name in PACKS:
                load.append(os.getloadavg()[0])
                results[name] = measure(name, hub, client, work)
            load.append(os.getloadavg()[0])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, agent = results["python-numpy"], results["langgraph-react"]
    rows = [("stored", "stored_mib", "MiB"), ("pull", "pull_s", "s"),
            ("fork + first answer", "fork_first_answer_s", "s"),
            ("pull + first answer", "pull_first_answer_s", "s"),
            ("branch pause", "branch_pause_ms", "ms"),
            ("branch → 3 grandchildren ready", "branch_to_3_ready_s", "s")]
    print(f"1-minute load average: {load[0]:.2f} before python-numpy, {load[1]:.2f} before "
          f"langgraph-react, {load[2]:.2f} after ({os.cpu_count()} CPUs, shared)")
    print(f"{'':32} {'python-numpy':>14} {'langgraph-react':>16} {'ratio':>7}")
    for label, key, unit in rows:
        ratio = agent[key] / base[key] if base[key] else float("nan")
        print(f"{label:32} {base[key]:10.2f} {unit:3} {agent[key]:12.2f} {unit:3} "
              f"{ratio:6.2f}x")
    if o.json:
        print(json.dumps({**results, "load_average_1m": load}, indent=1))


if __name__ == "__main__":
    main()
