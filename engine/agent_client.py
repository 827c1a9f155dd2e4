"""Host side of the guest agent protocol (docs/agent-protocol.md)."""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forkd.engine.errors import AgentError
from forkd.engine.qmp import LineSocket, LineTooLong, connect_unix

PROTOCOL = 1


class AgentClient:
    """One connection to a guest agent's virtio-serial socket."""

    def __init__(self, path: Path, *, timeout: float = 10.0,
                 alive: Callable[[], bool] | None = None) -> None:
        self.path = path
        self._ls = LineSocket(connect_unix(path, time.monotonic() + timeout, alive,
                                           "agent socket"))
        self._ids = itertools.count(int(time.time() * 1000) % 1_000_000_000)
        self.hello: dict[str, Any] | None = None

    def wait_hello(self, timeout: float, alive: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Wait for the agent's unsolicited hello line (cold boot only)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._ls.readline(min(deadline, time.monotonic() + 1.0), "guest agent")
            except TimeoutError:
                if alive is not None and not alive():
                    raise AgentError("the VM exited before its agent said hello; "
                                     "see the serial log") from None
                if time.monotonic() > deadline:
                    raise AgentError(f"guest agent did not start within {timeout:.0f} s; "
                                     "see the serial log") from None
                continue
            except EOFError as e:
                raise AgentError(f"agent socket closed during boot: {e}") from e
            except LineTooLong as e:
                raise AgentError(f"guest agent's hello refused: {e}") from e
            msg = json.loads(line)
            if "hello" in msg:
                hello: dict[str, Any] = msg["hello"]
                if hello.get("protocol") != PROTOCOL:
                    raise AgentError(f"guest agent speaks protocol {hello.get('protocol')}, "
                                     f"the host speaks {PROTOCOL}; rebuild the image")
                self.hello = hello
                return hello

    def request(self, op: str, args: dict[str, Any] | None = None, *,
                timeout: float = 30.0) -> dict[str, Any]:
        """Send one request and wait (until timeout) for the reply with the same id."""
        rid = next(self._ids)
        msg = {"v": PROTOCOL, "id": rid, "op": op, **(args or {})}
        deadline = time.monotonic() + timeout
        try:
            self._ls.send(json.dumps(msg).encode() + b"\n")
            while True:
                reply = json.loads(self._ls.readline(deadline, f"guest agent ({op})"))
                if reply.get("id") == rid:
                    break
        except (OSError, TimeoutError, EOFError, ValueError) as e:
            self.close()
            raise AgentError(f"agent request {op!r} failed: {e}") from e
        if not reply.get("ok"):
            err = reply.get("error") or {}
            raise AgentError(f"guest agent refused {op!r}: {err.get('message', reply)}")
        result: dict[str, Any] = reply.get("result") or {}
        return result

    def ping(self, timeout: float = 10.0) -> dict[str, Any]:
        return self.request("ping", timeout=timeout)

    def exec(self, argv: list[str], *, env: dict[str, str] | None = None, cwd: str | None = None,
             stdin: bytes | None = None, timeout: float | None = None) -> dict[str, Any]:
        args: dict[str, Any] = {"argv": argv}
        if env:
            args["env"] = env
        if cwd:
            args["cwd"] = cwd
        if stdin is not None:
            args["stdin"] = base64.b64encode(stdin).decode()
            args["stdin_b64"] = True
        if timeout is not None:
            args["timeout"] = timeout
        return self.request("exec", args, timeout=(timeout or 3600) + 10)

    def eval(self, code: str, timeout: float = 300.0) -> dict[str, Any]:
        return self.request("eval", {"code": code}, timeout=timeout)

    def put(self, path: str, data: bytes, mode: int = 0o644) -> dict[str, Any]:
        return self.request("put", {"path": path, "data": base64.b64encode(data).decode(),
                                    "mode": mode})

    def get(self, path: str) -> bytes:
        return base64.b64decode(self.request("get", {"path": path})["data"])

    def close(self) -> None:
        self._ls.close()
