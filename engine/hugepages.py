"""QEMU started without its huge-page advice on guest RAM.

QEMU advises ``MADV_HUGEPAGE`` on all of a VM's RAM. On a file mapping, Linux then reads
two PMD-sized folios (4 MiB) around each first touch of a page that is not in the page
cache, whatever the file's read-ahead setting (mm/filemap.c, ``do_sync_mmap_readahead``:
"even if readahead is disabled"); ``PR_SET_THP_DISABLE`` does not change that. A lazy
child's memory file is produced on first access (engine/lazy/memfs.py), so each such
touch had its lazy server produce 4 MiB, fetching and decoding every chunk in them, and a
recording of the pages a child touches (engine/lazy/record.py) saw 4 MiB for each.

``without_advice(argv)`` runs ``argv`` through a small exec wrapper (the interpreter this
runs in, isolated, standard library only) that installs a seccomp filter under which
``madvise(..., MADV_HUGEPAGE)`` succeeds and does nothing, then replaces itself with the
program (same process, same descriptors, same environment). Every other call is allowed,
and every call on an architecture the filter does not know (it knows x86-64 and aarch64).
Where the filter cannot be installed, the program runs with the advice, and says so on
its standard error (QEMU's log).
"""

from __future__ import annotations

import shutil
import sys

# The wrapper, run as `python3 -I -S -c WRAPPER PROGRAM ARGS...`. Classic BPF over
# struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}: the arch at 4, the
# call's number at 0, the low word of its third argument (the advice) at 32.
WRAPPER = r"""
import ctypes, os, struct, sys
def op(code, jt, jf, k):
    return struct.pack("HBBI", code, jt, jf, k)
LD, JEQ, RET = 0x20, 0x15, 0x06
X86_64, AARCH64 = 0xC000003E, 0xC00000B7
MADVISE_X86_64, MADVISE_AARCH64, MADV_HUGEPAGE = 28, 233, 14
ALLOW, SUCCEED = 0x7FFF0000, 0x00050000  # SECCOMP_RET_ERRNO with errno 0: returns 0
program = b"".join([
    op(LD, 0, 0, 4),                       # 0: arch
    op(JEQ, 0, 2, X86_64),                 # 1: -> 2, else 4
    op(LD, 0, 0, 0),                       # 2: nr
    op(JEQ, 3, 6, MADVISE_X86_64),         # 3: -> 7, else 10
    op(JEQ, 0, 5, AARCH64),                # 4: -> 5, else 10
    op(LD, 0, 0, 0),                       # 5: nr
    op(JEQ, 0, 3, MADVISE_AARCH64),        # 6: -> 7, else 10
    op(LD, 0, 0, 32),                      # 7: the advice
    op(JEQ, 0, 1, MADV_HUGEPAGE),          # 8: -> 9, else 10
    op(RET, 0, 0, SUCCEED),                # 9
    op(RET, 0, 0, ALLOW),                  # 10
])
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong,
                       ctypes.c_ulong]
PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2
fprog = Program(len(program) // 8, program)
if (libc.prctl(PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0
        or libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0):
    print(f"forkd: huge-page advice left on ({os.strerror(ctypes.get_errno())})",
          file=sys.stderr, flush=True)
os.execv(sys.argv[1], sys.argv[1:])
"""


def without_advice(argv: list[str]) -> list[str]:
    """``argv`` (an absolute or PATH-found program first) run with ``madvise(...,
    MADV_HUGEPAGE)`` made a no-op for it and everything it starts; FileNotFoundError
    when the program is not on PATH."""
    program = argv[0]
    if "/" not in program:  # the wrapper's execv searches no PATH
        found = shutil.which(program)
        if found is None:  # as starting it directly would (the caller says what to install)
            raise FileNotFoundError(f"{program} is not on PATH")
        program = found
    return [sys.executable, "-I", "-S", "-c", WRAPPER, program, *argv[1:]]


__all__ = ["WRAPPER", "without_advice"]
