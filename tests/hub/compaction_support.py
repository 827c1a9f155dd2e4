"""Server-side compaction on every blob backend: the tests of test_compaction*.py run on the
session's filesystem hub and on a hub whose blobs are in S3 (a real moto_server).

A test module overrides the ``hub`` fixture with ``on_backend`` and parametrizes ``hub``
(indirectly) with ``BACKENDS``; ``hub_blobs`` is the hub's blob store seen from outside
(to lose a blob on purpose, whichever backend holds it)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hub_support import HubServer
from s3_hub_support import s3_settings
from s3_support import MotoServer

from forkd.hub.services import open_blob_store
from forkd.hub.settings import HubSettings
from forkd.store.blobs import BlobStore

BACKENDS = ["fs", "s3"]
on_every_backend = pytest.mark.parametrize("hub", BACKENDS, indirect=True)


@pytest.fixture(scope="session")
def s3_compaction_hub(
    moto_server: MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HubServer]:
    settings = s3_settings(moto_server, moto_server.new_bucket())
    server = HubServer(tmp_path_factory.mktemp("s3-hub"), settings).start()
    try:
        yield server
    finally:
        server.stop()


def on_backend(request: pytest.FixtureRequest, fs_hub: HubServer) -> HubServer:
    """The hub for ``request.param`` ("fs" when the test is not parametrized)."""
    if getattr(request, "param", "fs") == "fs":
        return fs_hub
    server: HubServer = request.getfixturevalue("s3_compaction_hub")
    return server


def hub_blobs(hub: HubServer) -> BlobStore:
    return open_blob_store(HubSettings(hub.data_dir, **hub.overrides))
