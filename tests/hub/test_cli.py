"""`forkd hub …` commands, including `serve` as a real process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import click
import httpx
from click.testing import CliRunner
from hub_support import TIMEOUT, free_port, http

from forkd.cli.hub_cmds import hub, register

ENTRY = "from forkd.cli.hub_cmds import hub; hub(prog_name='forkd hub')"


def invoke(*args: str, input: str | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(hub, list(args), input=input)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def test_register_adds_the_hub_group() -> None:
    group = click.Group("forkd")
    register(group)
    assert set(group.commands["hub"].commands) >= {  # type: ignore[attr-defined]
        "serve",
        "migrate",
        "user",
        "token",
        "org",
        "repo",
    }


def test_serve_runs_the_hub_from_a_config_file(tmp_path: Path) -> None:
    port = free_port()
    config = tmp_path / "hub.toml"
    config.write_text(
        f'data_dir = "{tmp_path / "d"}"\nlisten = "127.0.0.1:{port}"\ntoken_ttl = 60\n'
    )
    env = {
        **os.environ,
        "FORKD_HUB_ADMIN_USER": "boss",
        "FORKD_HUB_ADMIN_PASSWORD": "boss-password-1",
    }
    env.pop("FORKD_HUB_DATA", None)
    proc = subprocess.Popen(
        [sys.executable, "-c", ENTRY, "serve", "--config", str(config)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                if http.get(f"http://127.0.0.1:{port}/healthz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "hub did not become ready"
            time.sleep(0.1)
        base = f"http://127.0.0.1:{port}"
        assert http.get(f"{base}/v2/", auth=("boss", "boss-password-1")).status_code == 200
        assert http.get(f"{base}/v2/").status_code == 401
        token = http.get(f"{base}/token", auth=("boss", "boss-password-1")).json()
        assert token["expires_in"] == 60  # from the config file
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=TIMEOUT)
    # uvicorn shuts down cleanly, then re-raises the signal it caught.
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert b"Application shutdown complete" in out
    assert (tmp_path / "d" / "hub.db").is_file() and (tmp_path / "d" / "blobs").is_dir()


def test_migrate_and_admin_commands(tmp_path: Path) -> None:
    data = str(tmp_path / "d")
    assert invoke("migrate", "--data", data) == (0, "database at revision head\n")
    assert invoke("migrate", "--data", data)[0] == 0  # idempotent
    code, out = invoke("user", "add", "alice", "--data", data)
    assert code == 0 and "password: " in out
    code, out = invoke("user", "add", "alice", "--data", data)
    assert code == 6 and "already exists" in out
    code, out = invoke("user", "add", "Bad/Name", "--data", data, "--password-stdin", input="x" * 9)
    assert code == 2 and "invalid user name" in out, out
    code, out = invoke("user", "add", "bob", "--data", data, "--password-stdin", input="short\n")
    assert code == 2 and "too short" in out
    code, out = invoke(
        "token", "create", "--user", "alice", "--scope", "alice:push", "--data", data
    )
    assert code == 0 and out.startswith("fkd_")
    code, out = invoke("token", "create", "--user", "nobody", "--scope", "x:pull", "--data", data)
    assert code == 2 and "no such user" in out
    code, out = invoke(
        "token", "create", "--user", "alice", "--scope", "alice:root", "--data", data
    )
    assert code == 2 and "invalid token scope" in out
    code, out = invoke("org", "add", "team", "--member", "alice=admin", "--data", data)
    assert code == 0
    code, out = invoke("user", "list", "--data", data)
    assert code == 0 and out.splitlines()[0].startswith("alice\tuser\t")
    code, out = invoke("token", "list", "--data", data, "--user", "alice")
    assert code == 0 and out.startswith("1\tcli\talice:push\tno expiry")
    assert invoke("org", "member", "team", "alice", "pull", "--data", data)[0] == 0
    assert invoke("org", "member", "team", "alice", "remove", "--data", data)[0] == 0
    code, out = invoke("org", "member", "team", "alice", "remove", "--data", data)
    assert code == 2 and "not a member" in out
    assert invoke("token", "revoke", "1", "--data", data)[0] == 0
    assert invoke("token", "list", "--data", data, "--user", "alice") == (0, "")
    assert invoke("token", "revoke", "1", "--data", data)[0] == 2
    code, out = invoke("org", "add", "team", "--data", data)
    assert code == 6
    assert invoke("user", "remove", "alice", "--data", data)[0] == 0
    assert invoke("user", "remove", "alice", "--data", data)[0] == 2
    code, out = invoke("repo", "visibility", "team/none", "public", "--data", data)
    assert code == 2 and "no such repository" in out
    code, out = invoke("serve", "--data", data, "--listen", "nonsense")
    assert code == 2 and "invalid listen address" in out
    code, out = invoke("migrate", "--data", data, "--database-url", "mysql://x/y")
    assert code == 2 and "unsupported database URL" in out
    bad = tmp_path / "bad.toml"
    bad.write_text('colour = "blue"\n')
    code, out = invoke("migrate", "--config", str(bad))
    assert code == 2 and "unknown setting 'colour'" in out
    bad.write_text('token_ttl = "soon"\n')
    code, out = invoke("migrate", "--config", str(bad))
    assert code == 2 and "token_ttl must be of type int" in out
    # Options given on the command line win over the file.
    good = tmp_path / "good.toml"
    good.write_text(f'data_dir = "{tmp_path / "from-file"}"\n')
    assert invoke("migrate", "--config", str(good))[0] == 0
    assert (tmp_path / "from-file" / "hub.db").is_file()
    assert invoke("migrate", "--config", str(good), "--data", str(tmp_path / "cli"))[0] == 0
    assert (tmp_path / "cli" / "hub.db").is_file()
