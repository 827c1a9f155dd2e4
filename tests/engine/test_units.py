"""Engine pieces that need no VM: argv, identities, agent protocol handling."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from forkd.engine import netns
from forkd.engine.qemu import VMConfig, build_argv, kernel_cmdline

REPO = Path(__file__).resolve().parents[2]


def _cfg(**kw: object) -> VMConfig:
    base: dict[str, object] = {"memory_mib": 160, "vcpus": 1, "accel": "tcg",
                               "mem_path": Path("/x/mem.img"), "share": False,
                               "disk": Path("/x/d.qcow2")}
    base.update(kw)
    return VMConfig(**base)  # type: ignore[arg-type]


def test_child_argv() -> None:
    argv = build_argv(_cfg(incoming=True, sandbox=True), Path("/run/c1"))
    joined = " ".join(argv)
    assert "-machine microvm," in joined and "share=off" in joined
    assert argv[argv.index("-incoming") + 1] == "defer"
    assert "-sandbox" in argv and "spawn=deny" in argv[argv.index("-sandbox") + 1]
    assert "-kernel" not in argv  # restored children boot nothing
    assert "migration.send-configuration=off" in argv


def test_template_argv_and_cmdline() -> None:
    argv = build_argv(_cfg(share=True, kernel=Path("/k/vmlinux"), initrd=Path("/k/i.img"),
                           cmdline=kernel_cmdline("tcg"), tap="tap0", mac=netns.TEMPLATE_MAC),
                      Path("/run/t"))
    assert "share=on" in " ".join(argv) and "-sandbox" not in argv
    append = argv[argv.index("-append") + 1]
    assert "forkd.root=/dev/vda" in append and "tsc_early_khz=" in append
    assert any(a.startswith("tap,id=n0,ifname=tap0") for a in argv)


@pytest.mark.parametrize("field", ["mem_path", "disk", "kernel", "initrd", "dir"])
def test_a_comma_in_a_path_never_reaches_qemus_option_syntax(field: str) -> None:
    """``mem-path=/a,share=on`` would be QEMU's share=on: a path with a comma is refused."""
    from forkd.engine.errors import HostError

    bad = Path("/srv/forkd,share=on/x")
    d = bad if field == "dir" else Path("/run/c1")
    cfg = _cfg() if field == "dir" else _cfg(**{field: bad})
    with pytest.raises(HostError, match="comma") as err:
        build_argv(cfg, d)
    assert "FORKD_HOME" in str(err.value)
    build_argv(_cfg(mem_path=Path("/srv/forkd share/x")), Path("/run/c1"))  # spaces are fine


def test_child_identities_are_distinct_and_stable() -> None:
    ids = [f"tiny-{i:06x}" for i in range(500)]
    idents = [netns.child_identity(i) for i in ids]
    assert idents[0] == netns.child_identity(ids[0])
    assert len({m for m, _ in idents}) == 500
    for mac, ip in idents:
        assert mac.startswith("02:c1:") and ip.endswith("/16")
        assert ip.split("/")[0] not in (netns.GW_IP, netns.TEMPLATE_IP)
        assert ip.startswith("10.200.") and not ip.startswith("10.200.0.")


def _agent() -> ModuleType:
    spec = importlib.util.spec_from_file_location("forkd_guest_agent",
                                                  REPO / "engine" / "guest" / "agent.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("data, has", [(b"\x00virtio-net\x00", True), (b"virtio-blk", False)])
def test_has_nic(tmp_path: Path, data: bytes, has: bool) -> None:
    from forkd.engine.children import has_nic

    (tmp_path / "vmstate").write_bytes(data)
    assert has_nic(tmp_path / "vmstate") is has
