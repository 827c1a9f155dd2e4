"""The bundled packs published in the background: `forkd quickstart` hands the bundled
recipes that still need a build to ``python3 -m forkd.controller.bundles_job RECIPE...``
(detached, in ``$FORKD_HOME/quickstart``), so the main job (hub, base, push, pull, forks)
answers in about two minutes on a 2-core host while the catalog fills in behind it.

The job reuses the embedded hub, builds and publishes every recipe as
``quickstart.publish_bundled`` does, and keeps its state in ``bundles.json`` next to its
log ``bundles.log``::

    {"state": "running" | "done" | "failed", "pid": N, "repositories": [...],
     "bundled": [BundledReport, ...], "error": "..."}

A later `forkd quickstart` waits for a running job (following its log) before it looks at
the bundled packs, so two builds of one recipe never run at once; `forkd pull` of a pack
the job has not published yet says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

STATE, LOG = "bundles.json", "bundles.log"
POLL = 0.5  # seconds between looks at a running job


def _save(root: Path, state: dict[str, Any]) -> None:
    tmp = root / (STATE + ".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(root / STATE)


def start(root: Path, paths: list[Path], repositories: list[str]) -> Path:
    """Start the job on ``paths`` (their packs: ``repositories``); its log."""
    root.mkdir(parents=True, exist_ok=True)
    log = root / LOG
    with log.open("wb") as out:
        proc = subprocess.Popen(
            # -P and cwd: the installed forkd, never a checkout's forkd/ folder in the cwd
            [sys.executable, "-P", "-m", "forkd.controller.bundles_job",
             *[str(p.resolve()) for p in paths]],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=root)
    _save(root, {"state": "running", "pid": proc.pid, "repositories": repositories,
                 "bundled": [], "error": None})
    return log


def log_path(root: Path) -> Path:
    """The job's log."""
    return root / LOG


def status(root: Path) -> dict[str, Any] | None:
    """The job's state (None: none ever ran here); a job that died running is failed."""
    try:
        state: dict[str, Any] = json.loads((root / STATE).read_text())
    except (OSError, ValueError):
        return None
    if state.get("state") == "running" and not _alive(int(state.get("pid") or 0)):
        state["state"] = "failed"
        state["error"] = state.get("error") or f"the job ended without finishing; see {root / LOG}"
    return state


def _alive(pid: int) -> bool:
    from forkd.engine.qemu import pid_alive

    return pid > 0 and pid_alive(pid)


def wait(root: Path, say: Any) -> dict[str, Any] | None:
    """Until a running job ends, its new log lines to ``say``; its final state."""
    state = status(root)
    if state is None or state["state"] != "running":
        return state
    say(f"bundled packs: waiting for the background job (pid {state['pid']}, log "
        f"{root / LOG})")
    seen = 0
    while True:
        with (root / LOG).open("rb") as f:
            f.seek(seen)
            chunk = f.read()
        if b"\n" in chunk:
            upto = chunk.rindex(b"\n") + 1
            for line in chunk[:upto].decode(errors="replace").splitlines():
                say(f"  {line}")
            seen += upto
        state = status(root)
        if state is None or state["state"] != "running":
            return state
        time.sleep(POLL)


def pending_hint(root: Path, repository: str) -> str | None:
    """What to tell someone who pulls ``repository`` while the job still publishes it."""
    state = status(root)
    if state is None or state["state"] != "running":
        return None
    if repository not in state.get("repositories", []):
        return None
    done = {b["repository"] for b in state.get("bundled", [])}
    if repository in done:
        return None
    return (f"{repository} is still being built by `forkd quickstart` in the background "
            f"(log {root / LOG}); run `forkd quickstart --wait` to wait for it, then pull")


def main(paths: list[str]) -> int:
    from forkd.controller import quickstart as qs
    from forkd.engine import recipe as recipes
    from forkd.errors import ForkdError
    from forkd.store.store import Store

    store = Store.open()
    root = store.home / "quickstart"
    recipe_paths = [Path(p) for p in paths]
    # its own state from the start (what `start` wrote may come after this process began)
    state: dict[str, Any] = {
        "state": "running", "pid": os.getpid(), "bundled": [], "error": None,
        "repositories": [f"{qs.BUNDLED_NAMESPACE}/{recipes.load(p).name}" for p in recipe_paths]}
    _save(root, state)

    def say(message: str) -> None:
        print(message, flush=True)

    try:
        embedded = qs.embedded_hub(root / "hub", say)

        def published(report: qs.BundledReport) -> None:
            state["bundled"].append(asdict(report))
            _save(root, state)

        qs.publish_bundled(store, recipe_paths, embedded, say, published)
        state["state"] = "done"
        say("bundled packs: all published")
    except (ForkdError, OSError) as exc:
        state["state"], state["error"] = "failed", str(exc)
        say(f"bundled packs: failed: {exc}")
    _save(root, state)
    return 0 if state["state"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
