"""A child's egress proxy as its own process (egress/serve.py, started and stopped through
egress/child.py as the lifecycle does), in a real network namespace, no VM: a client inside
the namespace reaches the stand-in model on the host's loopback through it, and a secret
rotated while it runs is used from the next connection on."""

from __future__ import annotations

import secrets
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from forkd.engine import netns
from forkd.engine.egress import EgressCA, SecretStore
from forkd.engine.egress.child import (
    PROXY_URL,
    READY_FILE,
    EgressSettings,
    proxy_matches,
    start_proxy,
    stop_proxy,
    wait_ready,
)
from forkd.engine.egress.standin import StandinModel
from forkd.engine.qemu import pid_alive

CHAT = {"model": "standin", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def namespace() -> Iterator[str]:
    why = netns.available()
    if why:
        pytest.skip(why)
    name = f"{netns.PREFIX}egtest-{secrets.token_hex(3)}"
    netns.create(name)
    try:
        yield name
    finally:
        netns.remove(name)


def chat_from_inside(ns: str, ca: EgressCA, base: str, key: str) -> httpx.Response:
    with netns.entered(ns), httpx.Client(
        proxy=PROXY_URL, verify=ssl.create_default_context(cadata=ca.cert_pem.decode()),
        trust_env=False, timeout=30,
    ) as client:
        return client.post(f"{base}/v1/chat/completions", json=CHAT,
                           headers={"Authorization": f"Bearer {key}"})


def test_proxy_process_serves_the_namespace_and_follows_rotation(
    tmp_path: Path, namespace: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    upstream_ca = EgressCA.load_or_create(tmp_path / "upstream-ca")
    (tmp_path / "upstream.pem").write_bytes(upstream_ca.cert_pem)
    first, second = f"sk-one-{secrets.token_hex(8)}", f"sk-two-{secrets.token_hex(8)}"
    with StandinModel(tls=upstream_ca.leaf_context("model.test")) as model:
        dest = f"model.test:{model.port}"
        store = SecretStore(tmp_path / "secrets")
        secret = store.set("OPENAI_API_KEY", first, [dest])
        env = {"FORKD_EGRESS_AUDIT": str(tmp_path / "audit.log"),
               "FORKD_EGRESS_UPSTREAM_CA": str(tmp_path / "upstream.pem"),
               "FORKD_EGRESS_PINS": "model.test=127.0.0.1"}
        monkeypatch.setenv("FORKD_SECRETS", str(store.root))
        settings = EgressSettings.resolve([dest], env=env)
        d = tmp_path / "child"
        d.mkdir()
        pid = start_proxy(settings, "egtest", namespace, d)
        try:
            wait_ready(pid, d)
            assert proxy_matches(pid, d)
            ca = EgressCA.load_or_create(store.root / "ca")
            base = f"https://model.test:{model.port}"
            r = chat_from_inside(namespace, ca, base, secret.placeholder)
            assert r.status_code == 200 and r.json()["object"] == "chat.completion"
            seen: list[Any] = [q.headers["authorization"] for q in model.completions()]
            assert seen == [f"Bearer {first}"]
            store.set("OPENAI_API_KEY", second, [dest])  # rotated: same placeholder
            deadline = time.monotonic() + 60  # was 15 s: each round is a TLS chat
            while True:
                chat_from_inside(namespace, ca, base, secret.placeholder)
                if model.completions()[-1].headers["authorization"] == f"Bearer {second}":
                    break
                assert time.monotonic() < deadline, "the rotated value never reached the proxy"
                time.sleep(0.5)
        finally:
            stop_proxy(pid, d)
        assert not pid_alive(pid)
        assert not (d / READY_FILE).exists()
        # from the host's namespace, nothing listens at the proxy address
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/v1/models", proxy=PROXY_URL, timeout=2, trust_env=False)
