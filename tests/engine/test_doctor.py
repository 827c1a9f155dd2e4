"""Accelerator probe and doctor on this host (no VMs booted)."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from forkd.engine.accel import probe


def test_probe_verdict_matches_host() -> None:
    v = probe()
    assert v.accel in ("kvm", "tcg") and v.reason
    if os.path.exists("/sys/module/kvm_pvm") or not os.path.exists("/dev/kvm"):
        # this workplace: nested paravirtual KVM (or none) → TCG, decided by measurement
        assert v.accel == "tcg"
    if v.kvm_device and v.probe_ms is not None and v.accel == "tcg":
        assert v.probe_ms > 20


def test_forced_accel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_ACCEL", "tcg")
    assert probe().accel == "tcg" and "forced" in probe().reason


def test_doctor_json(tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.cli.main import cli

    monkeypatch.setenv("FORKD_HOME", str(tmp_path))
    res = CliRunner().invoke(cli, ["doctor", "--json"])
    data = json.loads(res.output)
    names = {c["name"]: c for c in data["checks"]}
    for needed in ("qemu", "accelerator", "memory-files", "cgroup", "netns-tap", "debootstrap",
                   "guest-kernel", "store"):
        assert needed in names
    assert data["accelerator"] in ("kvm", "tcg")
    if os.path.exists("/sys/module/kvm_pvm"):
        assert data["accelerator"] == "tcg"
    for c in data["checks"]:
        if c["status"] == "fail":
            assert c["hint"], f"{c['name']} fails without a fix hint"
    assert res.exit_code == (0 if data["ok"] else 1)
