"""A lazy server forked from the lazy fork's own process (``fork.Forked``): it starts
with the process's modules loaded, and nothing else of the process follows it. Its
locks and files are not held by the server, its exit handlers do not run twice, its
unwritten output is not written twice, and a process with another thread gets no fork.
Told a directory it serves it, logging there; told nothing (EOF) or cancelled it ends,
leaving no process and no log.

Each case runs in a process of its own, as ``forkd fork --lazy`` does (pytest's own
process may run threads of its fixtures).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PARENT = r'''
import atexit, fcntl, json, os, sys, threading, time
from pathlib import Path
from forkd.engine.lazy.fork import Forked

work, case = Path(sys.argv[1]), sys.argv[2]
held = os.open(work / "held.lock", os.O_RDWR | os.O_CREAT)
fcntl.flock(held, fcntl.LOCK_EX)
atexit.register(lambda: open(work / "atexit", "a").write(f"{os.getpid()}\n"))
sys.stdout.write("written before the fork\n")  # buffered: stdout is a pipe
out = {}
if case == "thread":
    stop = threading.Event()
    threading.Thread(target=stop.wait, daemon=True).start()
    out["forked"] = Forked.start() is not None
    stop.set()
else:
    server = Forked.start()
    assert server is not None, "no fork in a process with one thread"
    out["pid"], out["log"] = server.pid, str(server.log)
    os.close(held)  # this process lets go of its lock: nobody holds it now
    other = os.open(work / "held.lock", os.O_RDWR)
    deadline = time.monotonic() + 20  # the child lets go of its copy as it starts
    while True:
        try:
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            out["lock_free"] = True
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                out["lock_free"] = False
                break
            time.sleep(0.01)
    out["comm"] = Path(f"/proc/{server.pid}/comm").read_text().strip()
    out["alive"] = server.poll() is None  # it let go while it runs on, waiting to be told
    if case == "eof":
        server._close()
        out["code"] = server.wait()
    elif case == "cancel":
        server.cancel()
        out["code"] = server.returncode
    elif case == "dir":
        (work / "srv").mkdir()
        out["code"] = server.go(work / "srv").wait()
    out["log_left"] = server.log.exists()
print(json.dumps(out))
'''


def run(tmp_path: Path, case: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-P", "-c", PARENT, str(tmp_path), case],
                          capture_output=True, text=True, timeout=180,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines.count("written before the fork") == 1, done.stdout  # not again by the child
    result: dict[str, object] = json.loads(lines[-1])
    return result


def test_told_nothing_it_ends_holding_nothing_of_its_parent(tmp_path: Path) -> None:
    out = run(tmp_path, "eof")
    assert out["code"] == 0, out
    assert out["lock_free"] is True and out["alive"] is True, out  # not its parent's lock
    assert out["comm"] == "forkd-lazy", out  # what ps -e and pgrep show
    assert out["log_left"] is False, out
    ran = (tmp_path / "atexit").read_text().split()
    assert len(ran) == 1 and ran != [str(out["pid"])], ran  # the parent's, once


def test_cancelled_it_ends_and_leaves_no_log(tmp_path: Path) -> None:
    out = run(tmp_path, "cancel")
    assert out["code"] is not None and out["code"] != 0, out  # killed
    assert out["log_left"] is False, out
    assert not Path(f"/proc/{out['pid']}").exists()


def test_told_its_directory_it_serves_it_and_logs_there(tmp_path: Path) -> None:
    """Here a directory without a server.json: the server fails, and says so in the
    directory's server.log (not in the spawn log, which is gone), not on the parent's
    output."""
    out = run(tmp_path, "dir")
    assert out["code"] not in (None, 0), out
    assert out["log_left"] is False, out
    said = (tmp_path / "srv" / "server.log").read_text()
    assert "server.json" in said, said
    assert "written before the fork" not in said, said
    assert len((tmp_path / "atexit").read_text().splitlines()) == 1


def test_a_process_with_another_thread_gets_no_fork(tmp_path: Path) -> None:
    assert run(tmp_path, "thread") == {"forked": False}
