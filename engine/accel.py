"""Accelerator verdict: does /dev/kvm run guest code at native speed, or use TCG?

The probe runs a counted loop in a tiny real-mode guest through raw KVM ioctls
(no QEMU, nothing booted) in a child process with a deadline. Native or nested
VMX/SVM KVM finishes 200,000 iterations in well under 10 ms; a nested
paravirtual KVM (kvm_pvm) emulates stock guest code and takes hundreds of ms,
where a stock kernel crawls: TCG is the better choice there.

The child runs this very file as a script in isolated mode (``python -I -S
accel.py``): it depends neither on the working directory nor on how forkd is
installed, so this module imports only the standard library at its top level.

A verdict says how it was reached (``outcome``):

- ``measured``: the probe guest ran; kvm at native speed, else tcg. The only
  verdict cached (per host boot, ``$FORKD_RUN/accel.json``).
- ``failed``: the probe child could not run, crashed, timed out or reported no
  valid measurement. This run uses tcg; the next run probes again.
- ``forced``: ``FORKD_ACCEL=kvm|tcg`` chose; nothing probed.
- ``no-kvm``: no usable /dev/kvm (missing or not accessible): tcg.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import math
import mmap
import os
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

ITERATIONS = 200_000
NATIVE_LIMIT_S = 0.020  # faster than this = native-speed KVM
DEADLINE_S = 5.0
FAILED_RETRY_S = 60.0  # a process probes again this long after a failed probe
ACCELS = ("kvm", "tcg")
OUTCOMES = ("measured", "failed", "forced", "no-kvm")
FORCE_ENV = "FORKD_ACCEL"
# The interpreter that runs the probe child (default: this one). For tests and hosts
# where the running interpreter cannot be re-executed.
PROBE_PYTHON_ENV = "FORKD_ACCEL_PROBE_PYTHON"
CACHE_FORMAT = 2  # accel.json written by older forkd (which cached failed probes) is ignored

_KVM_GET_API_VERSION, _KVM_CREATE_VM, _KVM_GET_VCPU_MMAP_SIZE = 0xAE00, 0xAE01, 0xAE04
_KVM_CREATE_VCPU, _KVM_RUN = 0xAE41, 0xAE80
_KVM_SET_USER_MEMORY_REGION = 0x4020AE46
_KVM_GET_SREGS, _KVM_SET_SREGS, _KVM_SET_REGS = 0x8138AE83, 0x4138AE84, 0x4090AE82
_KVM_EXIT_IO, _KVM_EXIT_HLT = 2, 5


@dataclass(frozen=True)
class AccelVerdict:
    accel: str  # what this run uses: "kvm" or "tcg"
    outcome: str  # how it was decided: one of OUTCOMES
    reason: str
    kvm_device: bool
    kvm_pvm: bool
    probe_ms: float | None  # the measurement (outcome "measured" only)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _probe_loop(iterations: int) -> float:
    """Seconds the KVM guest loop took (runs in the probe child process)."""
    kvm = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    if fcntl.ioctl(kvm, _KVM_GET_API_VERSION) != 12:
        raise OSError("unexpected KVM API version")
    vm = fcntl.ioctl(kvm, _KVM_CREATE_VM, 0)
    mem = mmap.mmap(-1, 0x10000, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                    mmap.PROT_READ | mmap.PROT_WRITE)
    # mov ecx, N ; l: dec ecx ; jnz l ; mov al, 42 ; out 0x10, al ; hlt
    code = b"\x66\xb9" + struct.pack("<I", iterations) + b"\x66\x49\x75\xfc\xb0\x2a\xe6\x10\xf4"
    mem[0x1000:0x1000 + len(code)] = code
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mem))
    fcntl.ioctl(vm, _KVM_SET_USER_MEMORY_REGION, struct.pack("<IIQQQ", 0, 0, 0, 0x10000, addr))
    vcpu = fcntl.ioctl(vm, _KVM_CREATE_VCPU, 0)
    size = fcntl.ioctl(kvm, _KVM_GET_VCPU_MMAP_SIZE, 0)
    run = mmap.mmap(vcpu, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    sregs = bytearray(312)
    fcntl.ioctl(vcpu, _KVM_GET_SREGS, sregs)
    struct.pack_into("<QIH", sregs, 0, 0, 0xFFFF, 0)
    fcntl.ioctl(vcpu, _KVM_SET_SREGS, bytes(sregs))
    regs = bytearray(144)
    struct.pack_into("<Q", regs, 16 * 8, 0x1000)
    struct.pack_into("<Q", regs, 17 * 8, 0x2)
    fcntl.ioctl(vcpu, _KVM_SET_REGS, bytes(regs))
    start = time.perf_counter()
    while True:
        fcntl.ioctl(vcpu, _KVM_RUN, 0)
        reason = struct.unpack_from("<I", run, 8)[0]
        if reason == _KVM_EXIT_HLT:
            return time.perf_counter() - start
        if reason != _KVM_EXIT_IO:
            raise OSError(f"unexpected KVM exit reason {reason}")


def forced_accel() -> str | None:
    """The accelerator FORKD_ACCEL forces (None: unset or empty, the probe decides)."""
    value = os.environ.get(FORCE_ENV, "")
    if not value:
        return None
    if value not in ACCELS:
        from forkd.engine.errors import HostError  # not at the top: the probe child is stdlib only

        raise HostError(f"{FORCE_ENV}={value!r} is not an accelerator: set it to kvm or "
                               "tcg, or unset it to let the probe decide")
    return value


def probe_command(iterations: int = ITERATIONS) -> list[str]:
    """The probe child's argv: this file run isolated from every import-path setting.

    -I: neither the working directory nor the script's folder on sys.path, no PYTHON*
    variables, no user site; -S: no site-packages (.pth files, sitecustomize) either."""
    python = os.environ.get(PROBE_PYTHON_ENV) or sys.executable
    return [python, "-I", "-S", str(Path(__file__).resolve()), str(iterations)]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _is_duration(x: object) -> bool:
    """A positive, finite number of (milli)seconds (JSON true/false are not numbers here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _measure(deadline_s: float) -> tuple[float | None, str]:
    """Run the probe child: (milliseconds, "") or (None, why it could not measure)."""
    argv = probe_command()
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=deadline_s,
                           stdin=subprocess.DEVNULL, cwd="/", check=False)
    except subprocess.TimeoutExpired:
        return None, f"the probe child did not report within {deadline_s:g} s"
    except OSError as e:
        return None, f"the probe child could not start ({argv[0]}: {e.strerror or e})"
    if p.returncode != 0:
        detail = _last_line(p.stderr) or _last_line(p.stdout) or "no output"
        return None, f"the probe child exited with status {p.returncode}: {detail}"
    try:
        seconds = json.loads(p.stdout)["seconds"]
    except (ValueError, KeyError, TypeError):
        printed = _last_line(p.stdout) or "no output"
        return None, f"the probe child printed no measurement: {printed!r}"
    if not _is_duration(seconds):
        return None, f"the probe child reported an invalid time: {seconds!r}"
    return float(seconds) * 1000, ""


def probe(deadline_s: float = DEADLINE_S) -> AccelVerdict:
    """Decide between kvm and tcg by measurement (never by the mere presence of /dev/kvm).

    Raises HostError when FORKD_ACCEL holds something other than kvm or tcg.
    """
    forced = forced_accel()
    has_dev = os.path.exists("/dev/kvm")
    pvm = os.path.exists("/sys/module/kvm_pvm")
    if forced is not None:
        return AccelVerdict(forced, "forced", f"forced by {FORCE_ENV}={forced} (probe skipped)",
                            has_dev, pvm, None)
    if not has_dev:
        return AccelVerdict("tcg", "no-kvm", "no /dev/kvm on this host (load kvm_intel/kvm_amd "
                            "or use a host with virtualization enabled for KVM)", False, pvm, None)
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelVerdict("tcg", "no-kvm", "/dev/kvm exists but is not accessible to this "
                            "user (add the user to group kvm)", True, pvm, None)
    ms, why = _measure(deadline_s)
    if ms is None:
        return AccelVerdict("tcg", "failed", f"KVM probe failed, using TCG for this run: {why}",
                            True, pvm, None)
    what = "nested paravirtual KVM (kvm_pvm loaded)" if pvm else "KVM"
    if ms <= NATIVE_LIMIT_S * 1000:
        return AccelVerdict("kvm", "measured", f"{what} ran the probe guest at native speed "
                            f"({ITERATIONS} iterations in {ms:.1f} ms)", True, pvm, ms)
    return AccelVerdict("tcg", "measured", f"{what} ran the probe guest slowly ({ITERATIONS} "
                        f"iterations in {ms:.1f} ms > {NATIVE_LIMIT_S * 1000:.0f} ms): it "
                        "emulates guest code, stock kernels crawl there, TCG is faster",
                        True, pvm, ms)


def _cached_verdict(raw: object, boot: str) -> AccelVerdict | None:
    """The measured verdict in accel.json's content, if it is one for this boot."""
    if not isinstance(raw, dict) or raw.get("format") != CACHE_FORMAT \
            or raw.get("boot_id") != boot:
        return None
    v = raw.get("verdict")
    if not isinstance(v, dict) or set(v) != {f.name for f in fields(AccelVerdict)}:
        return None
    if v["outcome"] != "measured" or v["accel"] not in ACCELS or not isinstance(v["reason"], str) \
            or not isinstance(v["kvm_device"], bool) or not isinstance(v["kvm_pvm"], bool) \
            or not _is_duration(v["probe_ms"]):
        return None
    return AccelVerdict(**v)


_recent_failure: tuple[float, AccelVerdict] | None = None


def cached_probe() -> AccelVerdict:
    """probe(), a measurement remembered for this host boot in the run directory.

    Forks and builds call this. Only a measured verdict is written; a failed probe is
    remembered in this process for FAILED_RETRY_S (so a fork of N children does not probe
    N times) and never on disk.
    """
    global _recent_failure
    from forkd.engine.paths import run_dir

    if forced_accel() is not None:
        return probe()
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return probe()
    f = run_dir() / "accel.json"
    try:
        cached = _cached_verdict(json.loads(f.read_text()), boot)
    except (OSError, ValueError):
        cached = None
    if cached is not None:
        return cached
    if _recent_failure is not None and time.monotonic() - _recent_failure[0] < FAILED_RETRY_S:
        return _recent_failure[1]
    v = probe()
    if v.outcome == "failed":
        _recent_failure = (time.monotonic(), v)
        return v
    _recent_failure = None
    if v.outcome == "measured":
        _write_cache(f, boot, v)
    return v


def _write_cache(f: Path, boot: str, v: AccelVerdict) -> None:
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, "boot_id": boot,
                                   "verdict": v.to_dict()}))
        tmp.replace(f)
    except OSError:
        tmp.unlink(missing_ok=True)  # an unwritable run directory: the next run probes again


def _main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else ITERATIONS
    print(json.dumps({"seconds": _probe_loop(n)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv))
