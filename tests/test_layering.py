"""The core's layers (issue 11 item 7): the pack format does not import the store, and
``import forkd`` imports neither the controller nor the engine."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-P", "-c", code], capture_output=True, text=True, check=True, cwd="/"
    ).stdout
    return set(out.split())


def test_the_pack_format_does_not_import_the_store() -> None:
    loaded = _modules_after("import forkd.pack.chunking, forkd.pack.manifest, forkd.pack.chain")
    assert "forkd.pack.chunking" in loaded
    assert not {m for m in loaded if m.startswith("forkd.store")}


def test_import_forkd_loads_no_controller_or_engine() -> None:
    loaded = _modules_after("import forkd")
    assert "forkd" in loaded
    assert not {m for m in loaded if m.startswith(("forkd.controller", "forkd.engine"))}
