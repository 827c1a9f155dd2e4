"""The SDK's own logic, over a backend that answers like a daemon whose spawn partly failed
(no VM: a partial failure cannot be provoked on purpose with real ones)."""

from __future__ import annotations

from typing import Any

import pytest

from forkd.controller.api import SandboxInfo, SpawnRequest, SpawnResult
from forkd.controller.sdk import Controller, Sandbox, SpawnError


def _info(sandbox_id: str) -> SandboxInfo:
    return SandboxInfo(id=sandbox_id, ref="tiny:x", digest="sha256:0", pid=1, dir="/x",
                       memory="/m", disk_backing="/d", memory_mib=64, created=0.0)


class PartlyFailing:
    """Starts all but the last sandbox asked for; records kills."""

    def __init__(self) -> None:
        self.killed: list[str] = []
        self.asked: list[SpawnRequest] = []

    def spawn(self, req: SpawnRequest) -> SpawnResult:
        self.asked.append(req)
        started = [_info(f"sb-{i}") for i in range(req.n - 1)]
        return SpawnResult(sandboxes=started, assemble_ms=1.0, total_ms=2.0,
                           errors=[f"child sb-{req.n - 1}: QEMU exited (see its log)"])

    def kill(self, sandbox_id: str) -> SandboxInfo:
        self.killed.append(sandbox_id)
        return _info(sandbox_id)


def _controller(backend: Any) -> Controller:
    ctl = Controller.__new__(Controller)  # no store or daemon: the backend is all it uses
    ctl.backend = backend
    return ctl


def test_a_partly_failed_spawn_raises_its_errors_and_leaves_nothing_running() -> None:
    backend = PartlyFailing()
    with pytest.raises(SpawnError, match="1 of 3 sandboxes did not start") as raised:
        _controller(backend).spawn_sandboxes("tiny:x", 3, cpus=0.5)
    assert raised.value.errors == ["child sb-2: QEMU exited (see its log)"]
    assert backend.killed == ["sb-0", "sb-1"]
    assert backend.asked[0].cpus == 0.5


def test_a_sandbox_whose_spawn_failed_raises() -> None:
    with pytest.raises(SpawnError, match="QEMU exited"):
        Sandbox("tiny:x", controller=_controller(PartlyFailing()))
