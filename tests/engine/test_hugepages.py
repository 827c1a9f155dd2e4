"""engine/hugepages.py: a program run through ``without_advice`` gets success from
madvise(MADV_HUGEPAGE) and no huge-page flag on its mapping, while every other call (other
advice included) does what it did; it is the same process (exec, not a child), with its
arguments, descriptors and exit status. (QEMU's children of a lazy memory file run so:
docs/engine.md, "Lazy fork".)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from forkd.engine import hugepages

# Maps two areas, advises one MADV_HUGEPAGE and the other MADV_NOHUGEPAGE, and prints
# each area's VmFlags (smaps), its pid and its arguments; exits 7.
PROGRAM = r"""
import ctypes, json, mmap, os, re, sys
def flags(m):
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    smaps = open("/proc/self/smaps").read()
    for area in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps):
        if int(area.split("-")[0], 16) == start:
            return [l.split()[1:] for l in area.splitlines() if l.startswith("VmFlags")][0]
huge, nohuge = mmap.mmap(-1, 8 << 20), mmap.mmap(-1, 8 << 20)
try:
    huge.madvise(mmap.MADV_HUGEPAGE)
except OSError:  # a kernel without transparent huge pages
    print(json.dumps({"refused": True}))
    sys.exit(0)
nohuge.madvise(mmap.MADV_NOHUGEPAGE)
fd = int(sys.argv[1])
print(json.dumps({"huge": flags(huge), "nohuge": flags(nohuge), "pid": os.getpid(),
                  "argv": sys.argv[1:], "passed": os.read(fd, 5).decode()}))
sys.exit(7)
"""


def _run(argv: list[str]) -> tuple[dict[str, Any], int, int]:
    read, write = os.pipe()
    os.write(write, b"hello")
    os.close(write)
    try:
        proc = subprocess.Popen([*argv, str(read), "two words"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=(read,), text=True)
        out, err = proc.communicate(timeout=60)
    finally:
        os.close(read)
    assert out, err
    return json.loads(out), proc.returncode, proc.pid


def test_the_huge_page_advice_is_a_no_op_and_nothing_else_changes() -> None:
    plain, code, pid = _run([sys.executable, "-c", PROGRAM])
    if plain.get("refused"):
        pytest.skip("this kernel has no transparent huge pages: there is no advice to drop")
    assert "hg" in plain["huge"]  # the control: this kernel takes the advice
    assert code == 7 and plain["pid"] == pid

    wrapped, code, pid = _run(hugepages.without_advice([sys.executable, "-c", PROGRAM]))
    assert "hg" not in wrapped["huge"], "the advice still took effect"
    assert "nh" in wrapped["nohuge"], "other advice was swallowed too"
    assert code == 7
    assert wrapped["pid"] == pid, "the program ran as a child of the wrapper, not in its place"
    assert wrapped["argv"][1:] == ["two words"] and wrapped["passed"] == "hello"


def test_a_program_named_without_a_path_is_found_on_path() -> None:
    argv = hugepages.without_advice(["true"])
    assert os.path.isabs(argv[argv.index(hugepages.WRAPPER) + 1])
    assert subprocess.run(argv, check=False).returncode == 0
    with pytest.raises(FileNotFoundError, match="not on PATH"):
        hugepages.without_advice(["forkd-no-such-program"])
