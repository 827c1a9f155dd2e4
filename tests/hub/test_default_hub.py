"""The default hub (issue 12 item 1): `NS/NAME[:TAG]` without a hub goes to $FORKD_HUB, else
the hub stored with `forkd config set hub`, else a clear error — in pull, push and
compact --remote, against a real hub."""

from __future__ import annotations

import json
import os
import pty
import selectors
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result
from hub_support import HubServer

from forkd.cli.main import cli
from forkd.controller.quickstart import make_default_hub
from forkd.engine.doctor import _default_hub
from forkd.errors import InvalidInput
from forkd.registry import credentials
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, parse_hub, parse_remote, resolve_default_hub
from forkd.store.store import Store

UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: using it fails the command


@pytest.fixture
def client_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The client's files (credentials, config) in a directory of this test; no FORKD_HUB."""
    path = tmp_path / "client"
    monkeypatch.setenv("FORKD_CREDENTIALS", str(path / "credentials.json"))
    monkeypatch.delenv("FORKD_HUB", raising=False)
    yield path


def forkd(*args: str, input: str | None = None, env: dict[str, str] | None = None) -> Result:
    """The real `forkd` command, in this process (stdin is not a terminal)."""
    return CliRunner().invoke(cli, list(args), input=input, env=env)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, result.output + result.stderr
    return result


def _push_pull_compact(user: tuple[str, str], store: Store, tmp_path: Path, repo: str) -> None:
    """The three commands, each given a reference without a hub; all must reach the hub."""
    ok(forkd("push", "d1", f"{repo}:v1", "--json"))
    ok(forkd("push", "d2", f"{repo}:v2", "--json"))
    other = tmp_path / f"other-{repo.replace('/', '-')}"
    pulled = json.loads(ok(forkd("pull", f"{repo}:v2", "--json",
                                 env={"FORKD_HOME": str(other)})).stdout)
    assert pulled["layers"] == 3
    assert Store(other).assemble(f"{repo}:v2").memory.read_bytes() == (
        store.assemble("d2").memory.read_bytes()
    )
    compacted = json.loads(ok(forkd("compact", "--remote", f"{repo}:v2", "--to", "flat",
                                    "--json")).stdout)
    assert compacted["repository"] == repo and compacted["depth"] == 0


def test_forkd_hub_beats_the_config(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    client_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    credentials.save(hub.address, Credential(*user))
    ok(forkd("config", "set", "hub", UNREACHABLE))  # would fail every command below
    monkeypatch.setenv("FORKD_HUB", hub.address)
    got = json.loads(ok(forkd("config", "get", "hub", "--json")).stdout)
    assert got == {"hub": hub.address, "url": hub.url, "source": "$FORKD_HUB"}
    stored = ok(forkd("config", "set", "hub", UNREACHABLE))  # stored, and told it is shadowed
    assert f"$FORKD_HUB names {hub.address}, which takes precedence" in stored.stderr
    _push_pull_compact(user, store, tmp_path, f"{user[0]}/env")
    assert hub.target == parse_remote(f"{user[0]}/env:v1").hub


def test_configured_default_hub(
    hub: HubServer,
    user: tuple[str, str],
    store: Store,
    chain: list[str],
    client_dir: Path,
    tmp_path: Path,
) -> None:
    credentials.save(hub.address, Credential(*user))
    out = ok(forkd("config", "set", "hub", hub.address)).stdout
    assert hub.address in out and str(client_dir / "config.json") in out
    assert (client_dir / "config.json").stat().st_mode & 0o777 == 0o600
    got = json.loads(ok(forkd("config", "get", "hub", "--json")).stdout)
    assert got["hub"] == hub.address and got["source"] == str(client_dir / "config.json")
    _push_pull_compact(user, store, tmp_path, f"{user[0]}/cfg")
    # An explicit hub in the reference still wins over the default.
    ok(forkd("config", "set", "hub", UNREACHABLE))
    ok(forkd("pull", f"{hub.address}/{user[0]}/cfg:v1", "--tag", "explicit"))
    ok(forkd("config", "unset", "hub"))
    assert resolve_default_hub() is None


def test_no_default_hub_is_a_clear_error(store: Store, chain: list[str], client_dir: Path) -> None:
    for args in (
        ("pull", "deeplethe/langgraph-react"),
        ("push", "d1", "deeplethe/langgraph-react:v1"),
        ("compact", "--remote", "deeplethe/langgraph-react:v1", "--to", "flat"),
    ):
        result = forkd(*args)
        assert result.exit_code == InvalidInput.exit_code, result.output
        assert "names no hub, FORKD_HUB is not set and no default hub is configured" in (
            result.stderr
        )
        assert "forkd config set hub HOST[:PORT]" in result.stderr
    result = forkd("config", "get", "hub")
    assert result.exit_code == 1 and "no default hub" in result.stdout
    assert not (client_dir / "config.json").exists()  # reading writes nothing


def test_login_default_flag_sets_it(hub: HubServer, user: tuple[str, str], client_dir: Path):
    ok(forkd("config", "set", "hub", UNREACHABLE))
    out = ok(forkd("login", hub.address, "-u", user[0], "--password-stdin", "--default",
                   input=user[1] + "\n")).stdout
    assert f"default hub: {hub.address}" in out
    chosen = resolve_default_hub()
    assert chosen is not None and chosen.hub == hub.target and chosen.set_by == "user"
    # with the scheme it was checked over (never sent over a weaker one)
    assert credentials.load(hub.address) == Credential(*user, hub.target.scheme)


def test_login_without_a_terminal_never_asks(
    hub: HubServer, user: tuple[str, str], client_dir: Path
):
    result = ok(forkd("login", hub.address, "-u", user[0], "--password-stdin",
                      input=user[1] + "\n"))
    assert "?" not in result.stdout  # no question was asked
    assert f"forkd login {hub.address} --default" in result.stderr  # a hint instead
    assert resolve_default_hub() is None
    ok(forkd("config", "set", "hub", UNREACHABLE))
    result = ok(forkd("login", hub.address, "-u", user[0], "--password-stdin",
                      input=user[1] + "\n"))
    assert result.stderr == ""  # a default is set: no hint, and it is kept
    assert credentials.load_default_hub() == credentials.StoredHub(UNREACHABLE, "user")


def _login_on_a_terminal(hub: HubServer, user: tuple[str, str], env: dict[str, str],
                         answer: str) -> str:
    """`forkd login` with its stdin, stdout and stderr on a pseudo-terminal."""
    main, side = pty.openpty()
    proc = subprocess.Popen(
        ["forkd", "login", hub.address, "-u", user[0], "--password-stdin"],
        stdin=side, stdout=side, stderr=side, env=env, close_fds=True,
    )
    os.close(side)
    os.write(main, (user[1] + "\n").encode())
    seen = b""
    deadline = time.monotonic() + 120
    answered = False
    selector = selectors.DefaultSelector()  # not select(): fd numbers may pass 1024
    selector.register(main, selectors.EVENT_READ)
    while time.monotonic() < deadline:
        ready = selector.select(1)
        if ready:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        if not answered and b"the default for pull and push?" in seen:
            os.write(main, answer.encode())
            answered = True
        if proc.poll() is not None and not ready:
            break
    selector.close()
    proc.wait(timeout=60)
    os.close(main)
    assert proc.returncode == 0, seen.decode(errors="replace")
    return seen.decode(errors="replace")


def test_login_on_a_terminal_offers_to_set_it(
    hub: HubServer, user: tuple[str, str], client_dir: Path
):
    env = {**os.environ}
    seen = _login_on_a_terminal(hub, user, env, "n\n")
    assert "make " + hub.address + " the default" in seen
    assert resolve_default_hub() is None
    seen = _login_on_a_terminal(hub, user, env, "y\n")
    assert f"default hub: {hub.address}" in seen
    chosen = resolve_default_hub()
    assert chosen is not None and chosen.hub == hub.target


def test_doctor_shows_the_default_hub(
    client_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    check = _default_hub()
    assert (check.name, check.status) == ("default-hub", "info")
    assert "none" in check.detail and "forkd config set hub" in check.detail
    ok(forkd("config", "set", "hub", "hub.example.com:5000"))
    check = _default_hub()
    assert check.status == "ok"
    assert check.detail == f"https://hub.example.com:5000 (from {client_dir / 'config.json'})"
    (client_dir / "config.json").write_text('{"default_hub": {"address": "a b", "set_by": "user"}}')
    check = _default_hub()
    assert check.status == "warn" and "'a b'" in check.detail and check.hint
    # The real command, env beating the broken config file.
    env = {**os.environ, "FORKD_HUB": "http://10.1.2.3:8080", "FORKD_HOME": str(tmp_path / "h")}
    proc = subprocess.run(["forkd", "doctor", "--json", "--no-store"], env=env, text=True,
                          capture_output=True, stdin=subprocess.DEVNULL, timeout=300)
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["default-hub"]["status"] == "ok"
    assert checks["default-hub"]["detail"] == "http://10.1.2.3:8080 (from $FORKD_HUB)"


HOSTILE = [
    "hub.io/ns",  # a path
    "hub.io:0",
    "hub.io:65536",
    "hub.io:99999",
    "bad host",
    "hub.io\n",
    "hub.io\r\nX-Evil: 1",
    "hub\x1b[31m.io",
    "hub.io\x00",
    "alice:pw@hub.io",
    "-hub.io",
    "hub-.io",
    "a..b",
    ".",
    "[::zz]:5000",
    "[127.0.0.1]",
    "ftp://hub.io",
    "http://",
    "x" * 300,
    "",
    "h\u00e9b.io",  # non-ASCII
    "hub.io:５０００",  # non-ASCII digits
]


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_default_hub_is_refused(value: str, client_dir: Path,
                                        monkeypatch: pytest.MonkeyPatch):
    result = forkd("config", "set", "hub", "--", value)
    assert result.exit_code == InvalidInput.exit_code, result.output
    assert "invalid hub address" in result.stderr and "HOST[:PORT]" in result.stderr
    assert "\x1b" not in result.stderr and "\r" not in result.stderr  # shown escaped
    assert not (client_dir / "config.json").exists()
    with pytest.raises(InvalidInput):
        parse_hub(value)
    if value and "\x00" not in value:
        monkeypatch.setenv("FORKD_HUB", value)
        result = forkd("pull", "ns/name")
        assert result.exit_code == InvalidInput.exit_code
        assert "FORKD_HUB" in result.stderr and "invalid hub address" in result.stderr
        monkeypatch.delenv("FORKD_HUB")
    # The same value written into the config file by hand is refused when read.
    client_dir.mkdir(parents=True, exist_ok=True)
    stored = {"default_hub": {"address": value, "set_by": "user"}}
    (client_dir / "config.json").write_text(json.dumps(stored))
    result = forkd("pull", "ns/name")
    assert result.exit_code == InvalidInput.exit_code
    assert str(client_dir / "config.json") in result.stderr
    assert "forkd config set hub" in result.stderr and "forkd config unset hub" in result.stderr
    (client_dir / "config.json").unlink()


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        "[]",
        '{"default_hub": "hub.io"}',
        '{"default_hub": {"address": 5, "set_by": "user"}}',
        '{"default_hub": {"address": "hub.io", "set_by": "someone"}}',
        '{"default_hub": {"address": "hub.io"' + " " * (2 << 20) + "}}",
    ],
)
def test_malformed_config_file_is_a_clear_error(content: str, client_dir: Path):
    client_dir.mkdir(parents=True)
    (client_dir / "config.json").write_text(content)
    result = forkd("pull", "ns/name")
    assert result.exit_code == InvalidInput.exit_code, result.output
    assert str(client_dir / "config.json") in result.stderr
    assert "forkd config set hub" in result.stderr


def test_credentials_file_named_like_the_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FORKD_HUB", raising=False)
    monkeypatch.setenv("FORKD_CREDENTIALS", str(tmp_path / "config.json"))
    with pytest.raises(InvalidInput, match="name the credentials file something else"):
        parse_remote("ns/name")


@pytest.mark.parametrize(
    "text,scheme",
    [
        ("localhost", "http"),
        ("localhost:5000", "http"),
        ("LOCALHOST:5000", "http"),
        ("127.0.0.1:5000", "http"),
        ("127.8.9.10", "http"),
        ("[::1]:5000", "http"),
        ("127.example.com", "https"),  # DNS names that only look like loopback
        ("127.0.0.1.nip.io:5000", "https"),
        ("localhost.example.com", "https"),
        ("localhost-proxy:5000", "https"),
        ("10.0.0.1:80", "https"),
        ("[2001:db8::1]:443", "https"),
        ("http://hub.example.com", "http"),
        ("https://localhost:5000", "https"),
    ],
)
def test_only_loopback_defaults_to_plain_http(text: str, scheme: str):
    hub = parse_hub(text)
    assert hub.scheme == scheme
    assert parse_hub(hub.address) == hub  # what is stored names the same hub again


def test_quickstart_sets_the_default_only_when_none_is_chosen(client_dir: Path):
    said: list[str] = []
    embedded = Hub("127.0.0.1:4100", "http")
    assert make_default_hub(embedded, said.append)  # none configured: set
    assert credentials.load_default_hub() == credentials.StoredHub(embedded.address, "quickstart")
    assert not make_default_hub(embedded, said.append)  # a second run: nothing to do
    moved = Hub("127.0.0.1:4200", "http")  # a new embedded hub (FORKD_HOME was reset)
    assert make_default_hub(moved, said.append)  # replaces what quickstart itself stored
    assert credentials.load_default_hub() == credentials.StoredHub(moved.address, "quickstart")

    ok(forkd("config", "set", "hub", "hub.example.com"))  # the user's choice
    assert not make_default_hub(embedded, said.append)
    assert credentials.load_default_hub() == credentials.StoredHub("hub.example.com", "user")
    assert "stays hub.example.com" in said[-1]

    (client_dir / "config.json").write_text("{broken")  # even a broken file is left alone
    assert not make_default_hub(embedded, said.append)
    assert (client_dir / "config.json").read_text() == "{broken"


def test_quickstart_respects_a_default_the_user_set_with_login(
    hub: HubServer, user: tuple[str, str], client_dir: Path
):
    ok(forkd("login", hub.address, "-u", user[0], "--password-stdin", "--default",
             input=user[1] + "\n"))
    assert not make_default_hub(Hub("127.0.0.1:4100", "http"), lambda _: None)
    chosen = resolve_default_hub()
    assert chosen is not None and chosen.hub == hub.target
