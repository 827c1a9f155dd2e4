"""Errors of the engine, all under forkd's root error."""

from __future__ import annotations

from forkd.errors import ForkdError, InvalidInput, NotFound


class EngineError(ForkdError):
    """Root of the engine's own failures (VMM, guest, host setup)."""

    exit_code = 10


class VMMError(EngineError):
    """QEMU failed to start, crashed, or refused a command."""

    exit_code = 11


class AgentError(EngineError):
    """The guest agent did not answer in time or answered with a protocol error."""

    exit_code = 12


class GuestBuildError(EngineError):
    """Building the guest image (rootfs, kernel, initramfs) failed."""

    exit_code = 13


class HostError(EngineError):
    """The host cannot do what was asked (missing tool, no cgroup, unsupported snapshot)."""

    exit_code = 14


class ChildNotFound(NotFound):
    """No child VM with that id exists in the state directory."""


class ChildDead(EngineError):
    """The child VM's QEMU process is gone (crashed or killed)."""

    exit_code = 15


__all__ = [
    "AgentError",
    "ChildDead",
    "ChildNotFound",
    "EngineError",
    "GuestBuildError",
    "HostError",
    "InvalidInput",
    "VMMError",
]
