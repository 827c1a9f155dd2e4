"""deploy/systemd: the units pass `systemd-analyze verify` with no warning, start the real
CLI with flags and variables it knows, and their hardening holds against what the code
does (the controller's capabilities, the hub's MemoryDenyWriteExecute)."""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from deploy_support import (
    DEPLOY,
    REPO,
    controller_env_names,
    forkd_entry_point,
    hub_env_names,
    parse_args,
    setpriv_bounded,
    unit_bounding_set,
)
from net_support import free_port

SYSTEMD = DEPLOY / "systemd"
DOCUMENTED_FORKD = "/usr/local/bin/forkd"  # where the units expect the console script
UNITS = {"forkd.service": ("serve",), "forkd-hub.service": ("hub", "serve")}
ENV_FILES = {"forkd.service": "forkd.env", "forkd-hub.service": "forkd-hub.env"}
analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                             reason="systemd-analyze missing (apt-get install systemd)")


def unit_entries(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) of a unit file, in order (keys may repeat)."""
    out, section = [], ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=VALUE: {line!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def unit_values(text: str, key: str) -> list[str]:
    return [v for _, k, v in unit_entries(text) if k == key]


def verify_problems(unit: Path) -> list[str]:
    """What is wrong with a unit file: `systemd-analyze verify` failing or saying anything
    at all (it reports unknown keys and unparsable values as warnings, exit status 0), and
    capability names systemd does not know (which verify passes silently)."""
    p = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)],
                       capture_output=True, text=True, timeout=120, cwd=unit.parent)
    problems = [line for line in (p.stdout + p.stderr).splitlines() if line.strip()]
    if p.returncode != 0 and not problems:
        problems.append(f"systemd-analyze verify exited {p.returncode}")
    for key in ("CapabilityBoundingSet", "AmbientCapabilities"):
        for value in unit_values(unit.read_text(), key):
            for cap in value.lstrip("~").split():
                known = subprocess.run(["systemd-analyze", "capability", cap],
                                       capture_output=True, text=True, timeout=60)
                if known.returncode != 0:
                    problems.append(f"{key}: unknown capability {cap}")
    return problems


def installed_copy(unit: str, dest: Path, edit: tuple[str, str] | None = None) -> Path:
    """The unit with the documented /usr/local/bin/forkd replaced by the real entry point
    (verify checks that ExecStart's binary exists); ``edit`` replaces one more text."""
    text = (SYSTEMD / unit).read_text()
    assert DOCUMENTED_FORKD in text, f"{unit}: ExecStart must name {DOCUMENTED_FORKD}"
    text = text.replace(DOCUMENTED_FORKD, str(forkd_entry_point()))
    if edit is not None:
        assert edit[0] in text, f"{unit}: nothing to edit: {edit[0]!r}"
        text = text.replace(*edit)
    out = dest / unit
    out.write_text(text)
    return out


@analyze
@pytest.mark.parametrize("unit", sorted(UNITS))
def test_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    assert verify_problems(installed_copy(unit, tmp_path)) == []


BROKEN = {
    "unknown key": ("NoNewPrivileges=yes", "NoNewPrivilege=yes"),
    "bad value": ("RestrictRealtime=yes", "RestrictRealtime=maybe"),
    "missing binary": ("ExecStart=/", "ExecStart=/nonexistent/"),
    "unknown capability": ("CAP_SETGID", "CAP_SETGROUPS"),
}


@analyze
@pytest.mark.parametrize("what", sorted(BROKEN))
def test_verify_refuses_a_broken_unit(what: str, tmp_path: Path) -> None:
    unit = installed_copy("forkd.service", tmp_path, BROKEN[what])
    assert verify_problems(unit), f"a unit with an {what} passed"


@analyze
def test_hub_unit_exposure_is_low(tmp_path: Path) -> None:
    """`systemd-analyze security` scores the hub's sandboxing 0 (locked) to 10 (exposed):
    at most 2 ("OK"). The controller needs root's netns powers and scores higher."""
    unit = installed_copy("forkd-hub.service", tmp_path)
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=20",
                        str(unit)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-600:] + p.stderr
    (tmp_path / "weak").mkdir()
    weak = installed_copy("forkd-hub.service", tmp_path / "weak",
                          ("DynamicUser=yes", "DynamicUser=no"))
    weakened = weak.read_text()
    for key in ("PrivateDevices", "ProtectSystem", "ProtectHome", "PrivateUsers"):
        weakened = re.sub(rf"^{key}=.*$", "", weakened, flags=re.M)
    weak.write_text(weakened)
    p = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--threshold=20",
                        str(weak)], capture_output=True, text=True, timeout=120, cwd=weak.parent)
    assert p.returncode != 0, "the threshold check passes a weakened unit: it cannot fail"


def environment(unit: str) -> dict[str, str]:
    """The unit's Environment= assignments, then its example EnvironmentFile's (which
    systemd lets override them)."""
    env: dict[str, str] = {}
    for value in unit_values((SYSTEMD / unit).read_text(), "Environment"):
        for item in shlex.split(value):
            key, _, val = item.partition("=")
            env[key] = val
    env.update(env_file_examples(unit)[0])
    return env


def env_file_examples(unit: str) -> list[dict[str, str]]:
    """The example env file: its assignments, then one variant per commented example."""
    base: dict[str, str] = {}
    variants: list[tuple[str, str]] = []
    for line in (SYSTEMD / ENV_FILES[unit]).read_text().splitlines():
        m = re.fullmatch(r"(#\s*)?([A-Z][A-Z0-9_]*)=(.*)", line.strip())
        if m is None:
            continue
        if m.group(1):
            variants.append((m.group(2), m.group(3)))
        else:
            base[m.group(2)] = m.group(3)
    return [base, *({**base, k: v} for k, v in variants)]


def expand(exec_start: str, env: dict[str, str]) -> list[str]:
    """systemd's expansion of ExecStart: ``${VAR}`` one word, ``$VAR`` split on spaces."""
    words: list[str] = []
    for word in shlex.split(exec_start):
        whole = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
        if whole:
            words += env.get(whole.group(1), "").split()
            continue
        words.append(re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}",
                            lambda m: env.get(m.group(1), ""), word))
    return words


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_exec_start_is_a_real_command_line(unit: str) -> None:
    """ExecStart, with the unit's defaults and each example of its env file, parses with
    the real `forkd` command (unknown flags and bad values would raise)."""
    (exec_start,) = unit_values((SYSTEMD / unit).read_text(), "ExecStart")
    base = environment(unit)
    for example in env_file_examples(unit):
        argv = expand(exec_start, {**base, **example})
        assert argv[0] == DOCUMENTED_FORKD
        path = UNITS[unit]
        assert tuple(argv[1:1 + len(path)]) == path, argv
        parse_args(path, argv[1 + len(path):])


def test_a_wrong_flag_is_caught() -> None:
    from click import UsageError

    with pytest.raises(UsageError):
        parse_args(("hub", "serve"), expand("forkd hub serve --listen-on ${L}", {"L": ":5000"})[3:])


def test_env_file_names_are_real_settings() -> None:
    """Every variable the units and example env files set is read by forkd: a hub setting
    (docs/hub.md) for the hub, a FORKD_* name the package reads for the controller, or one
    the unit's own ExecStart expands."""
    readers = {"forkd.service": controller_env_names() - hub_only(),
               "forkd-hub.service": hub_env_names()}
    for unit, known in readers.items():
        exec_start = unit_values((SYSTEMD / unit).read_text(), "ExecStart")[0]
        expanded = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", exec_start))
        names = set(environment(unit)) | {k for e in env_file_examples(unit) for k in e}
        unknown = sorted(names - known - expanded)
        assert unknown == [], f"{unit}: {unknown} are not settings forkd reads"


def hub_only() -> set[str]:
    """The hub server's settings, which the controller never reads."""
    return {n for n in hub_env_names() if n.startswith("FORKD_HUB_")}


# -- the controller's capability set, tried on the engine's real operations --------------

def bounding_set() -> list[str]:
    return unit_bounding_set(SYSTEMD / "forkd.service")


PROBE = "deploy_caps_probe.py"


def run_probe(caps: list[str]) -> subprocess.CompletedProcess[str]:
    """tests/deploy_caps_probe.py as root with only ``caps`` in the bounding set, as
    systemd starts forkd.service (root, CapabilityBoundingSet)."""
    return subprocess.run(
        [*setpriv_bounded(caps), sys.executable, "-P", str(REPO / "tests" / PROBE)],
        capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def leftovers() -> list[str]:
    found = [str(p) for p in Path("/run/netns").glob("forkd-captest*")]
    found += [str(p) for p in Path("/sys/fs/cgroup").glob("**/forkd/forkd-captest*")]
    return found


probe_host = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None or shutil.which("tc") is None
    or shutil.which("iptables") is None or shutil.which("qemu-system-x86_64") is None,
    reason="needs root, setpriv, tc, iptables and QEMU")


@probe_host
def test_controller_capabilities_suffice() -> None:
    p = run_probe(bounding_set())
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr[-2000:]
    assert leftovers() == []


@probe_host
@pytest.mark.parametrize("cap", bounding_set())
def test_each_controller_capability_is_needed(cap: str) -> None:
    p = run_probe([c for c in bounding_set() if c != cap])
    assert p.returncode != 0, f"everything worked without CAP_{cap.upper()}: drop it"
    assert leftovers() == []


# -- the hub under MemoryDenyWriteExecute ----------------------------------------------

def writable_executable_maps(pid: int) -> list[str]:
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if re.match(r"\S+ .wx", line)]


def test_hub_maps_no_writable_executable_memory(tmp_path: Path) -> None:
    """MemoryDenyWriteExecute=yes refuses mappings both writable and executable: the
    hub, started by its console script, logging in (argon2), pushing and pulling a blob
    and serving metrics, has none (so the setting cannot break it on these paths)."""
    port = free_port()
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": "admin",
           "FORKD_HUB_ADMIN_PASSWORD": "admin-password-1"}
    hub = subprocess.Popen([str(forkd_entry_point()), "hub", "serve", "--data",
                            str(tmp_path / "hub"), "--listen", f"127.0.0.1:{port}"],
                           env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, hub)
        _exercise_hub(url)
        assert writable_executable_maps(hub.pid) == []
    finally:
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=30)
        except subprocess.TimeoutExpired:
            hub.kill()
            hub.wait(timeout=10)


def test_maps_check_sees_writable_executable_memory() -> None:
    """The check above can fail: a process that maps W+X memory is seen."""
    code = ("import mmap, sys; m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE"
            " | mmap.PROT_EXEC); print('mapped', flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mapped"
        assert writable_executable_maps(proc.pid) != []
    finally:
        proc.kill()
        proc.wait(timeout=10)


# -- the hub under its SystemCallFilter ------------------------------------------------

def syscall_groups() -> dict[str, list[str]]:
    """systemd's syscall groups (`systemd-analyze syscall-filter`): name → members."""
    out = subprocess.run(["systemd-analyze", "syscall-filter"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    groups: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        if line.startswith("@"):
            current = line.strip()
            groups[current] = []
        elif current and line.strip() and not line.strip().startswith("#"):
            groups[current].append(line.strip())
    return groups


def syscalls_of(names: list[str], groups: dict[str, list[str]]) -> set[str]:
    """Syscall names, with every @group expanded (groups nest)."""
    out: set[str] = set()
    for name in names:
        out |= syscalls_of(groups[name], groups) if name.startswith("@") else {name}
    return out


def filter_refuses(unit_text: str, used: set[str]) -> set[str]:
    """The syscalls of ``used`` that the unit's SystemCallFilter lines refuse (an allow
    list, then ``~`` deny lists, in order, as systemd applies them)."""
    groups = syscall_groups()
    allowed: set[str] | None = None
    for value in unit_values(unit_text, "SystemCallFilter"):
        deny = value.startswith("~")
        names = syscalls_of(value.lstrip("~").split(), groups)
        if deny:
            allowed = (allowed if allowed is not None else used) - names
        else:
            allowed = (allowed or set()) | names
    return used - (allowed if allowed is not None else used)


TRACE_LINE = re.compile(r"^\d+\s+([a-z0-9_]+)\((.*)")


def traced_calls(trace: Path) -> list[tuple[str, str]]:
    """(syscall, arguments) of an `strace -f -y` trace (fds shown with their paths)."""
    calls = []
    for line in trace.read_text(errors="replace").splitlines():
        m = TRACE_LINE.match(line)
        if m:
            calls.append((m.group(1), m.group(2)))
    return calls


def root_only(call: tuple[str, str]) -> bool:
    """A call the hub makes only because this test runs it as root: SQLite gives its
    journal, WAL and shm files the database's owner when its euid is 0 (os_unix.c,
    robustFchown); under DynamicUser it never is, and never calls fchown."""
    name, args = call
    return (os.geteuid() == 0 and name == "fchown"
            and re.match(r"\d+<[^>]*/hub\.db-(journal|wal|shm)>", args) is not None)


@analyze
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace missing (apt: strace)")
def test_hub_syscalls_pass_its_filter(tmp_path: Path) -> None:
    """Every syscall the hub makes (traced with strace through start, migrations, login,
    push, pull, metrics and stop) is one forkd-hub.service's SystemCallFilter allows."""
    trace = tmp_path / "strace.txt"
    port = free_port()
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": "admin",
           "FORKD_HUB_ADMIN_PASSWORD": "admin-password-1"}
    tracer = subprocess.Popen(
        ["strace", "-f", "-y", "-s", "0", "-o", str(trace), str(forkd_entry_point()),
         "hub", "serve", "--data", str(tmp_path / "hub"), "--listen", f"127.0.0.1:{port}"],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url, tracer)
        _exercise_hub(url)
        hub_pid = _only_child(tracer.pid)
        os.kill(hub_pid, signal.SIGTERM)
        tracer.wait(timeout=60)
    finally:
        if tracer.poll() is None:
            tracer.kill()
            tracer.wait(timeout=10)
    calls = [c for c in traced_calls(trace) if not root_only(c)]
    used = {name for name, _ in calls}
    assert {"openat", "socket", "accept4"} <= used, f"strace saw too little: {sorted(used)}"
    refused = filter_refuses((SYSTEMD / "forkd-hub.service").read_text(), used)
    assert refused == set(), f"the hub calls {sorted(refused)}, which its filter refuses"


@analyze
def test_filter_check_sees_a_refused_syscall() -> None:
    text = (SYSTEMD / "forkd-hub.service").read_text()
    assert filter_refuses(text, {"read", "chroot", "setrlimit"}) == {"chroot", "setrlimit"}
    assert not root_only(("fchown", "8</etc/passwd>, 0, 0"))
    assert not root_only(("fchownat", "8</var/lib/forkd-hub/hub.db-wal>, 0, 0"))


def _only_child(pid: int) -> int:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.05)
    raise AssertionError(f"process {pid} has no child")


def _exercise_hub(url: str) -> None:
    """Log in (argon2), push and pull a blob, read the metrics."""
    token = httpx.get(f"{url}/token", params={"scope": "repository:acme/app:pull,push"},
                      auth=("admin", "admin-password-1"), timeout=60).json()["token"]
    headers = {"Authorization": f"Bearer {token}"}
    blob = os.urandom(1 << 20)
    digest = "sha256:" + hashlib.sha256(blob).hexdigest()
    r = httpx.post(f"{url}/v2/acme/app/blobs/uploads/", params={"digest": digest},
                   content=blob, headers=headers, timeout=60)
    assert r.status_code == 201, r.text
    r = httpx.get(f"{url}/v2/acme/app/blobs/{digest}", headers=headers, timeout=60)
    assert r.content == blob
    assert httpx.get(f"{url}/metrics", timeout=60).status_code == 401  # site admins only
    metrics = httpx.get(f"{url}/metrics", auth=("admin", "admin-password-1"), timeout=60)
    assert metrics.status_code == 200




def _wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise AssertionError(f"the hub exited {proc.returncode}: {err[-2000:]}")
        try:
            if httpx.get(f"{url}/healthz", timeout=2).json() == {"status": "ok"}:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("the hub did not answer /healthz within 120 s")
