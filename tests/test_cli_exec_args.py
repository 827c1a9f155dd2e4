"""`forkd exec ID CMD ARGS...`: everything from CMD on is the guest's, options included
(issue 15: `forkd exec ID python3 -c … --help` printed forkd's help)."""

from __future__ import annotations

import click
import pytest

from forkd.cli.engine_cmds import exec_cmd


def parse(*args: str) -> dict[str, object]:
    ctx = exec_cmd.make_context("exec", list(args))
    return ctx.params


@pytest.mark.parametrize(
    "guest",
    [
        ["python3", "-c", "print(1)", "--help"],
        ["ls", "--json"],
        ["grep", "-e", "x", "--timeout", "3", "--cwd", "/", "--stdin"],
        ["sh", "-c", "echo $0", "-h"],
        ["env", "--env=A=1", "-eB=2"],
        ["ls", "--", "--all"],  # a -- after CMD is the guest's
        ["-"],
    ],
)
def test_guest_arguments_are_passed_untouched(guest: list[str]) -> None:
    params = parse("child-1", *guest)
    assert params["child_id"] == "child-1"
    assert list(params["argv"]) == guest  # type: ignore[call-overload]
    assert params["timeout"] is None and params["env"] == () and not params["as_json"]


def test_forkd_options_before_the_command_are_forkd_s() -> None:
    params = parse("--json", "child-1", "--timeout", "5", "-e", "K=V", "--cwd=/tmp", "--stdin",
                   "python3", "-c", "x", "--help")
    assert params["child_id"] == "child-1"
    assert list(params["argv"]) == ["python3", "-c", "x", "--help"]  # type: ignore[call-overload]
    assert params["timeout"] == 5.0 and params["env"] == ("K=V",) and params["cwd"] == "/tmp"
    assert params["as_json"] and params["use_stdin"]


def test_double_dash_still_marks_the_command() -> None:
    params = parse("child-1", "--timeout=2", "--", "--json", "x")
    assert list(params["argv"]) == ["--json", "x"]  # type: ignore[call-overload]
    assert params["timeout"] == 2.0


def test_help_and_unknown_options_before_the_command() -> None:
    with pytest.raises(click.exceptions.Exit):
        parse("child-1", "--help")  # forkd's help: no command given yet
    with pytest.raises(click.NoSuchOption):
        parse("child-1", "--bogus", "ls")  # not an option of forkd exec, and before CMD
    with pytest.raises(click.MissingParameter):
        parse("child-1")
