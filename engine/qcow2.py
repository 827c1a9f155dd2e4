"""An empty qcow2 overlay, written directly: the file ``qemu-img create -f qcow2 -b B -F raw``
makes, without starting qemu-img.

Every child boots on one (a copy of the fork's empty overlay), so a fork that ran qemu-img
waited for a process start: 12 ms on an idle host, 24-78 ms beside a lazy server, a hub and
guests on two cores. The image is four fixed pieces (the qcow2 v3 layout qemu-img 7.2 writes
for an empty image, ``docs/qcow2.txt`` in QEMU's tree):

  cluster 0   header, the backing format extension, the backing file name
  cluster 1   refcount table: one entry, the refcount block at cluster 2
  cluster 2   refcount block: clusters 0 .. 3+L1 hold refcount 1
  cluster 3-  L1 table, all zero (no cluster of the overlay is allocated)

QEMU grows the refcount structures itself once a child writes.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

MAGIC = b"QFI\xfb"
VERSION = 3
CLUSTER_BITS = 16
CLUSTER = 1 << CLUSTER_BITS
L2_COVERS = CLUSTER * (CLUSTER // 8)  # bytes of disk one L2 table (one L1 entry) maps
REFCOUNT_ORDER = 4  # 16-bit refcounts
HEADER_LENGTH = 112  # the v3 header with its compression type byte, padded to 8
EXT_BACKING_FORMAT = 0xE2792ACA
MAX_BACKING = 1023  # QEMU refuses longer backing file names
MAX_SIZE = 1 << 50  # the L1 table must fit the refcount block's reach with room to spare
SECTOR = 512  # qemu-img rounds a disk's size up to whole sectors; so does this


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def header(backing: str, backing_fmt: str, size: int) -> bytes:
    """Cluster 0 (without its zero tail): what names the backing and the disk's size."""
    name = backing.encode()
    fmt = backing_fmt.encode()
    if not name or len(name) > MAX_BACKING:
        raise ValueError(f"a backing file name is 1 to {MAX_BACKING} bytes, not {len(name)}")
    if not fmt or len(fmt) > 16:
        raise ValueError(f"backing format {backing_fmt!r} is not a QEMU format name")
    if size <= 0 or size > MAX_SIZE:
        raise ValueError(f"an overlay's size is 1 byte to {MAX_SIZE} bytes, not {size}")
    size = -(-size // SECTOR) * SECTOR
    l1_size = -(-size // L2_COVERS)
    ext = struct.pack(">II", EXT_BACKING_FORMAT, len(fmt)) + fmt.ljust(_pad8(len(fmt)), b"\0")
    ext += struct.pack(">II", 0, 0)  # end of the extensions
    backing_offset = HEADER_LENGTH + len(ext)
    fixed = struct.pack(
        ">4sIQIIQIIQQIIQ",
        MAGIC, VERSION, backing_offset, len(name), CLUSTER_BITS, size,
        0,  # no encryption
        l1_size, 3 * CLUSTER,  # the L1 table at cluster 3
        1 * CLUSTER, 1,  # the refcount table: cluster 1, one cluster long
        0, 0,  # no internal snapshots
    )
    v3 = struct.pack(">QQQII", 0, 0, 0, REFCOUNT_ORDER, HEADER_LENGTH)
    head = (fixed + v3).ljust(HEADER_LENGTH, b"\0")  # compression type 0 (zlib), padding
    return head + ext + name


def write_empty(path: Path, backing: str, backing_fmt: str, size: int) -> None:
    """Write an empty qcow2 overlay at ``path`` on ``backing``: a
    file name (absolute: never relative to the overlay) or a QEMU URL."""
    head = header(backing, backing_fmt, size)
    l1_bytes = 8 * -(-size // L2_COVERS)
    clusters = 3 + -(-l1_bytes // CLUSTER)
    refcounts = struct.pack(f">{clusters}H", *([1] * clusters))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.pwrite(fd, head, 0)
        os.pwrite(fd, struct.pack(">Q", 2 * CLUSTER), 1 * CLUSTER)
        os.pwrite(fd, refcounts, 2 * CLUSTER)
        os.ftruncate(fd, 3 * CLUSTER + l1_bytes)  # the zero L1 table: a hole
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
