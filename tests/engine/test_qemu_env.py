"""A QEMU child gets none of forkd's environment but PATH and the locale: the daemon's
REST token, cloud credentials or a hub password never reach a process that runs a guest
(readable in /proc/PID/environ by the uid QEMU drops to)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forkd.store.store import Store

SECRET = "FORKD_CONTROLLER_TOKEN"


@pytest.fixture
def secret_in_env() -> Iterator[str]:
    value = "s3cr3t-" + os.urandom(8).hex()
    old = os.environ.get(SECRET)
    os.environ[SECRET] = value
    try:
        yield value
    finally:
        if old is None:
            os.environ.pop(SECRET, None)
        else:
            os.environ[SECRET] = old


def test_qemu_environment_keeps_path_only(secret_in_env: str) -> None:
    from forkd.engine.qemu import qemu_environment

    env = qemu_environment()
    assert SECRET not in env and secret_in_env not in env.values()
    assert set(env) <= {"PATH", "LANG", "LC_ALL", "TZ"} and env.get("PATH")


def test_a_forked_child_does_not_inherit_the_daemons_secrets(
    store: Store,
    tiny: str,
    secret_in_env: str,
    engine_env: dict[str, Path],
    qemu_pids: Callable[[Path], list[int]],
    cleanup_children: None,
) -> None:
    from forkd.engine import children as ch

    child = ch.fork(store, tiny, 1).children[0]
    try:
        pids = qemu_pids(engine_env["FORKD_RUN"])
        assert pids
        for pid in pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert secret_in_env.encode() not in environ and SECRET.encode() not in environ
    finally:
        ch.kill(child.id)
