"""A finished upload becomes the blob without a second copy (issue 10's push speed):
with the filesystem backend the session's file is hashed as it arrives (monolithic upload)
and linked into the blob store; a chunked session's file is read once, to hash it, and
linked. Never a second write of the bytes.

Work is measured in bytes (/proc/self/io: the hub runs in this process, and so does the
client, whose socket I/O is counted too), never by timings. And a file once published as
a blob is never appended to: a writer that locks a session's file after it was published
is refused.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from hub_support import HubServer, sha

from forkd.errors import NotFound
from forkd.hub.storage import UploadArea
from forkd.store.blobs import FsBlobStore

SIZE = 24 << 20


def io_counters() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key] = int(value)
    return out


def _blob(seed: int) -> bytes:
    return random.Random(seed).randbytes(SIZE)


def test_a_monolithic_upload_is_hashed_as_it_arrives_and_linked_not_copied(
    hub: HubServer, user: tuple[str, str]
) -> None:
    data = _blob(1)
    digest = sha(data)
    sessions = set((hub.data_dir / "uploads").iterdir())  # other tests' (a shared hub)
    with hub.client(auth=user) as c:
        c.get("/v2/")  # the login and token before the measurement
        before = io_counters()
        r = c.post(f"/v2/{user[0]}/mono/blobs/uploads/", params={"digest": digest}, content=data)
        after = io_counters()
    assert r.status_code == 201, r.text
    # Read: the body off the socket once (the client's reads are tiny answers). The hub
    # used to read its upload file back to hash and copy it: twice the body.
    assert after["rchar"] - before["rchar"] < 1.5 * SIZE
    # Written: the body into the socket (client) and into the session's file (hub); the
    # copy into the blob store is gone.
    assert after["wchar"] - before["wchar"] < 2.5 * SIZE
    path = FsBlobStore(hub.data_dir / "blobs").path(digest)
    st = path.stat()
    assert path.read_bytes() == data
    assert st.st_nlink == 1 and st.st_mode & 0o777 == 0o444  # the session's name is gone
    assert set((hub.data_dir / "uploads").iterdir()) == sessions  # this upload's file gone


def test_a_chunked_session_is_read_once_and_linked_not_copied(
    hub: HubServer, user: tuple[str, str]
) -> None:
    data = _blob(2)
    digest = sha(data)
    half = SIZE // 2
    with hub.client(auth=user) as c:
        c.get("/v2/")
        before = io_counters()
        r = c.post(f"/v2/{user[0]}/chunked/blobs/uploads/")
        assert r.status_code == 202, r.text
        location = r.headers["location"]
        for start in (0, half):
            r = c.patch(
                location,
                content=data[start : start + half],
                headers={"Content-Range": f"{start}-{start + half - 1}"},
            )
            assert r.status_code == 202, r.text
        r = c.put(location, params={"digest": digest})
        after = io_counters()
    assert r.status_code == 201, r.text
    # Written: the body into the socket and into the session's file; no copy.
    assert after["wchar"] - before["wchar"] < 2.5 * SIZE
    assert FsBlobStore(hub.data_dir / "blobs").path(digest).read_bytes() == data


def test_a_wrong_digest_publishes_nothing(hub: HubServer, user: tuple[str, str]) -> None:
    data = b"the bytes the client sends"
    wrong = sha(b"other bytes")
    with hub.client(auth=user) as c:
        r = c.post(f"/v2/{user[0]}/wrong/blobs/uploads/", params={"digest": wrong}, content=data)
    assert r.status_code == 400 and "DIGEST_INVALID" in r.text
    blobs = FsBlobStore(hub.data_dir / "blobs")
    assert not blobs.has(wrong) and not blobs.has(sha(data))


def test_a_session_file_published_as_a_blob_is_no_longer_the_session(tmp_path: Path) -> None:
    """A writer that opened the session's file before it was published and locks it after
    finds it published (a second link, or the session's name gone) and must not append."""
    area = UploadArea(tmp_path / "uploads")
    upload_id = area.new()
    with area.open_append(upload_id) as f:
        area.check_current(upload_id, f)  # a fresh session's file: fine
        f.write(b"blob bytes")
        f.flush()
        blobs = FsBlobStore(tmp_path / "blobs")
        digest = sha(b"blob bytes")
        blobs.link_in(area.path(upload_id), digest)
        with pytest.raises(NotFound):
            area.check_current(upload_id, f)  # published: two links
        area.remove(upload_id)
        with pytest.raises(NotFound):
            area.check_current(upload_id, f)  # the session's name is gone
    assert blobs.read(digest, 100) == b"blob bytes"
    assert os.stat(blobs.path(digest)).st_nlink == 1
