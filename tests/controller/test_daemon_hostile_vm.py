"""Hostile review, round 3, against a real sandbox: the values that reached the guest agent
and came back as a 500 (a NUL in an argument, ``A=B`` as a variable name, a timeout of -1,
signal 99999, mode -1) are 400s naming what was wrong, and the sandbox goes on answering;
a read of ``/dev/zero`` (the guest sends up to 4 GiB) is streamed with the daemon's memory
bounded, and ends when its reader leaves.

One `forkd serve --listen` and one sandbox of the tiny recipe (killed at the end; the
module's env fixture kills whatever of its store is left)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from daemon_support import tcp_daemon

from forkd.engine import children as ch

TINY_TAG = "tiny:hostile"
TOKEN = "hostile-token-0123456789-0123456789-0123456789"
pytestmark = pytest.mark.vm
MIB = 1 << 20


def _daemon_pid(port: int) -> int:
    """The `forkd serve` this test started (a child of this process, on ``port``)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and f"127.0.0.1:{port}".encode() in cmdline:
            return int(entry.name)
    raise AssertionError(f"no forkd serve on port {port} among this test's children")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def sandbox(env: dict[str, str], tiny: str) -> Iterator[tuple[httpx.Client, str, int]]:
    with tcp_daemon(env, Path(env["FORKD_HOME"]) / "serve.log") as url:
        http = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"},
                            timeout=300)
        spawned = http.post("/v1/sandboxes", json={"tag": tiny})
        assert spawned.status_code == 201, spawned.text
        sid = spawned.json()["sandboxes"][0]["id"]
        try:
            yield http, sid, _daemon_pid(int(url.rsplit(":", 1)[1]))
        finally:
            assert http.delete(f"/v1/sandboxes/{sid}").status_code == 200
            http.close()
    assert [c.id for c in ch.list_children()] == []


def _refused(answer: httpx.Response, word: str) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["type"] == "InvalidInput" and word in answer.text, answer.text


def test_values_the_guest_cannot_take_are_400s_on_a_live_sandbox(
    sandbox: tuple[httpx.Client, str, int],
) -> None:
    http, sid, _pid = sandbox
    sb = f"/v1/sandboxes/{sid}"
    _refused(http.post(sb + "/exec", json={"argv": ["echo", "a\u0000b"]}), "NUL")
    _refused(http.post(sb + "/exec", json={"argv": ["env"], "env": {"A=B": "1"}}),
             "not a variable name")
    _refused(http.post(sb + "/exec", json={"argv": ["true"], "timeout": -1}), "timeout")
    _refused(http.post(sb + "/exec", json={"argv": ["true"], "timeout": 1e308}), "timeout")
    _refused(http.post(sb + "/eval", json={"code": "1", "timeout": 0}), "timeout")
    _refused(http.put(sb + "/files?path=/tmp/x&mode=-1", content=b"x"), "mode")
    started = http.post(sb + "/processes", json={"argv": ["sleep", "60"]})
    assert started.status_code == 201, started.text
    handle = started.json()["handle"]
    _refused(http.post(f"{sb}/processes/{handle}/kill", json={"signal": 99999}), "signal")
    killed = http.post(f"{sb}/processes/{handle}/kill", json={"signal": "TERM"})
    assert killed.status_code == 200 and killed.json()["signal"] == 15, killed.text
    ran = http.post(sb + "/exec", json={"argv": ["sh", "-c", "echo $A"], "env": {"A": "x=y"}})
    assert ran.status_code == 200 and ran.json()["stdout"] == "x=y\n", ran.text


def test_a_guest_file_is_streamed_and_an_endless_one_costs_the_daemon_little(
    sandbox: tuple[httpx.Client, str, int],
) -> None:
    http, sid, pid = sandbox
    sb = f"/v1/sandboxes/{sid}"
    data = os.urandom(3 * MIB + 17)
    assert http.put(sb + "/files?path=/tmp/blob", content=data).status_code == 204
    assert http.get(sb + "/files", params={"path": "/tmp/blob"}).content == data
    missing = http.get(sb + "/files", params={"path": "/tmp/none"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFound"
    before = _rss_mib(pid)
    peak = before
    got = 0
    with http.stream("GET", sb + "/files", params={"path": "/dev/zero"}) as endless:
        assert endless.status_code == 200
        for chunk in endless.iter_bytes():
            got += len(chunk)
            peak = max(peak, _rss_mib(pid))
            if got >= 256 * MIB:
                break
    assert got >= 256 * MIB
    assert peak - before < 128, f"the daemon grew {peak - before:.0f} MiB for a streamed read"
    ran = http.post(sb + "/exec", json={"argv": ["echo", "still here"]})
    assert ran.status_code == 200 and ran.json()["stdout"] == "still here\n", ran.text
    assert http.get(sb + "/files", params={"path": "/tmp/blob"}).content == data


def _qemus_of(sid: str) -> list[int]:
    """QEMU processes started in the sandbox's directory ($FORKD_RUN/children/ID)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.startswith(b"qemu-system") and f"/children/{sid}/".encode() in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("during", ["pause", "resume"])
def test_a_kill_during_a_pause_or_resume_leaves_nothing(
    sandbox: tuple[httpx.Client, str, int], env: dict[str, str], tiny: str, during: str
) -> None:
    """The kill waits for the pause or resume in flight, then removes what it left: no
    QEMU, no directory, no private tag of the sandbox in the store."""
    import threading
    import time

    http, _sid, _pid = sandbox
    spawned = http.post("/v1/sandboxes", json={"tag": tiny})
    assert spawned.status_code == 201, spawned.text
    sid = spawned.json()["sandboxes"][0]["id"]
    if during == "resume":
        assert http.post(f"/v1/sandboxes/{sid}/pause").status_code == 200
    answers: dict[str, httpx.Response] = {}

    def act() -> None:
        answers[during] = http.post(f"/v1/sandboxes/{sid}/{during}")

    acting = threading.Thread(target=act)
    acting.start()
    time.sleep(0.5)  # inside the pause's save or the resume's launch (seconds on TCG)
    killed = http.delete(f"/v1/sandboxes/{sid}")
    acting.join(300)
    assert killed.status_code == 200, killed.text
    assert answers[during].status_code in (200, 404, 409), answers[during].text
    assert sid not in {s["id"] for s in http.get("/v1/sandboxes").json()}
    assert not Path(env["FORKD_RUN"], "children", sid).exists()
    assert _qemus_of(sid) == [], f"QEMU of {sid} left running"
    refs = [s["ref"] for s in http.get("/v1/snapshots").json()]
    assert [r for r in refs if sid in r] == [], refs


def test_a_paused_sandboxs_saved_state_cannot_be_replaced_or_removed_through_the_api(
    sandbox: tuple[httpx.Client, str, int], tiny: str
) -> None:
    """Its private tag (forkd-paused/ID:a) is written only by its pause and removed only
    with it: a branch or compact onto it is a 400, a delete of it (or a cascade that would
    take it) a 409, and the sandbox resumes as it was."""
    http, other, _pid = sandbox
    spawned = http.post("/v1/sandboxes", json={"tag": tiny})
    assert spawned.status_code == 201, spawned.text
    sid = spawned.json()["sandboxes"][0]["id"]
    try:
        sb = f"/v1/sandboxes/{sid}"
        written = http.put(sb + "/files?path=/root/mark", content=b"before the pause")
        assert written.status_code == 204, written.text
        paused = http.post(sb + "/pause")
        assert paused.status_code == 200, paused.text
        saved = paused.json()["paused_tag"]
        asleep = http.post(sb + "/exec", json={"argv": ["true"]})
        assert asleep.status_code == 409 and "paused" in asleep.text, asleep.text
        branched = http.post(f"/v1/sandboxes/{other}/branch", json={"tag": saved, "force": True})
        _refused(branched, "forkd-paused/")
        _refused(http.post("/v1/compact", json={"ref": tiny, "to": saved}), "forkd-paused/")
        for path in (f"/v1/snapshots/{saved}", f"/v1/snapshots/{tiny}?cascade=true"):
            removed = http.delete(path)
            assert removed.status_code == 409, removed.text
            assert f"saved state of sandbox {sid}" in removed.text, removed.text
        assert http.post(sb + "/resume").status_code == 200
        read = http.get(sb + "/files", params={"path": "/root/mark"})
        assert read.content == b"before the pause", read.text
    finally:
        assert http.delete(f"/v1/sandboxes/{sid}").status_code == 200
    refs = [s["ref"] for s in http.get("/v1/snapshots").json()]
    assert tiny in refs and [r for r in refs if sid in r] == [], refs


def test_running_sandboxes_count_against_the_limit(
    sandbox: tuple[httpx.Client, str, int], tiny: str
) -> None:
    """A backend with a limit of 2 beside the module's running sandbox has room for one
    more, not two (nothing is started: the refused spawn never reaches a VM)."""
    from forkd.controller.api import SpawnRequest
    from forkd.controller.backend import LocalBackend
    from forkd.errors import Conflict

    _http, sid, _pid = sandbox
    backend = LocalBackend(max_sandboxes=2)
    assert sid in {c.id for c in ch.list_children() if c.status == "running"}
    with pytest.raises(Conflict, match=r"this daemon runs 1 .* its limit is 2"):
        backend.spawn(SpawnRequest(tag=tiny, n=2))


def test_a_cell_whose_client_left_is_interrupted_in_the_guest(
    sandbox: tuple[httpx.Client, str, int],
) -> None:
    """A run_code cell whose client went away ran on in the guest to its own timeout,
    holding the interpreter: the next cell of the sandbox waited behind it. Now the relay's
    cancel interrupts it, and the next cell answers at once."""
    http, sid, _ = sandbox
    sb = f"/v1/sandboxes/{sid}"
    with pytest.raises(httpx.ReadTimeout):  # the client leaves after 2 s
        http.post(sb + "/run_code", json={"code": "while True:\n    pass", "timeout": 600},
                  timeout=2)
    # Behind the abandoned cell (600 s) this would wait past its own 60 s (ReadTimeout);
    # answered in time, the abandoned cell was interrupted. (It also had to answer within
    # 20 s, a timing a loaded machine's slow guest can miss.)
    after = http.post(sb + "/run_code", json={"code": "6 * 7", "timeout": 60}, timeout=120)
    assert after.status_code == 200 and after.json()["value"] == 42, after.text
