"""engine/precopy.py without a VM: the device state cut out of a migration stream's tail,
and the diff's pages read raw in the pause, compared with the parent only when settled."""

from __future__ import annotations

import ctypes
import json
import struct
from pathlib import Path

import pytest

from forkd.engine import precopy
from forkd.engine.errors import VMMError

PAGE = precopy.PAGE
HEADER = struct.pack(">II", 0x5145564D, 3)


def _tail(devices: bytes, desc: object) -> bytes:
    """What QEMU 7.2 writes after the RAM sections: device sections, EOF, VMDESCRIPTION."""
    body = json.dumps(desc).encode()
    return devices + b"\x00" + b"\x06" + struct.pack(">I", len(body)) + body


def test_device_state_is_the_header_the_sections_and_eof_without_the_description() -> None:
    sections = b"\x04" + bytes(range(256)) * 3  # any bytes, 0x06 and 0x00 among them
    tail = _tail(sections, {"page_size": 4096, "devices": [{"name": "timer"}]})
    assert precopy.device_state(HEADER, tail) == HEADER + sections + b"\x00"


@pytest.mark.parametrize("json_len", [0x106, 0x606, 0x60606])
def test_device_state_when_the_description_length_holds_the_marker_byte(json_len: int) -> None:
    """The marker is searched from the end, where the description's length bytes may be 0x06."""
    empty = len(json.dumps({"devices": [], "p": ""}).encode())
    desc = {"devices": [], "p": "x" * (json_len - empty)}
    tail = _tail(b"\x04\x06\x06", desc)
    assert 6 in struct.pack(">I", json_len)
    assert precopy.device_state(HEADER, tail) == HEADER + b"\x04\x06\x06\x00"


@pytest.mark.parametrize(("tail", "error"), [
    (b"\x04abc\x00", "does not end with EOF and QEMU's device description"),
    (b"\x04abc\x01\x06" + struct.pack(">I", 2) + b"{}", "does not end with EOF"),
    (b"\x04abc\x00\x06" + struct.pack(">I", 3) + b"{x}", "not JSON"),
    (b"\x04abc\x00\x06" + struct.pack(">I", 2) + b"{}", "lists no devices"),
    (b"", "does not end with EOF"),
])
def test_a_tail_without_its_description_is_refused(tail: bytes, error: str) -> None:
    with pytest.raises(VMMError, match=error):
        precopy.device_state(HEADER, tail)


def _parent(tmp_path: Path, pages: int, data: dict[int, bytes]) -> precopy.ParentImage:
    """A parent image of `pages` pages, holes but for `data`."""
    path = tmp_path / "parent.mem"
    with path.open("wb") as f:
        f.truncate(pages * PAGE)
        for i, page in data.items():
            f.seek(i * PAGE)
            f.write(page)
    return precopy.ParentImage(path, pages * PAGE)


def test_held_pages_are_compared_with_the_parent_only_when_settled(tmp_path: Path) -> None:
    """Pages read raw into the diff in the pause (`hold`) count once compared (`settle`):
    equal to the parent they are dropped, different they are kept; before, the diff is not
    readable."""
    parent_page = b"p" * PAGE
    parent = _parent(tmp_path, 8, {2: parent_page, 3: parent_page})
    diff = precopy.Diff(8 * PAGE)
    try:
        for i in range(8):
            diff.put_zero(i, parent)
        diff.put(5, b"x" * PAGE, parent)
        diff.put(5, b"y" * PAGE, parent)  # sent twice: written during the copy
        diff.put(2, b"z" * PAGE, parent)
        diff.put(2, b"w" * PAGE, parent)
        assert diff.rewritten() == [2, 5]
        # the paused guest's bytes, written in place as process_vm_readv does
        ctypes.memmove(diff.address + 2 * PAGE, parent_page, PAGE)  # the parent's again
        ctypes.memmove(diff.address + 5 * PAGE, b"v" * PAGE, PAGE)
        diff.hold([2, 5])
        with pytest.raises(VMMError, match="settled"):
            diff.count()
        with pytest.raises(VMMError, match="settled"):
            list(diff.items())
        diff.settle(parent)
        # page 3: the parent's data, the guest's zeros
        assert dict(diff.items()) == {3: bytes(PAGE), 5: b"v" * PAGE}
        assert diff.count() == 2
    finally:
        diff.close()
        parent.close()


def test_rewritten_finds_every_page_sent_twice() -> None:
    diff = precopy.Diff(4096 * PAGE)
    try:
        twice = [0, 1, 2, 700, 4094, 4095]
        for i in range(4096):
            diff.sends[i] = 2 if i in twice else 1
        assert diff.rewritten() == twice
    finally:
        diff.close()
