"""The main job's first and second run on an empty cache and store: wall times and phases.

    sudo python3 -P bench/quickstart_build.py [--out DIR] [--recipe R.toml] [--bundle R.toml ...]

Runs `forkd quickstart --yes --json` twice with FORKD_CACHE, FORKD_HOME, FORKD_RUN and
FORKD_CREDENTIALS in a fresh directory (``--out``, default /tmp/quickstart-bench-*), so
nothing the shared ~/.cache/forkd holds is used or touched. The first run returns once
its forks answered and leaves the bundled packs to a background job; the bench waits for
that job (and reports when it had published them all) before the second run. Every
build phase prints ``phase NAME: S s`` (forkd/engine/phases.py); this bench collects them
per recipe (the background job's too) and prints the phase table, the first and second
run's wall times (second/first as the ratio), the load average next to each, and each
bundled pack's stored size against its target.
Heavy: the first run builds every bundled recipe (minutes of CPU on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import suppress
from pathlib import Path

from forkd.engine.phases import LINE

# issue 11, "pack size": stored bytes a bundled pack must stay within (MiB)
SIZE_TARGETS_MIB = {"deeplethe/python-numpy": 60.0, "deeplethe/langgraph-react": 80.0}
PREFIX = re.compile(r"^\s*(?:\[(?:prefetch )?(?P<recipe>[\w.-]+)\] )?")


def load() -> str:
    return Path("/proc/loadavg").read_text().split()[0]


def run_once(env: dict[str, str], extra: list[str], log: Path) -> tuple[float, dict, list]:
    """One quickstart run: (wall seconds, its JSON report, [(recipe, phase, seconds)])."""
    t0 = time.monotonic()
    with log.open("w") as err:
        proc = subprocess.run(["forkd", "quickstart", "--yes", "--json", *extra], env=env,
                              stdout=subprocess.PIPE, stderr=err, text=True,
                              stdin=subprocess.DEVNULL, check=False)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        sys.exit(f"quickstart failed (exit {proc.returncode}); its output is in {log}")
    return wall, json.loads(proc.stdout), phases_of(log)


def phases_of(log: Path) -> list:
    phases = []
    for line in log.read_text().splitlines():
        prefix = PREFIX.match(line)
        assert prefix is not None
        m = LINE.search(line[prefix.end():])
        if m:
            phases.append((prefix.group("recipe") or "base", m.group("name"),
                           float(m.group("seconds"))))
    return phases


def wait_bundles(home: Path, since: float) -> float:
    """Seconds from ``since`` until the background job publishing the bundled packs is
    done (0: the run started none)."""
    state = home / "quickstart" / "bundles.json"
    if not state.exists():
        return 0.0
    while json.loads(state.read_text())["state"] == "running":
        time.sleep(0.5)
    got = json.loads(state.read_text())
    if got["state"] != "done":
        sys.exit(f"the background bundles job failed: {got['error']}")
    return time.monotonic() - since


def stored_bytes(env: dict[str, str], tag: str) -> int:
    """What a pack holds in the store (and sends): `forkd inspect`'s stored bytes, summed."""
    proc = subprocess.run(["forkd", "inspect", tag, "--json"], env=env, capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, check=True)
    components = json.loads(proc.stdout)["components"]
    return sum(int(c["stored_bytes"]) for c in components.values())


def table(first: list, second: list) -> None:
    recipes = list(dict.fromkeys(r for r, _, _ in first + second))
    names = list(dict.fromkeys(n for _, n, _ in first + second))

    def cell(rows: list, recipe: str, name: str) -> str:
        total = sum(s for r, n, s in rows if r == recipe and n == name)
        return f"{total:.1f}" if any(r == recipe and n == name for r, n, _ in rows) else "-"

    print("\nphase seconds (first run / second run; '-': not run)")
    print("| phase | " + " | ".join(recipes) + " |")
    print("|---|" + "---|" * len(recipes))
    for name in names:
        print(f"| {name} | " + " | ".join(
            f"{cell(first, r, name)} / {cell(second, r, name)}" for r in recipes) + " |")


def stop_hub(home: Path) -> None:
    state = home / "quickstart" / "hub" / "state.json"
    if state.exists():
        with suppress(ProcessLookupError):
            os.killpg(json.loads(state.read_text())["pid"], signal.SIGTERM)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--recipe", default=None, help="quickstart --recipe (default: its own)")
    ap.add_argument("--bundle", action="append", default=None,
                    help="quickstart --bundle (default: every bundled recipe)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="quickstart-bench-", dir="/tmp"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FORKD_CACHE": str(out / "cache"), "FORKD_HOME": str(out / "home"),
           "FORKD_RUN": str(out / "run"), "FORKD_CREDENTIALS": str(out / "credentials.json")}
    env.pop("FORKD_HUB", None)
    extra = (["--recipe", args.recipe] if args.recipe else []) + [
        a for b in (args.bundle or []) for a in ("--bundle", b)]
    try:
        load1 = load()
        t_first = time.monotonic()
        first_s, first, first_phases = run_once(env, extra, out / "first.log")
        load1_end = load()
        bundles_s = wait_bundles(out / "home", t_first)  # the catalog complete
        job_log = out / "home" / "quickstart" / "bundles.log"
        if first.get("bundles_log") and job_log.exists():
            first_phases += phases_of(job_log)
        load2 = load()
        second_s, second, second_phases = run_once(env, extra, out / "second.log")
        load2_end = load()
    finally:
        stop_hub(out / "home")
    table(first_phases, second_phases)
    print("\n| run | wall s | load before / after | vs first |")
    print("|---|---|---|---|")
    print(f"| first | {first_s:.1f} | {load1} / {load1_end} | 1.00x |")
    print(f"| second | {second_s:.1f} | {load2} / {load2_end} | {second_s / first_s:.3f}x |")
    if bundles_s:
        print(f"\nthe first run returned after {first_s:.1f} s; its background job had "
              f"published every bundled pack {bundles_s:.1f} s after the start")
    print("\n| pack | stored MiB | target MiB |")
    print("|---|---|---|")
    for b in second.get("bundled", []):
        mib = stored_bytes(env, f"{b['repository']}:latest") / (1 << 20)
        target = SIZE_TARGETS_MIB.get(b["repository"])
        print(f"| {b['repository']} | {mib:.1f} | {target if target else '-'} |")
    print(f"\nlogs: {out}/first.log, {out}/second.log; second run built "
          f"{[b['repository'] for b in second.get('bundled', []) if b['built']]}")


if __name__ == "__main__":
    main()
