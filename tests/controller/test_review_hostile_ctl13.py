"""The controller, the CLI and the egress proxy against the thirteenth hostile review. No VM.

1. A guest's output reached the operator's terminal raw in lines the CLI writes itself:
   ``forkd eval``'s value (its repr) and ``forkd run-code``'s rich results were echoed as
   the guest made them, so a cell could send ESC sequences (an OSC 52 clipboard write, a
   screen clear, a title), a BEL or a CR that rewrote forkd's own line; ``forkd ls``
   printed a sandbox's snapshot (``origin``, and every text cell of the daemon's answer)
   as it came, line breaks included, so a value could forge rows of the listing. Now
   every line forkd composes shows such characters as escapes (names.inert; a listing's
   cell with names.one_line, which escapes line breaks and tabs too). The demos
   (``forkd demo coding-agent``, ``langgraph``, ``quickstart``'s progress) printed a
   guest's test output and a model's answers raw in their progress, table and problem
   lines: inert too.
2. A guest program's stdout and stderr (``forkd exec``, ``eval``, ``run-code``) were
   written to the terminal byte for byte. Now, to a terminal, they are written inert
   (names.InertStream: a CRLF split between two streamed frames is still a line end, a
   lone CR is ``\\x0d``); to a pipe or a file, or with ``--raw``, exactly as they came
   (cli/output.GuestOutput; docs/api.md, "What the CLI prints").
3. A guest that stopped mid-line made forkd's own words the end of its line
   (``partial forkd: command timed out``, a result glued to a cell's last output): a
   line forkd writes now starts on a line of its own.
4. ``forkd exec`` whose stream ended without a result (a daemon that went away) ended in
   a KeyError's traceback; it is a ForkdError saying what happened and what to check.
   A lone surrogate in a guest's output (its JSON may carry one) ended it in a
   UnicodeEncodeError's, the command's exit code lost: it is written as "?" to a pipe.
5. The MCP server's progress notifications of run_command (what an MCP client shows a
   person while the command runs) carried the guest's control characters; they are
   inert now (the tool's result still has the exact output, for the model).
6. The egress proxy scrubbed a bound secret from the values of an upstream's reply
   headers, never from their names (an upstream echoing the request's headers as names
   handed the guest the key, in a 1xx head as well), and only in the exact case (an echo
   lower- or upper-cased gave it back, less its case). A reply's head (status line,
   names, values, a 1xx's) is now scrubbed whole, in any case; see
   tests/engine/test_egress_review6.py.
7. Nothing bounded the disk all the children's copy-on-write overlays may take together:
   each can grow to its disk's size, so N children could fill the host's disk (and the
   store, and the daemon's database, on it). ``FORKD_DISK_BUDGET`` now bounds it: a child
   is admitted only when every overlay of the run directory could grow to its full size
   within the budget, checked and claimed under one lock (engine/disk_budget.py); one
   that would exceed it fails before its QEMU starts, with an error naming the setting,
   and the others of its fork start as usual; a fork none of whose children the budget
   admitted is that Conflict (409), not a VMMError (500).
8. MCP write_file took a ``content`` string of any length and encoded it whole before
   saying it was too big; its schema now refuses one past mcp.MAX_CONTENT_CHARS (16 MiB
   as base64) first.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from click.testing import CliRunner

from forkd.cli import engine_cmds, output
from forkd.cli.main import cli
from forkd.controller import mcp
from forkd.controller.api import (
    CodeResult,
    EvalError,
    EvalResult,
    ExecFrame,
    ExecResult,
    RunCodeResult,
    SandboxInfo,
)
from forkd.names import InertStream, inert, one_line

OSC52 = "\x1b]52;c;ZXZpbA==\x07"  # writes "evil" to the operator's clipboard
CLEAR = "\x1b[2J\x1b[H"
BAD = [OSC52, CLEAR, "\x07", "\x9b31m", "\u202e", "\r"]  # ESC, BEL, C1 CSI, bidi, CR


def _no_control(text: str) -> None:
    for c in ("\x1b", "\x07", "\x9b", "\u202e", "\r"):
        assert c not in text, (c, text)


class FakeBackend:
    """What the CLI's commands call (controller.backend.Backend), answering what a test
    sets: a hostile guest's output, through a daemon that passes it on."""

    def __init__(self) -> None:
        self.frames: list[ExecFrame] = []
        self.cell: Any = None
        self.listing: list[SandboxInfo] = []

    def exec_stream(self, sandbox_id: str, req: Any) -> Iterator[ExecFrame]:
        yield from self.frames

    def eval(self, sandbox_id: str, req: Any) -> Any:
        return self.cell

    def run_code(self, sandbox_id: str, req: Any) -> Any:
        return self.cell

    def sandboxes(self) -> list[SandboxInfo]:
        return self.listing


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FakeBackend:
    fake = FakeBackend()
    monkeypatch.setattr(engine_cmds, "_backend", lambda: fake)
    return fake


def _terminal(monkeypatch: pytest.MonkeyPatch, stdout: bool, stderr: bool) -> None:
    """The CLI's stdout and stderr are (or are not) terminals, as GuestOutput sees them."""
    import sys

    def is_terminal(stream: Any) -> bool:
        return (stdout and stream is sys.stdout) or (stderr and stream is sys.stderr)

    monkeypatch.setattr(output, "is_terminal", is_terminal)


def _exited(code: int = 0, status: str = "exited") -> ExecFrame:
    return ExecFrame(result=ExecResult(status=status, exit_code=code,  # type: ignore[arg-type]
                                       timed_out=status == "timed_out"))


# -- 1, 2, 3: what the CLI writes to a terminal --------------------------------------------
def test_exec_output_to_a_terminal_is_inert(backend: FakeBackend,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _terminal(monkeypatch, stdout=True, stderr=True)
    backend.frames = [ExecFrame(stdout=f"{OSC52}one\r"), ExecFrame(stdout="\ntwo\rX\n"),
                      ExecFrame(stderr=f"{CLEAR}err\u202e\n"), _exited()]
    result = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    assert result.exit_code == 0, result.output
    _no_control(result.stdout + result.stderr)
    # the CRLF split between two frames is a line's end; a lone CR shows as its escape
    assert result.stdout == "\\x1b]52;c;ZXZpbA==\\x07one\ntwo\\x0dX\n"
    assert result.stderr == "\\x1b[2J\\x1b[Herr\\u202e\n"


def test_exec_output_to_a_pipe_or_with_raw_is_exact(backend: FakeBackend,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    text = "".join(BAD) + "\tdone\r\n"
    backend.frames = [ExecFrame(stdout=text), ExecFrame(stderr=text), _exited(3)]
    _terminal(monkeypatch, stdout=False, stderr=False)
    piped = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    exact = text.encode()  # (Result.stdout reads CRLF as LF: the bytes are what was written)
    assert (piped.exit_code, piped.stdout_bytes, piped.stderr_bytes) == (3, exact, exact)
    _terminal(monkeypatch, stdout=True, stderr=True)
    raw = CliRunner().invoke(cli, ["exec", "--raw", "sb-1", "sh"])
    assert (raw.exit_code, raw.stdout_bytes, raw.stderr_bytes) == (3, exact, exact)
    guests = CliRunner().invoke(cli, ["exec", "sb-1", "sh", "--raw"])  # the guest's option
    _no_control(guests.stdout)


def test_a_lone_surrogate_ends_no_command(backend: FakeBackend,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest's JSON may carry a lone surrogate (``"\\ud800"``), which UTF-8 cannot
    encode: written raw it ended ``forkd exec`` in a UnicodeEncodeError's traceback, the
    command's exit code lost. To a pipe it is a "?", to a terminal its escape."""
    backend.frames = [ExecFrame(stdout="a\ud800b\u00e9\n"), _exited(4)]
    _terminal(monkeypatch, stdout=False, stderr=False)
    piped = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    assert (piped.exit_code, piped.stdout_bytes) == (4, "a?b\u00e9\n".encode())
    _terminal(monkeypatch, stdout=True, stderr=True)
    shown = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    assert (shown.exit_code, shown.stdout) == (4, "a\\ud800b\u00e9\n")


def test_forkd_s_own_line_starts_a_line(backend: FakeBackend,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guest that stops mid-line (or on a held CR) does not get forkd's words appended."""
    _terminal(monkeypatch, stdout=True, stderr=True)
    backend.frames = [ExecFrame(stdout="out-partial"), ExecFrame(stderr="err-partial\r"),
                      _exited(-9, "timed_out")]
    result = CliRunner().invoke(cli, ["exec", "--timeout", "1", "sb-1", "sh"])
    assert result.stdout == "out-partial\n"
    assert result.stderr.startswith("err-partial\\x0d\nforkd: command timed out after 1.0 s")
    _terminal(monkeypatch, stdout=False, stderr=False)  # to files: the output stays as it was
    result = CliRunner().invoke(cli, ["exec", "--timeout", "1", "sb-1", "sh"])
    assert result.stdout == "out-partial"
    assert result.stderr_bytes.startswith(b"err-partial\r\nforkd: command timed out")
    backend.frames[-1] = _exited(0)  # no line of forkd's: not a byte added, to a terminal too
    for terminal in (False, True):
        _terminal(monkeypatch, stdout=terminal, stderr=terminal)
        result = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
        assert result.stdout == "out-partial"
        assert result.stderr_bytes == (b"err-partial\\x0d" if terminal else b"err-partial\r")


def test_an_error_frame_after_output_is_on_a_line_of_its_own(
        backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.errors import NotFound

    def broken(sandbox_id: str, req: Any) -> Iterator[ExecFrame]:
        yield ExecFrame(stderr="half a line")
        raise NotFound(f"sandbox sb-1 is gone {OSC52}")

    _terminal(monkeypatch, stdout=True, stderr=True)
    monkeypatch.setattr(backend, "exec_stream", broken)
    result = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    assert result.exit_code == 3
    assert result.stderr.startswith("half a line\nforkd: error: sandbox sb-1 is gone \\x1b]52")


def test_a_stream_without_a_result_is_an_error_not_a_traceback(
        backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    _terminal(monkeypatch, stdout=False, stderr=False)
    backend.frames = [ExecFrame(stdout="half")]
    result = CliRunner().invoke(cli, ["exec", "sb-1", "sh"])
    assert result.exit_code == 1, result.output
    assert "ended without its result" in result.stderr
    assert not isinstance(result.exception, KeyError)


def test_a_cell_s_value_results_and_error_are_inert_whatever_the_stream(
        backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """eval's repr and run-code's results and error are lines forkd writes: inert even to
    a pipe (--json has them exactly); the cell's own stdout is exact to a pipe."""
    _terminal(monkeypatch, stdout=False, stderr=False)
    evil = "".join(BAD)
    error = EvalError(type="E", message=evil, traceback=f"Traceback\n{evil}")
    backend.cell = EvalResult(repr=f"{evil}value", stdout=f"{evil}no-newline", stderr="",
                              error=error)
    result = CliRunner().invoke(cli, ["eval", "sb-1", "x"])
    assert result.exit_code == 1
    out = result.stdout_bytes.decode()
    assert out.startswith(evil + "no-newline\n")  # exact, then forkd's own line
    shown = out[len(evil) + len("no-newline\n"):]
    _no_control(shown + result.stderr)
    assert shown == inert(f"{evil}value") + "\n"
    backend.cell = RunCodeResult(stdout="cell", results=[CodeResult(text=f"{evil}\nrow 2")])
    result = CliRunner().invoke(cli, ["run-code", "sb-1", "x"])
    assert result.exit_code == 0, result.output
    assert result.stdout == f"cell\n{inert(evil + chr(10) + 'row 2')}\n"
    raw = CliRunner().invoke(cli, ["run-code", "--json", "sb-1", "x"])
    assert "\\u001b]52" in raw.stdout  # the exact text, JSON-escaped


def test_a_listing_shows_each_cell_on_its_line(backend: FakeBackend) -> None:
    info = dict(ref="r:latest", digest="sha256:" + "0" * 64, pid=1, dir="/d", memory="/m",
                disk_backing="/b", memory_mib=64, created=0.0)
    backend.listing = [SandboxInfo(id="sb-1", origin=f"{CLEAR}a\nsb-9  running  1  0s  -  x",
                                   status=f"run\tning{OSC52}", **info)]
    result = CliRunner().invoke(cli, ["ls"])
    assert result.exit_code == 0, result.output
    rows = result.stdout.splitlines()
    assert len(rows) == 2  # the header and one sandbox: no forged row
    _no_control(result.stdout)
    assert "\\x1b[2J" in rows[1] and "\\x0a" in rows[1] and "\\x09" in rows[1]


def test_one_line_and_the_stream_escape_what_a_terminal_obeys() -> None:
    assert one_line("a\nb\tc\x1bd\re") == "a\\x0ab\\x09c\\x1bd\\x0de"
    long = one_line("x" * 1000 + "\n", 100)
    assert len(long) <= 100 and "\n" not in long and "characters cut" in long
    stream = InertStream()
    pieces = [stream.feed(p) for p in ("a\r", "\nb\r", "c\x9b", "\r")]
    assert "".join(pieces) + stream.end() == "a\nb\\x0dc\\x9b\\x0d"
    assert inert("".join(BAD)) == inert(inert("".join(BAD)))


# -- 5: what an MCP client shows of a running command ------------------------------------
def test_run_command_progress_is_inert() -> None:
    sent: list[str | None] = []

    class Ctx:
        async def report_progress(self, progress: float, total: float | None,
                                  message: str | None) -> None:
            sent.append(message)

    async def main() -> None:
        progress = mcp.Progress(Ctx())  # type: ignore[arg-type]

        def run() -> None:
            progress.on_stdout(f"{OSC52}out\r")
            progress.on_stdout("\nnext")
            progress.on_stderr(f"{CLEAR}e")

        await anyio.to_thread.run_sync(run)
        assert progress.stdout.text()[0] == f"{OSC52}out\r\nnext"  # the result: exact

    anyio.run(main)
    assert sent == ["\\x1b]52;c;ZXZpbA==\\x07out", "\nnext", "stderr: \\x1b[2J\\x1b[He"]
    for message in sent:
        _no_control(message or "")



# -- 7: the disk the children's overlays may take together -------------------------------
VIRTUAL = 64 << 20  # each test overlay's disk size (its file is a few clusters)


def _template(where: Path) -> Path:
    from forkd.engine import qcow2

    backing = where / "base.raw"
    backing.write_bytes(b"")
    template = where / "empty.qcow2"
    qcow2.write_empty(template, str(backing), "raw", VIRTUAL)
    return template


def _child_dir(name: str) -> Path:
    from forkd.engine.paths import children_dir

    d = children_dir() / name
    d.mkdir()
    return d


def test_overlays_are_placed_only_within_the_budget(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.engine import disk_budget
    from forkd.errors import Conflict

    template = _template(tmp_path)
    most = disk_budget.most(template)
    assert VIRTUAL < most <= VIRTUAL + VIRTUAL // 4096 + (1 << 20)  # the disk and its tables
    monkeypatch.setenv("FORKD_DISK_BUDGET", str(2 * most + most // 2))
    first = _child_dir("c-1") / "disk.qcow2"
    disk_budget.place_overlay(template, first)
    disk_budget.place_overlay(template, _child_dir("c-2") / "disk.qcow2")
    third = _child_dir("c-3") / "disk.qcow2"
    with pytest.raises(disk_budget.DiskBudgetExceeded, match="FORKD_DISK_BUDGET") as refused:
        disk_budget.place_overlay(template, third)
    assert "kill or pause children, or raise FORKD_DISK_BUDGET" in str(refused.value)
    assert isinstance(refused.value, Conflict)  # HTTP 409 through the daemon
    assert not third.exists()
    # an overlay that grew past its disk's size (it holds its tables too) counts as it is
    with open(first, "r+b") as grown:
        grown.truncate(2 * most)
    monkeypatch.setenv("FORKD_DISK_BUDGET", str(4 * most - 1))  # 3 * most, were it not
    with pytest.raises(disk_budget.DiskBudgetExceeded):
        disk_budget.place_overlay(template, third)
    monkeypatch.delenv("FORKD_DISK_BUDGET")  # unset: no bound, as before
    disk_budget.place_overlay(template, third)
    assert third.exists()


def test_forks_at_once_cannot_both_take_the_last_room(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.engine import disk_budget

    template = _template(tmp_path)
    monkeypatch.setenv("FORKD_DISK_BUDGET", str(3 * disk_budget.most(template)))
    placed: list[str] = []
    refused: list[str] = []
    start = threading.Barrier(12)

    def one(i: int) -> None:
        disk = _child_dir(f"c-{i}") / "disk.qcow2"
        start.wait()
        try:
            disk_budget.place_overlay(template, disk)
            placed.append(disk.parent.name)
        except disk_budget.DiskBudgetExceeded:
            refused.append(disk.parent.name)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert (len(placed), len(refused)) == (3, 9)


@pytest.mark.parametrize("text", ["lots", "10X", "-5", "1.5G", "9" * 20])
def test_a_budget_that_is_not_a_size_is_refused_naming_the_setting(
        text: str, place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from forkd.engine import disk_budget
    from forkd.errors import InvalidInput

    monkeypatch.setenv("FORKD_DISK_BUDGET", text)
    with pytest.raises(InvalidInput, match=r"FORKD_DISK_BUDGET=.* is not a size"):
        disk_budget.place_overlay(_template(tmp_path), _child_dir("c-1") / "disk.qcow2")
    monkeypatch.setenv("FORKD_DISK_BUDGET", "2G")
    assert disk_budget.configured() == 2 << 30


def test_a_child_over_the_budget_fails_before_its_qemu_and_leaves_nothing(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine's launch (every fork, pool process, lazy fork and resume): the
    refused child's directory and records are gone, and the error names the child and the
    setting; no QEMU was started."""
    from types import SimpleNamespace

    from forkd.engine import disk_budget, lifecycle, qemu
    from forkd.engine.disk_budget import DiskBudgetExceeded
    from forkd.engine.lifecycle import ChildVM, Limits
    from forkd.engine.paths import children_dir

    started: list[object] = []
    monkeypatch.setattr(qemu.QemuVM, "launch", lambda self, **_: started.append(self))
    template = _template(tmp_path)
    monkeypatch.setenv("FORKD_DISK_BUDGET", "1M")
    compat = SimpleNamespace(memory_mib=64, vcpus=1, accelerators=["tcg"])
    asm = SimpleNamespace(vmstate=tmp_path / "vmstate", disk=tmp_path / "base.raw",
                          memory=tmp_path / "memory", digest="sha256:" + "0" * 64,
                          config=SimpleNamespace(compat=compat))
    with pytest.raises(DiskBudgetExceeded, match=r"child c-9: .*FORKD_DISK_BUDGET=1.0 MiB"):
        ChildVM.launch(asm, "r:latest", "c-9", template,  # type: ignore[arg-type]
                       Limits(), sandbox=False, with_netns=False)
    assert started == []
    assert not (children_dir() / "c-9").exists()
    assert lifecycle.disk_budget is disk_budget  # the one placement every launch uses



def test_the_demos_show_guest_and_model_text_inert(monkeypatch: pytest.MonkeyPatch) -> None:
    """`forkd demo coding-agent` printed a guest's test output (its last stderr line) and
    `forkd demo langgraph` a model's answers as they came, in forkd's progress, table and
    problem lines."""
    from types import SimpleNamespace

    from forkd.controller import coding_demo, langgraph_demo

    def run(store: Any, tag: str, say: Any) -> Any:
        say(f"source: tests {OSC52}")
        return SimpleNamespace(branch_pause_ms=1.0, branch_ms=1.0, seconds=1.0,
                               problems=[f"lane 2 {CLEAR}"])

    monkeypatch.setattr(coding_demo, "run", run)
    monkeypatch.setattr(coding_demo, "table", lambda report: [f"row {OSC52}\rforged"])
    monkeypatch.setattr("forkd.store.store.Store.open", lambda: None)
    result = CliRunner().invoke(cli, ["demo", "coding-agent"])
    assert "\\x1b]52" in result.stdout and "\\x1b]52" in result.stderr
    _no_control(result.stdout + result.stderr)
    monkeypatch.setattr(langgraph_demo, "run_standin", run)
    monkeypatch.setattr(langgraph_demo, "summary", lambda report: [f"answer {OSC52}"])
    monkeypatch.setattr(langgraph_demo, "side_by_side", lambda report: [CLEAR])
    result = CliRunner().invoke(cli, ["demo", "langgraph"])
    assert result.exit_code == 1
    assert "\\x1b[2J" in result.stderr and "\\x1b]52" in result.stdout
    _no_control(result.stdout + result.stderr)


def test_write_file_s_content_is_bounded_by_the_tool_s_schema(
        place: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """write_file took a content string of any length and encoded it whole (a copy of
    every character, up to 4 bytes each) before it said it was too big; the schema now
    refuses it first, with the bound in the message."""
    from mcp.server.mcpserver.exceptions import ToolError

    from forkd import Controller
    from forkd.controller.mcp import MAX_CONTENT_CHARS

    encoded: list[int] = []
    monkeypatch.setattr(mcp, "_decode", lambda content, encoding: encoded.append(1) or b"")
    server = mcp.build_server(Controller(local=True))
    args = {"sandbox_id": "ghost-1", "path": "/tmp/f",
            "content": "\u00e9" * (MAX_CONTENT_CHARS + 1)}
    with pytest.raises(ToolError, match=str(MAX_CONTENT_CHARS)):
        anyio.run(server.call_tool, "write_file", args)
    assert encoded == []


def test_a_fork_whose_children_are_all_over_the_budget_is_a_conflict(
        place: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every child refused by the budget: the fork's error is DiskBudgetExceeded (the
    caller's 409 through the daemon, naming the setting), not a VMMError (a 500, as if
    the host had failed); one child of several refused is a line of the fork's errors."""
    from types import SimpleNamespace

    from forkd.controller.app import error_answer
    from forkd.engine import children as ch
    from forkd.engine.disk_budget import DiskBudgetExceeded
    from forkd.engine.errors import VMMError

    (tmp_path / "base.raw").write_bytes(b"\0" * 4096)
    asm = SimpleNamespace(disk=tmp_path / "base.raw")
    monkeypatch.setattr(ch, "prepare", lambda store, ref, **_: (asm, False))
    monkeypatch.setattr(ch, "recipe_egress", lambda asm: None)
    outcome = {"ch-1": DiskBudgetExceeded("over FORKD_DISK_BUDGET=1.0 MiB"),
               "ch-2": DiskBudgetExceeded("over FORKD_DISK_BUDGET=1.0 MiB")}

    def spawn_one(asm: Any, ref: str, child_id: str, *_: Any) -> Any:
        raise outcome[child_id]

    ids = iter(["ch-1", "ch-2"])
    monkeypatch.setattr(ch, "new_id", lambda ref: next(ids))
    monkeypatch.setattr(ch, "_spawn_one", spawn_one)
    said = "no child started:\nch-1: .*FORKD_DISK_BUDGET"
    with pytest.raises(DiskBudgetExceeded, match=said) as refused:
        ch.fork(None, "r:latest", 2)  # type: ignore[arg-type]
    assert error_answer(refused.value)[0] == 409
    outcome["ch-2"] = VMMError("QEMU died")  # a failure of another kind among them
    ids = iter(["ch-1", "ch-2"])
    with pytest.raises(VMMError) as failed:
        ch.fork(None, "r:latest", 2)  # type: ignore[arg-type]
    assert not isinstance(failed.value, DiskBudgetExceeded)
