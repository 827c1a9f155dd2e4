"""The QEMU process: argv, launch, shutdown, kill (construct ≠ launch).

One QemuVM owns one QEMU process and its files in one directory. A VM may
outlive the Python object that launched it (fork children do): `QemuVM.attach`
finds it again by pid and directory (engine/lifecycle.py does that for children).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from forkd.engine import hugepages, qcow2
from forkd.engine.errors import HostError, VMMError
from forkd.engine.paths import fits_sun_path
from forkd.engine.qmp import QMP
from forkd.names import inert

QEMU = os.environ.get("FORKD_QEMU", "qemu-system-x86_64")
QEMU_IMG = "qemu-img"
MACHINE = "microvm"
MACHINE_OPTS = "x-option-roms=off,rtc=on,pit=on,pic=on,isa-serial=on"
CPU_MODEL = "max"
SANDBOX = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
# With -runas QEMU drops to the user *after* installing the seccomp filter, so set*id must stay
# allowed; once it runs as that user there is no privilege left to elevate.
SANDBOX_RUNAS = "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny"


@functools.cache
def qemu_version() -> str:
    try:
        out = subprocess.run([QEMU, "--version"], capture_output=True, text=True, timeout=20,
                             stdin=subprocess.DEVNULL, check=False).stdout
    except FileNotFoundError as e:
        raise HostError(f"{QEMU} not found: apt-get install -y qemu-system-x86") from e
    m = re.search(r"version (\d+\.\d+(?:\.\d+)?)", out)
    if not m:
        raise HostError(f"cannot read the QEMU version from {out!r}")
    return m.group(1)


def host_tsc_khz() -> int | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return int(float(line.split(":")[1]) * 1000)
    return None


def qemu_environment() -> dict[str, str]:
    """What a QEMU child gets of the environment: PATH and the locale only. The daemon's
    own (its REST token, cloud credentials, a hub password) never reaches a process
    that runs a guest."""
    keep = ("PATH", "LANG", "LC_ALL", "TZ")
    return {k: os.environ[k] for k in keep if k in os.environ} or {"PATH": "/usr/bin:/bin"}


@dataclass(frozen=True)
class VMConfig:
    """Everything that shapes the QEMU command line of a template or a child."""

    memory_mib: int
    vcpus: int
    accel: str
    mem_path: Path
    share: bool  # True: template writes RAM into mem_path; False: copy-on-write child
    disk: Path  # qcow2 image
    disk_cache: str = "unsafe"
    kernel: Path | None = None  # cold boot only
    initrd: Path | None = None
    cmdline: str = ""
    incoming: bool = False  # child: wait for the device state
    sandbox: bool = False
    runas: str | None = None  # drop to this user after start-up (-runas)
    tap: str | None = None  # tap interface name (already in QEMU's netns)
    mac: str | None = None
    disk_bps: int | None = None  # QEMU's I/O throttling of the drive: bytes/s, read + write
    disk_iops: int | None = None  # and operations/s, read + write
    # False: QEMU's MADV_HUGEPAGE on guest RAM is made a no-op (hugepages.py): a memory
    # file produced on first access (a lazy child's) is then read a page at a time, not 4 MiB
    huge_page_advice: bool = True
    extra: tuple[str, ...] = field(default_factory=tuple)


def kernel_cmdline(accel: str, extra: str = "") -> str:
    parts = ["console=ttyS0", "quiet", "panic=-1", "ipv6.disable=1", "forkd.root=/dev/vda"]
    if accel == "tcg":
        # microvm has no HPET/PM timer: PIT calibration hangs ~15% of TCG cold boots.
        khz = host_tsc_khz()
        if khz:
            parts.append(f"tsc_early_khz={khz}")
    if extra:
        parts.append(extra)
    return " ".join(parts)


DISK_FDSET = 9
PR_SET_THP_DISABLE = 41


@functools.cache
def no_thp_for_children() -> bool:
    """Transparent huge pages off for the processes this one starts (the setting is inherited
    across fork and exec; it also applies to this process). QEMU madvises its TCG translation
    buffer MADV_HUGEPAGE, so with THP each child's translated code grows in 2 MiB steps: an idle
    child uses ~9 MiB of it but held 10 or 12 MiB. No-op where prctl is unavailable."""
    return prctl(PR_SET_THP_DISABLE, 1)


def prctl(option: int, arg: int) -> bool:
    """``prctl(option, arg)`` on this process (this thread's settings: PR_SET_PDEATHSIG,
    PR_SET_THP_DISABLE); False where it failed or libc has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(option, arg, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def build_argv(cfg: VMConfig, d: Path, disk_fds: tuple[int, ...] = (),
               tap_fd: int | None = None) -> list[str]:
    """The command line; with disk_fd the disk is opened by the host and passed in an fd set
    (an unprivileged QEMU re-opens its disk read-write when an incoming migration completes,
    and may not be able to reach the host path); with tap_fd QEMU uses that descriptor of
    its tap (netns.take_tap) instead of attaching the tap by name."""
    accel = cfg.accel
    disk = f"/dev/fdset/{DISK_FDSET}" if disk_fds else str(cfg.disk)
    for what, value in (("memory image", cfg.mem_path), ("VM directory", d), ("disk", disk),
                        ("kernel", cfg.kernel), ("initrd", cfg.initrd), ("tap", cfg.tap)):
        check_option_value(what, value)
    argv = [
        QEMU, "-accel", accel_option(accel),
        "-machine", f"{MACHINE},{MACHINE_OPTS},memory-backend=mem",
        "-cpu", CPU_MODEL, "-m", f"{cfg.memory_mib}M", "-smp", str(cfg.vcpus),
        "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
        "-object", (f"memory-backend-file,id=mem,size={cfg.memory_mib}M,"
                    f"mem-path={cfg.mem_path},share={'on' if cfg.share else 'off'}"),
        *serial_args(cfg, d),
        "-qmp", f"unix:{socket_arg(d, 'qmp.sock')},server=on,wait=off",
        "-device", "virtio-serial-device",
        "-chardev", f"socket,id=agent,path={socket_arg(d, 'agent.sock')},server=on,wait=off",
        "-device", "virtserialport,chardev=agent,name=agent",
        "-drive", f"id=d0,file={disk},format=qcow2,if=none,cache={cfg.disk_cache}"
                  + drive_throttling(cfg)
                  # QEMU locks through dups of the fd-set fds; the locks stay on the fd set's
                  # open files after the dups close, so the disk cannot be re-activated after
                  # a completed outgoing migration (live branch: `cont` fails "Failed to get
                  # write lock"). Each child owns its overlay; the host opened it for QEMU.
                  + (",file.locking=off" if disk_fds else ""),
        "-device", "virtio-blk-device,drive=d0",
        "-device", "virtio-rng-device",
        # device-state-only streams (xen-save-devices-state) carry no configuration section
        "-global", "migration.send-configuration=off",
    ]
    if cfg.tap:
        backend = (f"fd={tap_fd}" if tap_fd is not None
                   else f"ifname={cfg.tap},script=no,downscript=no")
        argv += ["-netdev", f"tap,id=n0,{backend}",
                 "-device", f"virtio-net-device,netdev=n0,mac={cfg.mac or '52:54:00:12:34:56'}"]
    if cfg.kernel is not None:
        argv += ["-kernel", str(cfg.kernel)]
        if cfg.initrd is not None:
            argv += ["-initrd", str(cfg.initrd)]
        argv += ["-append", cfg.cmdline]
    if cfg.incoming:
        argv += ["-incoming", "defer"]
    if cfg.sandbox:
        argv += ["-sandbox", SANDBOX_RUNAS if cfg.runas else SANDBOX]
    if cfg.runas:
        argv += ["-runas", cfg.runas]
    for fd in disk_fds:  # QEMU picks the fd whose access mode matches each open
        argv += ["-add-fd", f"fd={fd},set={DISK_FDSET},opaque=disk"]
    argv += list(cfg.extra)
    return argv


# TCG's translation cache per VM: QEMU's default is 1 GiB (mapped rwx, touched as the guest
# runs new code), so a guest that generates code (a JIT, or a loop writing distinct blocks)
# grew its QEMU by up to 1 GiB of host memory beyond its RAM, with no memory limit set.
# An idle child uses ~10 MiB of it (FINDINGS.md: 4 MiB thrashes).
TCG_TB_MIB = 128


def accel_option(accel: str) -> str:
    """The -accel value: TCG with its translation cache bounded at TCG_TB_MIB."""
    return f"tcg,tb-size={TCG_TB_MIB}" if accel == "tcg" else accel


SERIAL_RING = "serial0"
SERIAL_RING_BYTES = 1 << 20  # a child's console: the last MiB it wrote, in QEMU's memory
LOG_TAIL_BYTES = 64 << 10  # what log_tail reads of the end of a log file


def socket_arg(d: Path, name: str) -> str:
    """The path QEMU binds its socket ``d/name`` by: the whole path when it fits sun_path,
    else ``name``, relative to QEMU's working directory, which is ``d`` (QemuVM.launch):
    a long $FORKD_RUN with a child's id put the whole path past 108 bytes, and QEMU could
    not start ('UNIX socket path … is too long'). The host connects to either through
    paths.unix_address."""
    return str(d / name) if fits_sun_path(d / name) else name


def serial_args(cfg: VMConfig, d: Path) -> list[str]:
    """The console. A cold boot (a build: the recipe's own image) writes it to
    d/serial.log; a child's is a ring of SERIAL_RING_BYTES in QEMU (read over QMP by
    log_tail): root in a sandbox writes its console as fast as the CPU emulates port
    I/O, and a file grew on the host's disk without bound (the chardev is not part of
    the device state, so a child restores the same)."""
    if not cfg.incoming:
        return ["-serial", f"file:{d / 'serial.log'}"]
    return ["-chardev", f"ringbuf,id={SERIAL_RING},size={SERIAL_RING_BYTES}",
            "-serial", f"chardev:{SERIAL_RING}"]


def check_option_value(what: str, value: object) -> None:
    """A path or name that goes into a QEMU option value: QEMU splits option strings at
    commas (``,,`` is a literal one, except in ``-serial file:``), so a comma in it would
    end the value and start options of its own. Refused, not escaped: one rule for every
    option (the paths come from $FORKD_HOME, $FORKD_RUN and $FORKD_CACHE)."""
    if value is None:
        return
    text = str(value)
    if "," in text or "\n" in text or "\0" in text:
        raise HostError(f"the {what} {text!r} has a comma, newline or NUL, which QEMU's "
                        "option syntax cannot take; set FORKD_HOME, FORKD_RUN and "
                        "FORKD_CACHE to directories without them")


def drive_throttling(cfg: VMConfig) -> str:
    """-drive options of QEMU's block throttling (token buckets on the drive's requests)."""
    out = ""
    if cfg.disk_bps is not None:
        out += f",throttling.bps-total={cfg.disk_bps}"
    if cfg.disk_iops is not None:
        out += f",throttling.iops-total={cfg.disk_iops}"
    return out


def create_overlay(path: Path, backing: Path | str, backing_fmt: str,
                   size: int | None = None) -> None:
    """An empty qcow2 overlay on ``backing``: a file (made absolute: never move the backing
    file) or a QEMU URL such as an NBD export's ``nbd+unix:///NAME?socket=PATH``, whose
    ``size`` (the backing's, in bytes) must then be given; a file's is its length, read
    here. Written directly (engine/qcow2.py), not by starting qemu-img: nothing opens the
    backing, so an NBD export's server is not asked for anything."""
    spec = str(backing.resolve()) if isinstance(backing, Path) else backing
    if size is None and not isinstance(backing, Path):
        raise VMMError(f"an overlay on {spec} needs the backing's size")
    if size is None and backing_fmt != "raw":
        raise VMMError(f"the size of {backing} ({backing_fmt}) must be given")
    try:
        if size is None:
            size = Path(spec).stat().st_size
        qcow2.write_empty(path, spec, backing_fmt, size)
    except (OSError, ValueError) as e:
        raise VMMError(f"cannot create the overlay {path} on {spec}: {e}") from e


def unprivileged_user() -> str | None:
    """The user children's QEMU drops to: $FORKD_QEMU_USER (empty = none), else nobody (root)."""
    import pwd

    name = os.environ.get("FORKD_QEMU_USER", "nobody")
    if not name or os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(name)
    except KeyError:
        return None
    return name


def pid_alive(pid: int) -> bool:
    """True if pid exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def pid_matches(pid: int, d: Path) -> bool:
    """The pid is still the QEMU we started in directory d (guards against pid reuse): its
    command line names files in d (``d/qmp.sock``, not a directory whose name extends d's),
    or, when d is too long for its sockets' paths (socket_arg: they are named relative to
    it), it runs in d."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if (str(d).rstrip("/") + "/").encode() in cmd:
        return True
    if fits_sun_path(d / "agent.sock"):
        return False
    try:  # the same directory, however $FORKD_RUN reaches it (a symlink on the way)
        return os.path.samefile(f"/proc/{pid}/cwd", d)
    except OSError:
        return False


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


class QemuVM:
    """One QEMU process in its own directory. launch() starts it; shutdown()/kill() end it."""

    def __init__(self, d: Path, cfg: VMConfig | None, *, detach: bool = False,
                 netns: str | None = None) -> None:
        """cfg None: a process started elsewhere (see attach); it cannot be launched."""
        self.dir = d
        self.netns = netns
        self.cfg = cfg
        self.detach = detach
        self.argv = build_argv(cfg, d) if cfg is not None else []
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self.qmp: QMP | None = None

    @classmethod
    def attach(cls, d: Path, pid: int, *, qmp_timeout: float = 2.0) -> QemuVM:
        """The QEMU of directory d started by another process (a child's record names its
        pid). alive() then also checks that the pid is still that QEMU (pid reuse); QMP is
        connected when it answers (shutdown() then asks it to quit before SIGKILL)."""
        vm = cls(d, None)
        vm.pid = pid
        if vm.alive():
            with contextlib.suppress(VMMError):
                vm.qmp = QMP(d / "qmp.sock", timeout=qmp_timeout, alive=vm.alive)
        return vm

    @property
    def log_path(self) -> Path:
        return self.dir / "qemu.log"

    def launch(self, *, qmp_timeout: float = 30.0) -> None:
        if self.pid is not None or self.cfg is None:
            raise VMMError("VM already launched")
        self.dir.mkdir(parents=True, exist_ok=True)
        for f in ("qmp.sock", "agent.sock"):
            (self.dir / f).unlink(missing_ok=True)
        disk_fds: tuple[int, ...] = ()
        if self.cfg.runas:
            disk_fds = (os.open(self.cfg.disk, os.O_RDONLY), os.open(self.cfg.disk, os.O_RDWR))
        tap_fd: int | None = None
        enter = contextlib.nullcontext()
        if self.netns is not None:
            from forkd.engine.netns import entered, take_tap

            enter = entered(self.netns)  # type: ignore[assignment]
            if self.cfg.tap:
                tap_fd = take_tap(self.netns)
        passed = disk_fds + ((tap_fd,) if tap_fd is not None else ())
        if self.cfg.accel == "tcg":  # under KVM, huge pages back guest RAM: keep them
            no_thp_for_children()
        try:
            if passed:
                self.argv = build_argv(self.cfg, self.dir, disk_fds, tap_fd)
            with self.log_path.open("ab") as log, enter:
                argv = (self.argv if self.cfg.huge_page_advice
                        else hugepages.without_advice(self.argv))
                self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, close_fds=True,
                                             pass_fds=passed, env=qemu_environment(),
                                             cwd=self.dir,  # its sockets' paths (socket_arg)
                                             start_new_session=self.detach)
        except FileNotFoundError as e:
            raise HostError(f"{QEMU} not found: apt-get install -y qemu-system-x86") from e
        finally:
            for fd in passed:
                os.close(fd)
        self.pid = self.proc.pid
        try:
            self.qmp = QMP(self.dir / "qmp.sock", timeout=qmp_timeout, alive=self.alive)
        except VMMError as e:
            self.kill()
            raise VMMError(f"QEMU failed to start: {e}\n{self.log_tail()}") from e

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and pid_alive(self.pid) and pid_matches(self.pid, self.dir)

    def log_tail(self, n: int = 12) -> str:
        """The end of QEMU's log and the serial console's, and how QEMU ended if it did."""
        out = []
        code = self.proc.poll() if self.proc is not None else None
        if code is not None:
            out.append(f"--- QEMU ended: {_ending(code)}")
        for p in (self.log_path, self.dir / "serial.log"):
            with contextlib.suppress(OSError):
                lines = _file_tail(p).splitlines()[-n:]
                if lines:
                    out.append(f"--- {p.name}:\n" + "\n".join(lines))
        if self.qmp is not None and self.alive():
            with contextlib.suppress(VMMError):
                # the ring is read from its oldest byte: all of it, for its end
                ring = self.qmp.command("ringbuf-read", {"device": SERIAL_RING, "size":
                                                         SERIAL_RING_BYTES, "format": "utf8"},
                                        timeout=5)
                lines = str(ring)[-LOG_TAIL_BYTES:].splitlines()[-n:]
                if lines:
                    out.append("--- console:\n" + "\n".join(lines))
        return inert("\n".join(out))  # the guest wrote the console: shown, never obeyed

    def shutdown(self, timeout: float = 5.0) -> None:
        """QMP quit → wait → SIGKILL → wait. Safe to call twice."""
        if self.pid is None:
            return
        if self.alive() and self.qmp is not None:
            with contextlib.suppress(VMMError):
                self.qmp.command("quit", timeout=timeout)
        self._wait(timeout)
        self.kill()

    def _wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def kill(self) -> None:
        if self.qmp is not None:
            self.qmp.close()
            self.qmp = None
        if self.pid is None:
            return
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        else:
            self._wait(10)
            _reap(self.pid)


def _file_tail(p: Path) -> str:
    """The last LOG_TAIL_BYTES of file p as text (a log is never read whole)."""
    with p.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(0, size - LOG_TAIL_BYTES))
        return f.read(LOG_TAIL_BYTES).decode(errors="replace")


def _ending(code: int) -> str:
    """A process's return code in words (a negative one is the signal that killed it)."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"
