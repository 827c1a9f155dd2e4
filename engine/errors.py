"""Errors of the engine, all under forkd's root error."""

from __future__ import annotations

from forkd.errors import Conflict, ForkdError, InvalidInput, NotFound


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


class ChildDead(EngineError, Conflict):
    """The child VM's QEMU process is gone (crashed or killed), or it is paused: the
    request needs a running child. A Conflict of the caller's (409 in REST), not a failure
    of the host's."""

    exit_code = 15


class Busy(EngineError, Conflict):
    """The child is held by another operation (a branch or pause waits for requests to end,
    a request waits for a branch; a record change waits for a pause or resume) past the
    wait's bound: a Conflict (409 in REST), to try again later."""


class TooManyRequests(Busy):
    """One client holds its whole share of a bound many clients share (the daemon's guest
    requests, children.MAX_REQUESTS_PER_CLIENT): 429 in REST, to try again once some of
    its own requests have ended; the other clients keep the rest."""


__all__ = [
    "AgentError",
    "Busy",
    "ChildDead",
    "ChildNotFound",
    "EngineError",
    "GuestBuildError",
    "HostError",
    "InvalidInput",
    "TooManyRequests",
    "VMMError",
]
