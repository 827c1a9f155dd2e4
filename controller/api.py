"""The controller API, declared once: every request and answer type, and every operation.

The REST handlers (controller/app.py), the in-process and remote backends
(controller/backend.py, controller/client.py), the Python SDK (controller/sdk.py), the
OpenAPI document (docs/openapi-controller.json) and the TypeScript types
(sdk/typescript/src/api.d.ts) all follow from this module;
tests/controller/test_api_declaration.py fails when one of them drifts from it.

Requests are msgspec Structs that refuse unknown fields (a misspelt option is a 400, not
a silently ignored one). Answers that the engine or the store already declare
(``LayerInfo``, ``BranchResult``) are used as they are, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from forkd.bodies import Body
from forkd.engine.branch import BranchResult
from forkd.engine.commands import (
    check_command,
    check_payload,
    check_signal,
    check_timeout,
)
from forkd.store.store import LayerInfo

__all__ = ["BranchResult", "LayerInfo"]  # answers declared where they are made

# -- timeouts (docs/api.md, "Timeouts") -----------------------------------------------
EVAL_TIMEOUT_S = 300.0  # an eval without its own timeout gives up after this
REQUEST_TIMEOUT_S = 600.0  # a client's deadline for requests that run no command
CONNECT_TIMEOUT_S = 10.0  # a client's deadline to connect to the daemon
ANSWER_GRACE_S = 60.0  # a client waits a command's own timeout plus this for its answer
HEARTBEAT_S = 15.0  # a streamed exec sends at least one frame this often


class Request(Body):
    """A request body: unknown fields are refused (forkd.bodies). The requests that go to a
    guest check their values as they are made (``__post_init__``, with engine/commands.py,
    the checks the engine makes too): a bad argv, env, cwd, timeout or signal is an
    InvalidInput (400) before any sandbox is looked up."""


class SpawnRequest(Request):
    """``POST /v1/sandboxes``: fork ``n`` sandboxes of a snapshot tag."""

    tag: str
    n: int = 1
    memory_limit_mib: int | None = None
    netns: bool = False
    sandbox: bool = True  # QEMU's -sandbox on
    prewarm: int | None = None  # after serving: keep this many processes waiting for the tag
    timeout: float | None = None  # seconds until each sandbox is killed or paused
    on_timeout: Literal["kill", "pause"] = "kill"
    cpus: float | None = None  # CPU time, in CPUs (0.5 = half of one core)
    pids_max: int | None = None  # host tasks of the sandbox's QEMU
    disk_bps: int | None = None  # disk bytes/s, read + write
    disk_iops: int | None = None  # disk operations/s, read + write
    net_kbit: int | None = None  # network kbit/s to the sandbox (tbf on its tap)
    egress: list[str] | None = None  # HOST[:PORT] it may reach (None: recipe's; []: none)
    lazy: bool = False  # tag is [HUB/]NS/NAME[:TAG]: fork before the pack has arrived


class PoolRequest(Request):
    """``POST /v1/pools``: keep ``k`` processes of ``tag`` waiting (0 empties the pool)."""

    tag: str
    k: int
    memory_limit_mib: int | None = None
    netns: bool = False
    sandbox: bool = True
    wait: bool = False  # answer once the k processes are started


class ExtendRequest(Request):
    seconds: float


class ExecRequest(Request):
    """A command: ``argv`` runs as it is (no shell); ``stdin`` travels as base64."""

    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bytes | None = msgspec.field(default=None, name="stdin_b64")
    timeout: float | None = None  # seconds; the command is killed then (none: no limit)

    def __post_init__(self) -> None:
        check_command(self.argv, self.env, self.cwd)
        check_payload("stdin", self.stdin)
        check_timeout("timeout", self.timeout)


class EvalRequest(Request):
    code: str
    timeout: float = EVAL_TIMEOUT_S

    def __post_init__(self) -> None:
        check_timeout("timeout", self.timeout)


class RunCodeRequest(Request):
    """A code-interpreter cell, run in the warm interpreter's namespace."""

    code: str
    timeout: float | None = EVAL_TIMEOUT_S

    def __post_init__(self) -> None:
        check_timeout("timeout", self.timeout)


class ProcessStartRequest(Request):
    """A background process (its own process group); its stdin stays open."""

    argv: list[str]
    env: dict[str, str] | None = None
    cwd: str | None = None
    stdin: bytes | None = msgspec.field(default=None, name="stdin_b64")
    pty: bool = False

    def __post_init__(self) -> None:
        check_command(self.argv, self.env, self.cwd)
        check_payload("stdin", self.stdin)


class ProcessWaitRequest(Request):
    timeout: float | None = None  # seconds to wait (then running: true); none: until it ends

    def __post_init__(self) -> None:
        check_timeout("timeout", self.timeout)


class ProcessStdinRequest(Request):
    data: bytes | None = msgspec.field(default=None, name="data_b64")  # none: write nothing
    close: bool = False  # close its stdin after writing

    def __post_init__(self) -> None:
        check_payload("data", self.data)


class ProcessKillRequest(Request):
    signal: int | str = "SIGKILL"  # a number or a name; the whole process group gets it

    def __post_init__(self) -> None:
        check_signal(self.signal)


class BranchRequest(Request):
    tag: str
    force: bool = False  # replace the tag when it exists


class CompactRequest(Request):
    ref: str
    to: str


# -- answers -----------------------------------------------------------------------
class Answer(msgspec.Struct, kw_only=True):
    """An answer body (clients accept fields they do not know: the API may add some)."""


class Health(Answer):
    status: str
    version: str


class SandboxInfo(Answer):
    """One sandbox: its on-disk record (engine ChildInfo) and the time left."""

    id: str
    ref: str
    digest: str
    pid: int
    dir: str
    memory: str
    disk_backing: str
    memory_mib: int
    created: float
    cgroup: str | None = None
    cgroup_version: str | None = None
    cgroups: dict[str, str] = {}
    netns: str | None = None
    mac: str | None = None
    ip: str | None = None
    limits: dict[str, Any] = {}
    sandbox: bool = True
    deadline: float | None = None
    timeout_s: float | None = None
    on_timeout: str = "kill"
    paused_tag: str | None = None
    origin: str | None = None
    timings_ms: dict[str, float] = {}
    status: str = "running"  # running, paused, crashed; killed in a kill's answer
    egress: dict[str, Any] = {}  # the egress policy (engine/egress): {} without one
    proxy_pid: int | None = None  # its egress proxy process while it runs
    time_left_s: float | None = None


class SpawnResult(Answer):
    sandboxes: list[SandboxInfo]
    assemble_ms: float
    total_ms: float
    errors: list[str]  # one line per sandbox that did not start (the others did)


class ExecResult(Answer):
    """How a command ended (the engine's agent_client.ExecResult, docs/agent-protocol.md)."""

    status: Literal["exited", "signaled", "killed", "timed_out", "oom_killed"]
    exit_code: int  # 127 not found, 126 not executable, -N ended by signal N
    signal: int | None = None  # the signal that ended it, if one did
    timed_out: bool = False  # its own timeout ended it (its whole process group)
    killed: bool = False  # a kill request ended it
    oom_killed: bool = False  # the guest's OOM killer ended it
    duration: float = 0.0  # seconds it ran
    stdout: str = ""  # empty when the output was streamed (it came in frames)
    stderr: str = ""
    pid: int | None = None


class ExecFrame(Answer, omit_defaults=True):
    """One line of a streamed exec (``application/x-ndjson``): output as it comes
    (``stdout`` or ``stderr``), an empty frame as a heartbeat, and last either ``result``
    (the command ended) or ``error`` (it could not run: the REST error body)."""

    stdout: str | None = None
    stderr: str | None = None
    result: ExecResult | None = None
    error: ErrorBody | None = None


class EvalError(Answer):
    type: str
    message: str
    traceback: str = ""


class EvalResult(Answer):
    value: Any = None  # the trailing expression's value when it is JSON, else null
    repr: str | None = None
    stdout: str = ""
    stderr: str = ""
    error: EvalError | None = None


class CodeResult(Answer):
    """One rich result of a cell (E2B's code interpreter's shape): ``text`` always, and
    whichever forms the object renders itself as (png and jpeg in base64)."""

    text: str
    is_main_result: bool = False  # the value of the cell's last expression
    png: str | None = None
    jpeg: str | None = None
    html: str | None = None
    markdown: str | None = None
    svg: str | None = None
    latex: str | None = None
    json: Any = None


class RunCodeResult(Answer):
    results: list[CodeResult] = []  # open matplotlib figures, then the main result
    stdout: str = ""
    stderr: str = ""
    error: EvalError | None = None
    value: Any = None
    repr: str | None = None


class ProcessInfo(Answer):
    handle: str
    pid: int
    argv: list[str]
    pty: bool = False
    status: str | None = None  # None while it runs; then as ExecResult.status
    running: bool = True
    exit_code: int | None = None
    started_s_ago: float = 0.0


class ProcessWaitResult(Answer):
    """``running: true`` when the wait timed out; once it ended, how (the ExecResult fields)
    and the handle is forgotten."""

    handle: str
    running: bool
    status: str | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False
    killed: bool = False
    oom_killed: bool = False
    duration: float | None = None
    stdout: str = ""
    stderr: str = ""


class StdinWritten(Answer):
    bytes: int
    closed: bool


class ProcessSignaled(Answer):
    handle: str
    signal: int


class Removed(Answer):
    removed: list[str]


class PoolStatus(Answer):
    tag: str
    target: int
    waiting: int
    starting: int
    digest: str | None
    memory_limit_mib: int | None
    limits: dict[str, Any]
    sandbox: bool
    netns: bool
    taken: int
    last_error: str | None


class PoolRemoved(Answer):
    tag: str
    removed: bool


class ErrorBody(Answer):
    type: str  # the error family: InvalidInput, NotFound, Conflict, IntegrityError, …
    message: str
    exit_code: int


class ErrorAnswer(Answer):
    error: ErrorBody


# -- operations --------------------------------------------------------------------
@dataclass(frozen=True)
class Operation:
    """One API operation: the Backend method ``name``, its REST route, what it takes
    (path parameters, query parameters, a JSON ``body`` type or raw bytes) and answers."""

    name: str
    method: str
    path: str
    answer: Any  # a type; None: no body (204)
    body: type[Request] | type[bytes] | None = None
    query: tuple[str, ...] = ()
    status: int = 200
    stream: bool = False  # the answer is NDJSON lines of ``answer``, or raw bytes in chunks


SANDBOX = "/v1/sandboxes/{sandbox_id}"
PROCESS = SANDBOX + "/processes/{handle}"
OPERATIONS: tuple[Operation, ...] = (
    Operation("snapshots", "GET", "/v1/snapshots", list[LayerInfo]),
    Operation("snapshot", "GET", "/v1/snapshots/{ref}", dict[str, Any]),
    Operation("delete_snapshot", "DELETE", "/v1/snapshots/{ref}", Removed, query=("cascade",)),
    Operation("compact", "POST", "/v1/compact", LayerInfo, CompactRequest, status=201),
    Operation("spawn", "POST", "/v1/sandboxes", SpawnResult, SpawnRequest, status=201),
    Operation("sandboxes", "GET", "/v1/sandboxes", list[SandboxInfo]),
    Operation("sandbox", "GET", SANDBOX, SandboxInfo),
    Operation("kill", "DELETE", SANDBOX, SandboxInfo),
    Operation("extend", "POST", SANDBOX + "/extend", SandboxInfo, ExtendRequest),
    Operation("pause", "POST", SANDBOX + "/pause", SandboxInfo),
    Operation("resume", "POST", SANDBOX + "/resume", SandboxInfo),
    Operation("exec", "POST", SANDBOX + "/exec", ExecResult, ExecRequest),
    Operation("exec_stream", "POST", SANDBOX + "/exec/stream", ExecFrame, ExecRequest, stream=True),
    Operation("eval", "POST", SANDBOX + "/eval", EvalResult, EvalRequest),
    Operation("run_code", "POST", SANDBOX + "/run_code", RunCodeResult, RunCodeRequest),
    Operation(
        "process_start",
        "POST",
        SANDBOX + "/processes",
        ProcessInfo,
        ProcessStartRequest,
        status=201,
    ),
    Operation("processes", "GET", SANDBOX + "/processes", list[ProcessInfo]),
    Operation("process_wait", "POST", PROCESS + "/wait", ProcessWaitResult, ProcessWaitRequest),
    Operation("process_stdin", "POST", PROCESS + "/stdin", StdinWritten, ProcessStdinRequest),
    Operation("process_kill", "POST", PROCESS + "/kill", ProcessSignaled, ProcessKillRequest),
    Operation(
        "write_file", "PUT", SANDBOX + "/files", None, bytes, query=("path", "mode"), status=204
    ),
    Operation("read_file", "GET", SANDBOX + "/files", bytes, query=("path",), stream=True),
    Operation("branch", "POST", SANDBOX + "/branch", BranchResult, BranchRequest, status=201),
    Operation("pools", "GET", "/v1/pools", list[PoolStatus]),
    Operation("fill_pool", "POST", "/v1/pools", PoolStatus, PoolRequest),
    Operation("remove_pool", "DELETE", "/v1/pools/{tag}", PoolRemoved),
)
BY_NAME = {op.name: op for op in OPERATIONS}


def answer_timeout(command_timeout: float | None) -> float | None:
    """How long a client waits for the answer of a command that may run
    ``command_timeout`` seconds: that plus ANSWER_GRACE_S, or no limit (None) for a
    command without one. Never shorter than the command's own timeout."""
    return None if command_timeout is None else command_timeout + ANSWER_GRACE_S
