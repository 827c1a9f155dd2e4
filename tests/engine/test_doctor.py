"""Accelerator probe and doctor on this host (no VMs booted).

The probe's child process must measure wherever forkd runs from (the checkout root, where
`python -m` would import the source folder forkd/ instead of the installed package), and a
probe that cannot measure is its own verdict: WARN in doctor, TCG for the run, never cached.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from forkd.engine import accel
from forkd.engine.accel import CACHE_FORMAT, PROBE_PYTHON_ENV, cached_probe, probe
from forkd.engine.errors import HostError

REPO = Path(__file__).resolve().parents[2]
KVM_USABLE = os.access("/dev/kvm", os.R_OK | os.W_OK)
needs_kvm = pytest.mark.skipif(not KVM_USABLE, reason="the probe child runs only with /dev/kvm")
MEASURED = re.compile(r"\d+ iterations in \d+\.\d ms")


@pytest.fixture(autouse=True)
def probe_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """No forcing, no probe hook, an empty run directory, no failure remembered in-process."""
    monkeypatch.delenv("FORKD_ACCEL", raising=False)
    monkeypatch.delenv(PROBE_PYTHON_ENV, raising=False)
    run = tmp_path / "run"
    monkeypatch.setenv("FORKD_RUN", str(run))
    monkeypatch.setattr(accel, "_recent_failure", None)
    yield run


def _script(path: Path, body: str) -> str:
    """An executable stand-in for the probe interpreter."""
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def _cli(args: list[str], env: dict[str, str],
         cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """The real CLI in a fresh interpreter, as a user runs it from the checkout root."""
    return subprocess.run([sys.executable, "-P", "-m", "forkd.cli", *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("FORKD_ACCEL", PROBE_PYTHON_ENV)}
    env.update(extra)
    return env


def _accel_check(stdout: str) -> tuple[str | None, dict[str, str]]:
    data = json.loads(stdout)
    check = next(c for c in data["checks"] if c["name"] == "accelerator")
    return data["accelerator"], check


def test_probe_verdict_matches_host() -> None:
    v = probe()
    assert v.accel in ("kvm", "tcg") and v.reason
    if os.path.exists("/sys/module/kvm_pvm") or not os.path.exists("/dev/kvm"):
        # this workplace: nested paravirtual KVM (or none) → TCG, decided by measurement
        assert v.accel == "tcg"
    if KVM_USABLE:
        assert v.outcome == "measured", v.reason
    if v.kvm_device and v.probe_ms is not None and v.accel == "tcg":
        assert v.probe_ms > 20


@needs_kvm
@pytest.mark.parametrize("accident", ["cwd", "PYTHONPATH"])
def test_probe_measures_from_the_checkout_root(accident: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # the checkout root holds a forkd/ folder without engine/: a child importing by module
    # name from there fails with "No module named 'forkd.engine'"
    assert (REPO / "forkd" / "__init__.py").exists() and not (REPO / "forkd" / "engine").exists()
    if accident == "cwd":
        monkeypatch.chdir(REPO)
    else:
        monkeypatch.chdir(REPO.parent)
        monkeypatch.setenv("PYTHONPATH", str(REPO))
    v = probe()
    assert v.outcome == "measured", v.reason
    assert isinstance(v.probe_ms, float) and v.probe_ms > 0
    assert MEASURED.search(v.reason)


def test_forced_accel(monkeypatch: pytest.MonkeyPatch, probe_env: Path) -> None:
    for choice in ("tcg", "kvm"):
        monkeypatch.setenv("FORKD_ACCEL", choice)
        v = cached_probe()
        assert (v.accel, v.outcome) == (choice, "forced") and "forced" in v.reason
    assert not (probe_env / "accel.json").exists()  # a forced choice is not a measurement


@pytest.mark.parametrize("value", ["KVM", "qemu", "kvm "])
def test_forced_accel_must_be_kvm_or_tcg(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKD_ACCEL", value)
    with pytest.raises(HostError, match="kvm or tcg"):
        probe()
    with pytest.raises(HostError, match="kvm or tcg"):
        cached_probe()


@needs_kvm
@pytest.mark.parametrize(("body", "why"), [
    (None, "could not start"),
    ("exit 3", "exited with status 3"),
    ("echo 'Traceback:' >&2; echo 'OSError: no KVM here' >&2; exit 1", "OSError: no KVM here"),
    ("echo hello", "printed no measurement: 'hello'"),
    ("echo '[1, 2]'", "printed no measurement"),
    ("echo '{\"seconds\": -1}'", "invalid time: -1"),
    ("echo '{\"seconds\": NaN}'", "invalid time: nan"),
    ("echo '{\"seconds\": true}'", "invalid time: True"),
    ("echo '{\"seconds\": \"0.1\"}'", "invalid time: '0.1'"),
])
def test_probe_child_that_cannot_measure_is_a_failed_verdict(
        body: str | None, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        probe_env: Path) -> None:
    python = str(tmp_path / "no-such-python") if body is None else _script(tmp_path / "py", body)
    monkeypatch.setenv(PROBE_PYTHON_ENV, python)
    v = probe()
    assert (v.accel, v.outcome, v.probe_ms) == ("tcg", "failed", None)
    assert "KVM probe failed" in v.reason and why in v.reason
    v = cached_probe()
    assert (v.accel, v.outcome) == ("tcg", "failed")  # the engine runs TCG for this run
    assert not (probe_env / "accel.json").exists()  # ... and nothing is remembered on disk


@needs_kvm
def test_probe_child_past_its_deadline_is_a_failed_verdict(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PROBE_PYTHON_ENV, _script(tmp_path / "py", "exec sleep 30"))
    v = probe(deadline_s=0.5)
    assert (v.accel, v.outcome) == ("tcg", "failed")
    assert "did not report within 0.5 s" in v.reason


@needs_kvm
def test_only_a_measurement_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      probe_env: Path) -> None:
    cache = probe_env / "accel.json"
    monkeypatch.setenv(PROBE_PYTHON_ENV, str(tmp_path / "no-such-python"))
    assert cached_probe().outcome == "failed" and not cache.exists()
    # the next forkd process probes again (from the checkout root) and caches a measurement
    out = subprocess.run(
        [sys.executable, "-P", "-c", "import json; from forkd.engine.accel import cached_probe; "
         "print(json.dumps(cached_probe().to_dict()))"],
        env=_env(FORKD_RUN=str(probe_env)), cwd=REPO, capture_output=True, text=True,
        timeout=60, check=True)
    fresh = json.loads(out.stdout)
    assert fresh["outcome"] == "measured" and fresh["probe_ms"] > 0, fresh
    assert json.loads(cache.read_text())["verdict"] == fresh
    # a cached measurement is reused without a probe child (the hook still points nowhere)
    monkeypatch.setattr(accel, "_recent_failure", None)
    assert cached_probe().to_dict() == fresh


@needs_kvm
@pytest.mark.parametrize("content", [
    # what forkd before format 2 cached for the whole boot when its probe child failed
    {"boot_id": "BOOT", "forced": None, "verdict": {
        "accel": "tcg", "reason": "KVM probe failed: No module named 'forkd.engine'",
        "kvm_device": True, "kvm_pvm": False, "probe_ms": None}},
    {"format": CACHE_FORMAT, "boot_id": "BOOT", "verdict": {
        "accel": "tcg", "outcome": "failed", "reason": "KVM probe failed: x",
        "kvm_device": True, "kvm_pvm": False, "probe_ms": None}},
    {"format": CACHE_FORMAT, "boot_id": "BOOT", "verdict": {
        "accel": "kvm", "outcome": "measured", "reason": "r", "kvm_device": True,
        "kvm_pvm": False, "probe_ms": "fast"}},
    {"format": CACHE_FORMAT, "boot_id": "another boot", "verdict": {
        "accel": "kvm", "outcome": "measured", "reason": "r", "kvm_device": True,
        "kvm_pvm": False, "probe_ms": 1.0}},
    [1, 2, 3],
])
def test_a_cached_verdict_that_is_no_measurement_is_probed_again(
        content: object, probe_env: Path) -> None:
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    probe_env.mkdir(parents=True, exist_ok=True)
    cache = probe_env / "accel.json"
    cache.write_text(json.dumps(content).replace('"BOOT"', json.dumps(boot)))
    v = cached_probe()
    assert v.outcome == "measured" and v.probe_ms is not None, v.reason
    assert json.loads(cache.read_text())["verdict"] == v.to_dict()


@needs_kvm
def test_a_failed_probe_is_retried_after_a_while(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs"
    monkeypatch.setenv(PROBE_PYTHON_ENV, _script(tmp_path / "py", f"echo run >> {runs}; exit 1"))
    for _ in range(3):  # one fork of many children: one probe, not one per child
        assert cached_probe().outcome == "failed"
    assert runs.read_text().count("run") == 1
    monkeypatch.setattr(accel, "FAILED_RETRY_S", 0.0)
    assert cached_probe().outcome == "failed"
    assert runs.read_text().count("run") == 2


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


@needs_kvm
def test_doctor_cli_from_the_checkout_root_measures(tmp_path: Path, probe_env: Path) -> None:
    res = _cli(["doctor", "--json", "--no-store"],
               _env(FORKD_HOME=str(tmp_path / "home"), FORKD_RUN=str(probe_env)))
    accelerator, check = _accel_check(res.stdout)
    assert check["status"] == "ok" and MEASURED.search(check["detail"]), check
    assert accelerator == check["detail"].split(":")[0]
    assert not (probe_env / "accel.json").exists()  # doctor probes afresh, caches nothing


@needs_kvm
def test_doctor_cli_warns_when_the_probe_child_cannot_run(tmp_path: Path,
                                                          probe_env: Path) -> None:
    missing = str(tmp_path / "no-such-python")
    res = _cli(["doctor", "--json", "--no-store"],
               _env(FORKD_HOME=str(tmp_path / "home"), FORKD_RUN=str(probe_env),
                    **{PROBE_PYTHON_ENV: missing}))
    accelerator, check = _accel_check(res.stdout)
    assert accelerator == "tcg" and check["status"] == "warn", check
    assert "KVM probe failed" in check["detail"] and missing in check["detail"]
    assert "not cached" in check["hint"]
    assert not (probe_env / "accel.json").exists()
    text = _cli(["doctor", "--no-store"], _env(FORKD_HOME=str(tmp_path / "home"),
                                               **{PROBE_PYTHON_ENV: missing})).stdout
    assert re.search(r"\[WARN\] accelerator +tcg: KVM probe failed", text), text


@pytest.mark.parametrize("choice", ["kvm", "tcg"])
def test_doctor_cli_says_the_accelerator_was_forced(choice: str, tmp_path: Path) -> None:
    res = _cli(["doctor", "--json", "--no-store"],
               _env(FORKD_HOME=str(tmp_path / "home"), FORKD_ACCEL=choice))
    accelerator, check = _accel_check(res.stdout)
    assert accelerator == choice and f"forced by FORKD_ACCEL={choice}" in check["detail"]
    assert check["status"] == ("ok" if choice == "tcg" or KVM_USABLE else "warn")


def test_doctor_cli_fails_on_an_unknown_forced_accelerator(tmp_path: Path) -> None:
    res = _cli(["doctor", "--json", "--no-store"],
               _env(FORKD_HOME=str(tmp_path / "home"), FORKD_ACCEL="fast"))
    accelerator, check = _accel_check(res.stdout)
    assert accelerator is None and check["status"] == "fail" and check["hint"]
    assert "FORKD_ACCEL='fast'" in check["detail"]
    assert res.returncode == 1
