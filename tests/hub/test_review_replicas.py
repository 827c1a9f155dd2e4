"""Review of the replica-safe hub: what the login limiter keeps in the database of a
credential it is checking (a row any replica reads, and one a killed process leaves); a
shared (S3) session's PATCH bounded by what one S3 object holds before a byte is read, and
kept alive while it streams for longer than the idle timeout."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from s3_hub_support import S3Hub, running_s3_hub
from s3_support import MotoServer
from sqlalchemy import select

from forkd.hub.db import Database
from forkd.hub.login_limit import LoginLimiter
from forkd.hub.models import LoginFailure
from forkd.hub.shared_uploads import CHUNK_MAX
from forkd.hub.tokens import CredentialCache

KEY = b"k" * 32
KEYS = ["ip:192.0.2.7"]


def test_an_attempt_in_flight_keeps_no_plain_hash_of_the_password(tmp_path: Path) -> None:
    credential = "alice\x00correct horse"
    plain = {
        hashlib.sha256(credential.encode()).hexdigest(),
        hashlib.sha256(b"correct horse").hexdigest(),
        CredentialCache().key("alice", "correct horse"),
    }

    async def go() -> list[str | None]:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'hub.db'}")
        try:
            await db.migrate()
            limiter = LoginLimiter(db, 5, 300.0)
            limiter.rekey(KEY)
            wait, ids = await limiter.attempt(KEYS, credential)
            assert wait == 0 and ids
            async with db.reading() as session:
                return list(await session.scalars(select(LoginFailure.attempt)))
        finally:
            await db.close()

    stored = asyncio.run(go())
    assert len(stored) == 1 and stored[0] is not None
    assert stored[0] not in plain  # an HMAC under the hub's key, not sha256(user, password)


def test_replicas_with_one_key_count_one_credential_in_flight_once(tmp_path: Path) -> None:
    """Two limiters on one database (two replicas) with the hub's shared key: the same
    credential in flight on both counts once; another one is a guess of its own."""

    async def go() -> tuple[int, int, int]:
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'hub.db'}")
        try:
            await db.migrate()
            first, second = LoginLimiter(db, 1, 300.0), LoginLimiter(db, 1, 300.0)
            first.rekey(KEY)
            second.rekey(KEY)
            same, other = "alice\x00pw", "alice\x00guess"
            a, _ = await first.attempt(KEYS, same)
            b, _ = await second.attempt(KEYS, same)
            c, _ = await second.attempt(KEYS, other)
            return a, b, c
        finally:
            await db.close()

    a, b, c = asyncio.run(go())
    assert (a, b) == (0, 0)
    assert c > 0


def _answer_to_headers(address: str, request: bytes) -> bytes:
    """Send only ``request``'s head (no body) and read the answer's first line."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(request)
        return sock.recv(4096).split(b"\r\n", 1)[0]


def test_a_patch_larger_than_one_s3_object_is_refused_before_its_body(s3_hub: S3Hub) -> None:
    """A shared session's PATCH becomes one object (S3: at most 5 GiB per PutObject): one
    declaring more is refused at once (413), not streamed to the disk and then lost."""
    user = s3_hub.add_user("bigpatch")
    with httpx.Client(base_url=s3_hub.url, auth=user, timeout=30) as c:
        location = c.post("/v2/bigpatch/app/blobs/uploads/").headers["location"]
    auth = base64.b64encode(f"{user[0]}:{user[1]}".encode()).decode()
    head = (
        f"PATCH {location} HTTP/1.1\r\nHost: {s3_hub.address}\r\n"
        f"Authorization: Basic {auth}\r\nContent-Type: application/octet-stream\r\n"
        f"Content-Length: {CHUNK_MAX + 1}\r\n\r\n"
    )
    assert b" 413 " in _answer_to_headers(s3_hub.address, head.encode())
    with httpx.Client(base_url=s3_hub.url, auth=user, timeout=30) as c:
        r = c.get(location)
        assert r.status_code == 204 and r.headers["range"] == "0-0"
        assert c.delete(location).status_code == 204


IDLE = 2.0  # upload_idle_timeout: the hub's sweep runs every second


@pytest.fixture
def quick_expiry_hub(moto_server: MotoServer, tmp_path: Path) -> Iterator[S3Hub]:
    with running_s3_hub(moto_server, tmp_path / "hub", upload_idle_timeout=IDLE) as server:
        yield server


def test_a_patch_streaming_longer_than_the_idle_timeout_keeps_its_session(
    quick_expiry_hub: S3Hub,
) -> None:
    """A shared session's idleness is its row's ``touched_at``, read by every replica's
    sweep; a PATCH still streaming (a slow link, a docker push's one PATCH of a large
    layer) moves it, so the session does not expire under it and lose what it sent."""
    hub = quick_expiry_hub
    user = hub.add_user("slowpatch")
    parts = [bytes([i]) * 1024 for i in range(int(IDLE * 3 / 0.25))]

    def slowly() -> Iterator[bytes]:
        for part in parts:
            yield part
            time.sleep(0.25)

    with httpx.Client(base_url=hub.url, auth=user, timeout=60) as c:
        location = c.post("/v2/slowpatch/app/blobs/uploads/").headers["location"]
        r = c.patch(location, content=slowly())
        assert r.status_code == 202, r.text
        data = b"".join(parts)
        assert r.headers["range"] == f"0-{len(data) - 1}"
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        assert c.put(location, params={"digest": digest}).status_code == 201
        assert c.get(f"/v2/slowpatch/app/blobs/{digest}").content == data
