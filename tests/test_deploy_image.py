"""deploy/Containerfile: lints clean (hadolint), installs every host package the engine
needs, copies every folder the package is built from, and is the image the manifests run.
(It is not built here: no container registry is reachable for its base image.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from deploy_support import DEPLOY, REPO

CONTAINERFILE = DEPLOY / "Containerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    out = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            out.append((word.upper(), " ".join(rest.split())))
    return out


def lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["hadolint", "--no-color", str(path)], capture_output=True,
                          text=True, timeout=120)


hadolint = pytest.mark.skipif(shutil.which("hadolint") is None,
                              reason="hadolint missing (pip install -e '.[test]')")


@hadolint
def test_containerfile_lints_clean() -> None:
    p = lint(CONTAINERFILE)
    assert p.returncode == 0, p.stdout + p.stderr


@hadolint
def test_lint_refuses_a_bad_containerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Containerfile"
    bad.write_text(CONTAINERFILE.read_text().replace("FROM debian:bookworm-slim",
                                                     "FROM debian:latest") + "RUN cd /tmp\n")
    assert lint(bad).returncode != 0


def test_base_is_debian_bookworm() -> None:
    froms = [a for i, a in instructions(CONTAINERFILE.read_text()) if i == "FROM"]
    assert froms == ["debian:bookworm-slim"]


def test_installs_the_engines_host_packages() -> None:
    """Every package of forkd.controller.quickstart.HOST_PREREQUISITES (what `forkd setup`
    installs), iproute2 for tc (netns rate limits) and Python."""
    from forkd.controller.quickstart import HOST_PREREQUISITES

    runs = " ".join(a for i, a in instructions(CONTAINERFILE.read_text()) if i == "RUN")
    installed = set(re.findall(r"[a-z0-9][a-z0-9.+-]+", runs.split("apt-get install", 1)[1]
                               .split("&&", 1)[0]))
    wanted = {pkg for _, pkg in HOST_PREREQUISITES} | {"iproute2", "python3", "python3-venv"}
    assert sorted(wanted - installed) == []


def test_copies_every_package_folder() -> None:
    """The COPY lines cover pyproject.toml and each folder of its package-dir mapping,
    so `pip install /src/forkd` builds the whole distribution."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    copied: set[str] = set()
    for i, args in instructions(CONTAINERFILE.read_text()):
        if i == "COPY":
            copied |= set(args.split()[:-1])
    missing = sorted((folders | {"pyproject.toml", "README.md"}) - copied)
    assert missing == [], f"the image would be built without {missing}"
    for name in copied:
        assert (REPO / name).exists(), f"COPY {name}: no such file in the checkout"


def test_the_manifests_run_this_image() -> None:
    import yaml

    k8s = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    (image,) = k8s["images"]
    header = CONTAINERFILE.read_text()
    assert f"-t {image['name']}:{image['newTag']}" in header
    for path in ("hub.yaml", "nodes.yaml"):
        text = (DEPLOY / "k8s" / path).read_text()
        assert f"image: {image['name']}:{image['newTag']}" in text
    assert "--uid 10001" in header  # the user hub.yaml runs as
