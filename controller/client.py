"""``RemoteBackend``: the controller API over its Unix socket or TCP, as a Backend.

Every answer is decoded into its forkd.controller.api type (a daemon that answers
another shape, or no JSON at all, is a ControllerError, not a dict with surprises), read
within a bound (MAX_ANSWER_BYTES, MAX_ERROR_BYTES, MAX_FRAME_BYTES: what answers at the
URL is not trusted with this process's memory), never decompressed. Deadlines (docs/api.md,
"Timeouts"): connecting gives up after api.CONNECT_TIMEOUT_S; a command waits its own
timeout plus api.ANSWER_GRACE_S (no limit for a command without one); a streamed command
waits at most 4 heartbeats between two frames; anything else api.REQUEST_TIMEOUT_S.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
import msgspec

from forkd import errors
from forkd.addresses import kind
from forkd.controller import api
from forkd.controller.api import (
    BranchRequest,
    BranchResult,
    CompactRequest,
    ErrorAnswer,
    EvalRequest,
    EvalResult,
    ExecFrame,
    ExecRequest,
    ExecResult,
    ExtendRequest,
    LayerInfo,
    PoolRemoved,
    PoolRequest,
    PoolStatus,
    ProcessInfo,
    ProcessKillRequest,
    ProcessSignaled,
    ProcessStartRequest,
    ProcessStdinRequest,
    ProcessWaitRequest,
    ProcessWaitResult,
    Removed,
    RunCodeRequest,
    RunCodeResult,
    SandboxInfo,
    SpawnRequest,
    SpawnResult,
    StdinWritten,
)
from forkd.controller.backend import CALLER_STOP, Stop, Stopped, Transfer
from forkd.engine.commands import check_handle
from forkd.engine.errors import TooManyRequests
from forkd.engine.lifecycle import ID_RE
from forkd.engine.paths import run_dir
from forkd.names import shown

TYPES: dict[str, type[errors.ForkdError]] = {
    cls.__name__: cls
    for cls in (
        errors.InvalidInput,
        errors.NotFound,
        errors.IntegrityError,
        errors.ChainError,
        errors.Conflict,
        TooManyRequests,
    )
}


class ControllerError(errors.ForkdError):
    """The daemon answered with an error (its message and exit code are kept: an exit code
    a failure cannot have, 0 or past 125, is 1)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = failure_exit_code(exit_code)


MAX_EXIT_CODE = 125  # past it a shell reads "not executable", "not found" or a signal


def failure_exit_code(code: int) -> int:
    """``code`` when a failed command may exit with it (1 to MAX_EXIT_CODE), else 1: a
    daemon's error answered with exit code 0 (or 256, which a shell reads as 0) made
    `forkd` print the error and exit 0, and a script went on as if it had worked."""
    return code if 1 <= code <= MAX_EXIT_CODE else 1


# What this process reads of one answer at most. The daemon's largest is a command's
# result (a guest's reply line is at most 64 MiB, agent_client.MAX_LINE), its errors are
# 16,000 characters (app.MAX_MESSAGE_CHARS), a streamed frame 64 Ki characters of output
# (backend.STREAM_FRAME_CHARS, up to 6 bytes each escaped); whatever answers at the URL
# (another server, a proxy, a daemon gone wrong) sending more, or a line without end,
# held all of it in this process's memory.
MAX_ANSWER_BYTES = 256 << 20
MAX_ERROR_BYTES = 1 << 20
MAX_FRAME_BYTES = 1 << 20
# answers are asked for, and read, as they are sent: a compressed one of a few KiB would
# be gigabytes once decoded, past every bound above
IDENTITY = {"Accept-Encoding": "identity"}


def default_socket() -> Path:
    return run_dir() / "controller.sock"


T = TypeVar("T")


def shown_url(url: str) -> str:
    """``url`` for a message: its user information (``user:password@``) replaced."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


def check_plain_http(url: str, token: str | None, plain_http: bool) -> None:
    """InvalidInput for a URL that would carry credentials (the bearer token, a password
    in the URL) over plain ``http://`` to another host than this one (loopback): anyone on
    the path (the LAN, a Wi-Fi, a proxy) reads them and drives the daemon with them, its
    sandboxes and their secrets. ``plain_http=True`` is the caller's choice to send them
    anyway (a network that is the caller's own)."""
    parts = urlsplit(url)
    if plain_http or parts.scheme.lower() != "http" or not (token or "@" in parts.netloc):
        return
    if this_hosts_url(url):
        return
    raise errors.InvalidInput(
        f"refusing to send the bearer token over plain http:// to {shown_url(url)}: anyone "
        "on the path can read it and drive the daemon; use https:// (TLS in front of "
        "`forkd serve --listen`), an SSH tunnel to 127.0.0.1, or pass plain_http=True if "
        "every network between here and there is yours")


def this_hosts_url(url: str) -> bool:
    """``url`` names this host: ``localhost`` or a loopback address."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return kind(host) == "loopback"
    except ValueError:  # a name, not an address
        return False


def sandbox_route(sandbox_id: str, *rest: str) -> str:
    """``/v1/sandboxes/ID[/REST...]`` for a well-formed sandbox id, else InvalidInput (the
    engine's message): an id goes into the URL's path, where ``..``, ``/``, ``?`` or ``#``
    would send the request to another route (``../snapshots/T`` made a kill a snapshot's
    delete; httpx resolves dot segments)."""
    if not isinstance(sandbox_id, str) or not ID_RE.fullmatch(sandbox_id):
        raise errors.InvalidInput(
            f"invalid sandbox id {shown(sandbox_id)}: ids are 1-64 of a-z, 0-9 and '-'; "
            "GET /v1/sandboxes (`forkd ls`) lists them")
    return "/".join(("/v1/sandboxes", sandbox_id, *rest))


def process_route(sandbox_id: str, handle: str, action: str) -> str:
    return sandbox_route(sandbox_id, "processes", check_handle(handle), action)


def ref_route(prefix: str, ref: str) -> str:
    """``PREFIX/REF`` for a snapshot reference or a pool's tag (``NS/NAME:TAG``: its slashes
    stay, the route takes a path), every other character a URL treats specially quoted,
    so the daemon gets exactly ``ref``; a ``.``, ``..`` or empty segment (which would leave
    the route) is InvalidInput."""
    if not isinstance(ref, str) or any(s in ("", ".", "..") for s in ref.split("/")):
        raise errors.InvalidInput(
            f"invalid reference {shown(ref)}: NAME[:TAG], its name parts separated by single "
            "'/' (no empty, '.' or '..' part); GET /v1/snapshots lists them")
    return f"{prefix}/{quote(ref, safe='/:@')}"


class RemoteBackend:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        socket: Path | None = None,
        timeout: float = api.REQUEST_TIMEOUT_S,
        plain_http: bool = False,
    ) -> None:
        """timeout: the deadline of requests that run no command (exec and eval wait as
        long as their command may run: api.answer_timeout). plain_http: send the token
        over ``http://`` to another host than this one (check_plain_http)."""
        if url:
            check_plain_http(url, token, plain_http)
        self.timeout = timeout
        self._url = url
        self._uds = None if url else str(socket or default_socket())
        self._headers = {**IDENTITY, **({"Authorization": f"Bearer {token}"} if token
                                         else {})}
        self.http = self._client()
        # in every message: never a password of the URL
        self.where = shown_url(url) if url else str(self._uds)

    def _client(self) -> httpx.Client:
        """A client of the daemon: the URL's, else the Unix socket's."""
        limit = httpx.Timeout(self.timeout, connect=api.CONNECT_TIMEOUT_S)
        if self._url:
            # a daemon on this host is reached directly: a proxy of the environment
            # (HTTP_PROXY) was sent the token in the clear, and reached its own loopback
            direct = this_hosts_url(self._url)
            return httpx.Client(base_url=self._url, headers=self._headers, timeout=limit,
                                trust_env=not direct)
        return httpx.Client(transport=httpx.HTTPTransport(uds=self._uds),
                            base_url="http://forkd", headers=self._headers, timeout=limit)

    def close(self) -> None:
        self.http.close()

    def alive(self) -> bool:
        """Whether a daemon answers /healthz with 200; its body is not read (whatever
        answers there could send one without end)."""
        try:
            with self.http.stream("GET", "/healthz", timeout=2) as resp:
                return resp.status_code == 200
        except httpx.HTTPError:
            return False

    def _unreachable(self, exc: httpx.HTTPError) -> ControllerError:
        if isinstance(exc, httpx.TimeoutException):
            return ControllerError(
                f"controller at {self.where} did not answer in time ({exc}); the request may "
                "still be running there"
            )
        return ControllerError(
            f"controller at {self.where} unreachable: {exc}; is `forkd serve` running?"
        )

    def _call(self, method: str, url: str, **kwargs: Any) -> bytes:
        """The answer's body (read within its bound: answer_body); its error raised."""
        stop = CALLER_STOP.get()
        try:
            if stop is None:
                with self.http.stream(method, url, **kwargs) as resp:
                    status, content = resp.status_code, self._body(resp, method, url)
            else:
                status, content = self._stoppable(stop, method, url, **kwargs)
        except httpx.HTTPError as exc:
            if stop is not None and stop():
                raise Stopped(stop.reason) from None
            raise self._unreachable(exc) from exc
        if status >= 400:
            raise answered_error(status, content)
        return content

    def _body(self, resp: httpx.Response, method: str, url: str) -> bytes:
        """answer_body of ``resp``, for ``method url`` of this daemon."""
        return answer_body(resp, f"controller at {self.where} answered {method} {url}")

    def _stoppable(self, stop: Stop, method: str, url: str,
                   **kwargs: Any) -> tuple[int, bytes]:
        """The request on a connection of its own, shut down once ``stop`` is set (its
        caller's token revoked: `forkd mcp`'s Revocation): the daemon sees its client go
        (app.CallerWatch) and stops the request's work in the guest. Without this an MCP
        tool's cell ran in the sandbox to its own timeout after the caller's token was
        revoked, only its result dropped: this process, the daemon's client, was still
        there waiting for it."""
        sockets: list[socket.socket] = []
        lock = threading.Lock()
        cut = False

        def shut(sock: socket.socket) -> None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

        def stopped() -> None:
            nonlocal cut
            with lock:
                cut = True
                for sock in sockets:
                    shut(sock)

        def connected(event: str, info: dict[str, Any]) -> None:
            if not event.endswith(".complete") or ".connect_" not in event:
                return
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with lock:
                    sockets.append(sock)
                    if cut:
                        shut(sock)

        with self._client() as http, stop.calling(stopped), http.stream(
                method, url, extensions={"trace": connected}, **kwargs) as resp:
            return resp.status_code, self._body(resp, method, url)

    def _get(
        self,
        answer: type[T],
        method: str,
        url: str,
        body: msgspec.Struct | None = None,
        **kwargs: Any,
    ) -> T:
        if body is not None:
            kwargs["content"] = msgspec.json.encode(body)
            kwargs["headers"] = {"Content-Type": "application/json"}
        content = self._call(method, url, **kwargs)
        try:
            return msgspec.json.decode(content, type=answer)
        except msgspec.DecodeError as exc:  # not JSON, or not the answer's shape
            raise ControllerError(
                f"controller at {self.where} answered {method} {url} with an unexpected "
                f"shape ({exc}); is it another forkd version?"
            ) from exc

    def snapshots(self) -> list[LayerInfo]:
        return self._get(list[LayerInfo], "GET", "/v1/snapshots")

    def snapshot(self, ref: str) -> dict[str, Any]:
        return self._get(dict[str, Any], "GET", ref_route("/v1/snapshots", ref))

    def delete_snapshot(self, ref: str, cascade: bool = False) -> Removed:
        return self._get(
            Removed, "DELETE", ref_route("/v1/snapshots", ref),
            params={"cascade": str(cascade).lower()},
        )

    def compact(self, req: CompactRequest) -> LayerInfo:
        return self._get(LayerInfo, "POST", "/v1/compact", req)

    def spawn(self, req: SpawnRequest) -> SpawnResult:
        return self._get(SpawnResult, "POST", "/v1/sandboxes", req)

    def extend(self, sandbox_id: str, req: ExtendRequest) -> SandboxInfo:
        return self._get(SandboxInfo, "POST", sandbox_route(sandbox_id, "extend"), req)

    def pause(self, sandbox_id: str) -> SandboxInfo:
        return self._get(SandboxInfo, "POST", sandbox_route(sandbox_id, "pause"))

    def resume(self, sandbox_id: str) -> SandboxInfo:
        return self._get(SandboxInfo, "POST", sandbox_route(sandbox_id, "resume"))

    def pools(self) -> list[PoolStatus]:
        return self._get(list[PoolStatus], "GET", "/v1/pools")

    def fill_pool(self, req: PoolRequest) -> PoolStatus:
        return self._get(PoolStatus, "POST", "/v1/pools", req)

    def remove_pool(self, tag: str) -> PoolRemoved:
        return self._get(PoolRemoved, "DELETE", ref_route("/v1/pools", tag))

    def sandboxes(self) -> list[SandboxInfo]:
        return self._get(list[SandboxInfo], "GET", "/v1/sandboxes")

    def sandbox(self, sandbox_id: str) -> SandboxInfo:
        return self._get(SandboxInfo, "GET", sandbox_route(sandbox_id))

    def kill(self, sandbox_id: str) -> SandboxInfo:
        return self._get(SandboxInfo, "DELETE", sandbox_route(sandbox_id))

    def exec(self, sandbox_id: str, req: ExecRequest) -> ExecResult:
        return self._get(
            ExecResult,
            "POST",
            sandbox_route(sandbox_id, "exec"),
            req,
            timeout=waiting(api.answer_timeout(req.timeout)),
        )

    def exec_stream(self, sandbox_id: str, req: ExecRequest) -> Transfer[ExecFrame]:
        """The frames of ``POST …/exec/stream`` as they arrive; the last one has ``result``.
        Waits at most 4 heartbeats (api.HEARTBEAT_S) between two frames, however long the
        command runs; an ``error`` frame is raised as its error family. The iterator's
        ``abandon`` (from any thread) ends the stream at once: the daemon sees its client
        go and kills the command."""
        url = sandbox_route(sandbox_id, "exec", "stream")
        frames: RemoteFrames[ExecFrame] = RemoteFrames()
        frames.start(self._frames(url, req, frames))
        return frames

    def _frames(self, url: str, req: ExecRequest,
                frames: RemoteFrames[ExecFrame]) -> Iterator[ExecFrame]:
        limit = httpx.Timeout(4 * api.HEARTBEAT_S, connect=api.CONNECT_TIMEOUT_S)
        try:
            with self.http.stream(
                "POST",
                url,
                content=msgspec.json.encode(req),
                headers={"Content-Type": "application/json"},
                timeout=limit,
            ) as resp:
                frames.reading(resp)
                if resp.status_code >= 400:
                    raise answered_error(resp.status_code, self._body(resp, "POST", url))
                for line in answer_lines(resp, f"controller at {self.where} answered {url}"):
                    if not line:
                        continue
                    frame = self._frame(line, url)
                    if frame.error is not None:
                        raise error_of(frame.error)
                    yield frame
                    if frame.result is not None:
                        return
        except httpx.HTTPError as exc:
            if frames.abandoned:
                raise ControllerError(f"the stream of {url} was abandoned") from exc
            raise self._unreachable(exc) from exc
        raise ControllerError(f"controller at {self.where} ended {url} before the result")

    def _frame(self, line: bytes, url: str) -> ExecFrame:
        try:
            return msgspec.json.decode(line, type=ExecFrame)
        except msgspec.DecodeError as exc:
            raise ControllerError(
                f"controller at {self.where} sent {url} a line that is not a frame ({exc}); "
                "is it another forkd version?") from exc

    def eval(self, sandbox_id: str, req: EvalRequest) -> EvalResult:
        return self._get(
            EvalResult,
            "POST",
            sandbox_route(sandbox_id, "eval"),
            req,
            timeout=waiting(api.answer_timeout(req.timeout)),
        )

    def run_code(self, sandbox_id: str, req: RunCodeRequest) -> RunCodeResult:
        return self._get(
            RunCodeResult,
            "POST",
            sandbox_route(sandbox_id, "run_code"),
            req,
            timeout=waiting(api.answer_timeout(req.timeout)),
        )

    def process_start(self, sandbox_id: str, req: ProcessStartRequest) -> ProcessInfo:
        return self._get(ProcessInfo, "POST", sandbox_route(sandbox_id, "processes"), req)

    def processes(self, sandbox_id: str) -> list[ProcessInfo]:
        return self._get(list[ProcessInfo], "GET", sandbox_route(sandbox_id, "processes"))

    def process_wait(
        self, sandbox_id: str, handle: str, req: ProcessWaitRequest
    ) -> ProcessWaitResult:
        url = process_route(sandbox_id, handle, "wait")
        return self._get(
            ProcessWaitResult, "POST", url, req, timeout=waiting(api.answer_timeout(req.timeout))
        )

    def process_stdin(self, sandbox_id: str, handle: str, req: ProcessStdinRequest) -> StdinWritten:
        url = process_route(sandbox_id, handle, "stdin")
        return self._get(StdinWritten, "POST", url, req)

    def process_kill(
        self, sandbox_id: str, handle: str, req: ProcessKillRequest
    ) -> ProcessSignaled:
        url = process_route(sandbox_id, handle, "kill")
        return self._get(ProcessSignaled, "POST", url, req)

    def write_file(self, sandbox_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        self._call(
            "PUT",
            sandbox_route(sandbox_id, "files"),
            params={"path": path, "mode": mode},
            content=data,
        )

    def read_file(self, sandbox_id: str, path: str) -> Transfer[bytes]:
        """The file's bytes in chunks as the daemon passes them on (it streams them from
        the guest); a body cut short is a ControllerError, never a shorter file. The
        iterator's ``abandon`` (from any thread) ends the transfer at once, also while a
        read waits for a chunk that never comes (a FIFO nobody writes)."""
        chunks: RemoteFrames[bytes] = RemoteFrames()
        chunks.start(self._chunks(sandbox_route(sandbox_id, "files"), sandbox_id, path,
                                  chunks))
        return chunks

    def _chunks(self, url: str, sandbox_id: str, path: str,
                chunks: RemoteFrames[bytes]) -> Iterator[bytes]:
        started = False
        try:
            # a connection of its own, known from its connect (``connected``): the answer
            # starts only with the first chunk (or 5 s without one, app.FIRST_CHUNK_WAIT_S),
            # and an abandon while it waits for it must end the transfer then
            with self._client() as http, http.stream(
                    "GET", url, params={"path": path},
                    extensions={"trace": chunks.connected}) as resp:
                chunks.reading(resp)
                if resp.status_code >= 400:
                    raise answered_error(resp.status_code, self._body(resp, "GET", url))
                started = True
                yield from resp.iter_raw()
        except httpx.HTTPError as exc:
            if chunks.abandoned:
                raise ControllerError(f"the transfer of {path} was abandoned") from exc
            if started and not isinstance(exc, httpx.TimeoutException):
                raise ControllerError(
                    f"controller at {self.where} ended {path} of {sandbox_id} before its end "
                    f"({exc}): the read failed there, its log says why"
                ) from exc
            raise self._unreachable(exc) from exc

    def branch(self, sandbox_id: str, req: BranchRequest) -> BranchResult:
        return self._get(BranchResult, "POST", sandbox_route(sandbox_id, "branch"), req)


class RemoteFrames(Iterator[T]):
    """A streamed exec's frames (RemoteBackend._frames), or a file's chunks (_chunks), with
    ``abandon``, callable from any thread, also while another waits in ``next`` for an
    item: the connection is shut down, so that read ends now and the daemon, its client
    gone, kills the command or ends the file's transfer."""

    def __init__(self) -> None:
        self._frames: Iterator[T] = iter(())
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()
        self.abandoned = False

    def start(self, frames: Iterator[T]) -> None:
        self._frames = frames

    def reading(self, resp: httpx.Response) -> None:
        """The answer being read: its connection is what ``abandon`` shuts down."""
        stream = resp.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        with self._lock:
            self._socket = sock if isinstance(sock, socket.socket) else None
            gone = self.abandoned
        if gone:
            self.abandon()

    def connected(self, event: str, info: dict[str, Any]) -> None:
        """An httpx trace hook: the connection being made is what ``abandon`` shuts down,
        also before its answer starts."""
        if not event.endswith(".complete") or ".connect_" not in event:
            return
        stream = info.get("return_value")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if isinstance(sock, socket.socket):
            with self._lock:
                self._socket = sock
                gone = self.abandoned
            if gone:
                self.abandon()

    def __next__(self) -> T:
        if self.abandoned:
            raise StopIteration
        return next(self._frames)

    def close(self) -> None:
        close = getattr(self._frames, "close", None)
        if close is not None:
            close()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            sock = self._socket
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def answer_body(resp: httpx.Response, what: str) -> bytes:
    """The body of ``resp`` as sent (never decompressed), read up to its bound: an error's
    MAX_ERROR_BYTES, any other answer's MAX_ANSWER_BYTES; ControllerError past it, its
    rest not read (the connection is closed)."""
    limit = MAX_ERROR_BYTES if resp.status_code >= 400 else MAX_ANSWER_BYTES
    parts: list[bytes] = []
    size = 0
    for chunk in resp.iter_raw():
        size += len(chunk)
        if size > limit:
            raise ControllerError(
                f"{what} with more than {limit} bytes (client.MAX_ANSWER_BYTES, "
                "MAX_ERROR_BYTES); no forkd daemon answers that much: is the URL a forkd "
                "daemon's?")
        parts.append(chunk)
    return b"".join(parts)


def answer_lines(resp: httpx.Response, what: str) -> Iterator[bytes]:
    """The lines of a streamed answer as sent (never decompressed), each up to
    MAX_FRAME_BYTES; ControllerError for a longer one, never held whole."""
    pending = bytearray()
    for chunk in resp.iter_raw():
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            pending += chunk[start:end]
            yield bytes(pending)
            pending.clear()
            start = end + 1
        pending += chunk[start:]
        if len(pending) > MAX_FRAME_BYTES:
            raise ControllerError(
                f"{what} with a line of more than {MAX_FRAME_BYTES} bytes "
                "(client.MAX_FRAME_BYTES); no forkd daemon sends one: is the URL a forkd "
                "daemon's?")
    if pending:
        yield bytes(pending)


def waiting(seconds: float | None) -> httpx.Timeout:
    """Wait ``seconds`` for an answer (None: as long as it takes), connect as usual."""
    return httpx.Timeout(seconds, connect=api.CONNECT_TIMEOUT_S)


def error_of(body: api.ErrorBody) -> errors.ForkdError:
    """The daemon's error as its family (same message), else a ControllerError."""
    cls = TYPES.get(body.type)
    if cls is not None:
        return cls(body.message)
    return ControllerError(body.message, body.exit_code)


def answered_error(status: int, content: bytes) -> errors.ForkdError:
    try:
        return error_of(msgspec.json.decode(content, type=ErrorAnswer).error)
    except msgspec.DecodeError:
        return ControllerError(
            f"controller answered {status}: {shown(content.decode('utf-8', 'replace'), 200)}")
