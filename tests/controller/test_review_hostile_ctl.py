"""The controller against the second hostile review: what its error paths, branches and
streams may do to the host. No VM unless marked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from forkd.engine import paths


def test_hiding_host_paths_in_an_error_makes_and_checks_no_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error answer names $FORKD_RUN and $FORKD_CACHE by their variables; deriving them
    must not create them (an error path with side effects), nor fail when the run
    directory is one ``run_dir`` would refuse (the answer would become a crash)."""
    run, cache = tmp_path / "run" / "forkd", tmp_path / "cache"
    monkeypatch.setenv("FORKD_RUN", str(run))
    monkeypatch.setenv("FORKD_CACHE", str(cache))
    text = f"cannot open {run}/children/x/qmp.sock or {cache}/images/k/root.raw"
    hidden = paths.hidden_host_paths(text, home=tmp_path / "home")
    assert hidden == "cannot open $FORKD_RUN/children/x/qmp.sock or $FORKD_CACHE/images/k/root.raw"
    assert not run.exists() and not cache.exists()
    run.mkdir(parents=True)
    os.chmod(run, 0o777)  # another user could plant files in it: run_dir refuses it
    with pytest.raises(Exception, match="writable"):
        paths.run_dir()
    assert paths.hidden_host_paths(f"{run}/x", home=tmp_path / "home") == "$FORKD_RUN/x"
