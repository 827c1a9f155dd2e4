"""What the host checks of a request before a guest agent sees it: a command's argv, env,
cwd and stdin, a timeout, a guest path, a file's mode and size, a signal.

Every caller (the REST API's request types, controller/api.py; the SDK; the MCP tools; the
CLI) reaches the guest through the engine, and the engine checks here first: a request
the guest would refuse, or that would fail in the guest's execve, chmod or wait, is an
InvalidInput that says what was wrong (a 400 in REST), never the guest agent's protocol
error (a 500). The bounds are the guest's: Linux's for execve and paths, the agent's for
a file in one frame (engine/guest/agent.py MAX_FILE).
"""

from __future__ import annotations

import math
import re
import signal
from collections.abc import Mapping, Sequence

from forkd.errors import InvalidInput
from forkd.jsondoc import is_integer
from forkd.names import shown

MAX_WAIT_S = 30 * 86400.0  # a command's, a cell's or a wait's timeout: at most 30 days
MAX_ARG_BYTES = 128 << 10  # one argument or NAME=VALUE (Linux MAX_ARG_STRLEN, with its NUL)
MAX_COMMAND_BYTES = 1 << 20  # argv and env together (Linux allows 2 MiB with the guest's own)
MAX_PATH_BYTES = 4096  # a guest path (Linux PATH_MAX)
MAX_PUT_BYTES = 32 << 20  # a file written into a guest, stdin of a command (agent MAX_FILE)
MAX_MODE = 0o7777


def check_timeout(what: str, value: object) -> float | None:
    """None (no limit) or a finite number of seconds above 0, at most MAX_WAIT_S."""
    if value is None:
        return None
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not 0 < value <= MAX_WAIT_S):
        raise InvalidInput(f"{what} must be a number of seconds above 0 and at most "
                           f"{MAX_WAIT_S:.0f} (30 days), or null for no limit; got "
                           f"{shown(value)}")
    return float(value)


def _check_text(what: str, value: object, limit: int) -> int:
    """The UTF-8 size of ``value``, a string without NUL of at most ``limit`` bytes."""
    if not isinstance(value, str):
        raise InvalidInput(f"{what} must be a string, got {shown(value)}")
    if "\0" in value:
        raise InvalidInput(f"{what} contains a NUL byte, which no argument, variable or path "
                           f"can hold: {shown(value)}")
    size = len(value.encode(errors="surrogatepass")) + 1
    if size > limit:
        raise InvalidInput(f"{what} is {size - 1} bytes, over the {limit - 1} the guest "
                           "takes; pass long data as stdin or in a file (PUT .../files)")
    return size


def check_command(argv: object, env: object = None, cwd: object = None) -> None:
    """argv: a non-empty list of strings; env: NAME -> VALUE strings (NAME without '=');
    cwd: an absolute guest path. None of them holds NUL; each argument and variable fits
    Linux's bound, and all of them together fit MAX_COMMAND_BYTES."""
    if not isinstance(argv, Sequence) or isinstance(argv, (str, bytes)) or not argv:
        raise InvalidInput("argv must be a non-empty list of strings: the program, then its "
                           "arguments (no shell; use [\"sh\", \"-c\", \"...\"] for one)")
    total = sum(_check_text(f"argv[{i}]", arg, MAX_ARG_BYTES) for i, arg in enumerate(argv))
    if env is not None:
        if not isinstance(env, Mapping):
            raise InvalidInput(f"env must be an object of NAME: VALUE strings, got {shown(env)}")
        for name, value in env.items():
            if not isinstance(name, str) or not name or "=" in name:
                raise InvalidInput(f"env name {shown(name)} is not a variable name: it must be "
                                   "non-empty and hold no '='")
            total += _check_text(f"env {shown(name)}", f"{name}={value}"
                                 if isinstance(value, str) else value, MAX_ARG_BYTES)
    if total > MAX_COMMAND_BYTES:
        raise InvalidInput(f"argv and env are {total} bytes together, over the "
                           f"{MAX_COMMAND_BYTES} a command takes; pass long data as stdin or "
                           "in a file (PUT .../files)")
    if cwd is not None:
        check_guest_path(cwd, "cwd")


def check_guest_path(path: object, what: str = "guest path") -> str:
    """An absolute path in the guest, without NUL, of at most MAX_PATH_BYTES."""
    _check_text(what, path, MAX_PATH_BYTES)
    assert isinstance(path, str)
    if not path.startswith("/"):
        raise InvalidInput(f"{what} {shown(path)} must be absolute (start with '/')")
    return path


def check_payload(what: str, data: bytes | None) -> None:
    """stdin of a command or a file's bytes: at most MAX_PUT_BYTES (one agent frame)."""
    if data is not None and len(data) > MAX_PUT_BYTES:
        raise InvalidInput(f"{what} is {len(data)} bytes, over the {MAX_PUT_BYTES} one "
                           "request carries into a guest; send it in parts")


def check_mode(mode: object) -> int:
    """A file's permission bits: an integer from 0 to 0o7777."""
    if not is_integer(mode, 0, MAX_MODE):
        raise InvalidInput(f"mode must be permission bits from 0 to {MAX_MODE} (0o7777), e.g. "
                           f"420 for 0o644; got {shown(mode)}")
    return mode


SIGNAL_NAMES = {s.name for s in signal.Signals}


def check_signal(sig: object) -> int | str:
    """A signal as a number (1-64) or a name (SIGTERM or TERM)."""
    if isinstance(sig, str):
        if (sig if sig.startswith("SIG") else "SIG" + sig) in SIGNAL_NAMES:
            return sig
        raise InvalidInput(f"unknown signal {shown(sig)}: give a name such as SIGTERM or "
                           "SIGKILL, or a number from 1 to 64")
    if not is_integer(sig, 1, 64):
        raise InvalidInput(f"signal must be a number from 1 to 64 or a name such as SIGTERM; "
                           f"got {shown(sig)}")
    return sig


HANDLE_RE = re.compile(r"\Ap[0-9]{1,19}\Z")  # what the guest agent gives: p1, p2, ...


def check_handle(handle: object) -> str:
    """A background process's handle as process_start gave it (``p`` and a number)."""
    if not isinstance(handle, str) or not HANDLE_RE.match(handle):
        raise InvalidInput(f"invalid process handle {shown(handle)}: handles are p1, p2, ... "
                           "as process_start gave them (GET .../processes lists them)")
    return handle
