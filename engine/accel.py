"""Accelerator verdict: does /dev/kvm run guest code at native speed, or use TCG?

The probe runs a counted loop in a tiny real-mode guest through raw KVM ioctls
(no QEMU, nothing booted) in a child process with a deadline. Native or nested
VMX/SVM KVM finishes 200,000 iterations in well under 10 ms; a nested
paravirtual KVM (kvm_pvm) emulates stock guest code and takes ~170 ms, where a
stock kernel crawls: TCG is the better choice there.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import mmap
import os
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ITERATIONS = 200_000
NATIVE_LIMIT_S = 0.020  # faster than this = native-speed KVM
DEADLINE_S = 5.0

_KVM_GET_API_VERSION, _KVM_CREATE_VM, _KVM_GET_VCPU_MMAP_SIZE = 0xAE00, 0xAE01, 0xAE04
_KVM_CREATE_VCPU, _KVM_RUN = 0xAE41, 0xAE80
_KVM_SET_USER_MEMORY_REGION = 0x4020AE46
_KVM_GET_SREGS, _KVM_SET_SREGS, _KVM_SET_REGS = 0x8138AE83, 0x4138AE84, 0x4090AE82
_KVM_EXIT_IO, _KVM_EXIT_HLT = 2, 5


@dataclass(frozen=True)
class AccelVerdict:
    accel: str  # "kvm" or "tcg"
    reason: str
    kvm_device: bool
    kvm_pvm: bool
    probe_ms: float | None

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


def probe(deadline_s: float = DEADLINE_S) -> AccelVerdict:
    """Decide between kvm and tcg by measurement (never by the mere presence of /dev/kvm)."""
    forced = os.environ.get("FORKD_ACCEL")
    has_dev = os.path.exists("/dev/kvm")
    pvm = os.path.exists("/sys/module/kvm_pvm")
    if forced in ("kvm", "tcg"):
        return AccelVerdict(forced, f"forced by FORKD_ACCEL={forced}", has_dev, pvm, None)
    if not has_dev:
        return AccelVerdict("tcg", "no /dev/kvm on this host (load kvm_intel/kvm_amd or use "
                            "a host with virtualization enabled for KVM)", False, pvm, None)
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return AccelVerdict("tcg", "/dev/kvm exists but is not accessible to this user "
                            "(add the user to group kvm)", True, pvm, None)
    try:
        p = subprocess.run([sys.executable, "-m", "forkd.engine.accel", str(ITERATIONS)],
                           capture_output=True, text=True, timeout=deadline_s,
                           stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:
        return AccelVerdict("tcg", f"KVM probe guest did not finish within {deadline_s:.0f} s "
                            "(KVM emulates guest code here)", True, pvm, None)
    try:
        ms = float(json.loads(p.stdout)["seconds"]) * 1000
    except (ValueError, KeyError, TypeError):
        err = (p.stderr or p.stdout).strip().splitlines()[-1:] or ["no output"]
        return AccelVerdict("tcg", f"KVM probe failed: {err[0]}", True, pvm, None)
    what = "nested paravirtual KVM (kvm_pvm loaded)" if pvm else "KVM"
    if ms <= NATIVE_LIMIT_S * 1000:
        return AccelVerdict("kvm", f"{what} ran the probe guest at native speed "
                            f"({ITERATIONS} iterations in {ms:.1f} ms)", True, pvm, ms)
    return AccelVerdict("tcg", f"{what} ran the probe guest slowly ({ITERATIONS} iterations in "
                        f"{ms:.1f} ms > {NATIVE_LIMIT_S * 1000:.0f} ms): it emulates guest "
                        "code, stock kernels crawl there, TCG is faster", True, pvm, ms)


def cached_probe() -> AccelVerdict:
    """probe(), remembered for this host boot in the run directory (forks call this)."""
    from forkd.engine.paths import run_dir

    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return probe()
    f = run_dir() / "accel.json"
    forced = os.environ.get("FORKD_ACCEL")
    try:
        raw = json.loads(f.read_text())
        if raw.get("boot_id") == boot and raw.get("forced") == forced:
            return AccelVerdict(**raw["verdict"])
    except (OSError, ValueError, TypeError, KeyError):
        pass
    v = probe()
    tmp = f.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"boot_id": boot, "forced": forced, "verdict": v.to_dict()}))
    tmp.replace(f)
    return v


def _main(argv: list[str]) -> int:
    n = int(argv[1]) if len(argv) > 1 else ITERATIONS
    print(json.dumps({"seconds": _probe_loop(n)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv))
