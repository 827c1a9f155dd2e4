"""The `forkd` command as users run it: a real subprocess per call."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from forkd.errors import ChainError, Conflict, IntegrityError, InvalidInput, NotFound

STORE_COMMANDS = [
    "import",
    "images",
    "inspect",
    "assemble",
    "export",
    "compact",
    "rmi",
    "gc",
    "verify",
    "tag",
    "demo",
    "login",
    "logout",
    "push",
    "pull",
]


def forkd(home: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FORKD_HOME": str(home)}
    proc = subprocess.run(
        ["forkd", *args],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


@pytest.mark.parametrize("command", STORE_COMMANDS)
def test_every_command_has_help(home: Path, command: str):
    out = forkd(home, command, "--help").stdout
    assert "Usage: forkd " + command in out


def test_import_inspect_assemble_compact_flow(home: Path, images: list[Path], tmp_path: Path):
    forkd(home, "import", "--tag", "base", "--memory", str(images[0]))
    for i in (1, 2, 3):
        parent = "base" if i == 1 else f"d{i - 1}"
        forkd(home, "import", "--tag", f"d{i}", "--memory", str(images[i]), "--parent", parent)
    rows = json.loads(forkd(home, "images", "--json").stdout)
    assert [(r["ref"], r["depth"]) for r in rows] == [
        ("base:latest", 0),
        ("d1:latest", 1),
        ("d2:latest", 2),
        ("d3:latest", 3),
    ]
    assert "DEPTH" in forkd(home, "images").stdout
    info = json.loads(forkd(home, "inspect", "d3", "--json").stdout)
    assert [link["tag"] for link in info["chain"]] == [
        "d3:latest",
        "d2:latest",
        "d1:latest",
        "base:latest",
    ]
    assert info["logical_bytes"] == images[0].stat().st_size
    assert info["stored_bytes"] < info["logical_bytes"]
    assert "chain (head first)" in forkd(home, "inspect", "d3").stdout
    out = tmp_path / "out.mem"
    forkd(home, "assemble", "d3", "--out", str(out))
    assert out.read_bytes() == images[3].read_bytes()
    compact = json.loads(forkd(home, "compact", "d3", "--to", "flat", "--json").stdout)
    assert compact["depth"] == 0
    forkd(home, "assemble", "flat", "--out", str(out))
    assert out.read_bytes() == images[3].read_bytes()
    pack = tmp_path / "d3.pack"
    forkd(home, "export", "d3", "--out", str(pack))
    other = tmp_path / "other-home"
    forkd(other, "import", "--pack", str(pack))
    forkd(other, "assemble", "d3", "--out", str(out))
    assert out.read_bytes() == images[3].read_bytes()
    refused = forkd(home, "rmi", "base", ok=False)
    assert refused.returncode == Conflict.exit_code
    assert "--cascade" in refused.stderr
    removed = json.loads(forkd(home, "rmi", "base", "--cascade", "--json").stdout)["removed"]
    assert sorted(removed) == ["base:latest", "d1:latest", "d2:latest", "d3:latest"]
    freed = json.loads(forkd(home, "gc", "--json").stdout)
    assert freed["blobs_removed"] > 0
    forkd(home, "assemble", "flat", "--out", str(out))
    assert out.read_bytes() == images[3].read_bytes()


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["inspect", "nothing"], NotFound.exit_code, "no tag nothing:latest"),
        (
            ["import", "--tag", "../x", "--memory", "{img}"],
            InvalidInput.exit_code,
            "invalid repository name",
        ),
        (
            ["import", "--tag", "x", "--memory", "{img}", "--parent", "ghost"],
            NotFound.exit_code,
            "ghost",
        ),
        (
            ["import", "--tag", "x", "--memory", "{img}", "--parent", "x"],
            ChainError.exit_code,
            "own parent",
        ),
        (["import", "--tag", "x"], InvalidInput.exit_code, "needs --tag and --memory"),
        (["assemble", "nothing", "--out", "{tmp}/o"], NotFound.exit_code, "forkd images"),
    ],
)
def test_bad_input_exit_codes(
    home: Path, images: list[Path], tmp_path: Path, args: list[str], code: int, message: str
):
    args = [a.format(img=images[0], tmp=tmp_path) for a in args]
    proc = forkd(home, *args, ok=False)
    assert proc.returncode == code, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()


def test_tampered_blob_fails_assemble_with_tag_and_layer(
    home: Path, images: list[Path], tmp_path: Path
):
    forkd(home, "import", "--tag", "base", "--memory", str(images[0]))
    forkd(home, "import", "--tag", "d1", "--memory", str(images[1]), "--parent", "base")
    assert json.loads(forkd(home, "verify", "--json").stdout) == {"ok": True, "problems": []}
    info = json.loads(forkd(home, "inspect", "d1", "--json").stdout)
    chunk = next(d for d in info["layers"] if d["mediaType"].endswith("chunk.v1+zstd"))
    path = home / "blobs" / "sha256" / chunk["digest"][7:9] / chunk["digest"][7:]
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1] + b"!")
    verify = forkd(home, "verify", "--json", ok=False)
    assert verify.returncode == IntegrityError.exit_code
    assert any(chunk["digest"] in p for p in json.loads(verify.stdout)["problems"])
    out = tmp_path / "out.mem"
    proc = forkd(home, "assemble", "d1", "--out", str(out), ok=False)
    assert proc.returncode != 0
    assert "d1:latest" in proc.stderr and "layer 0" in proc.stderr
    assert not out.exists()


def test_demo_runs_the_main_job(home: Path):
    out = forkd(home, "demo", "--size-mib", "16").stdout
    assert "byte-identical" in out
    assert "bytes identical: True" in out
    rows = json.loads(forkd(home, "images", "--json").stdout)
    assert {r["ref"] for r in rows} >= {"demo/base:v1", "demo/plus-agent:v1", "demo/compacted:v1"}


def _compacted(home: Path) -> dict[str, bool]:
    return {r["ref"]: r["compacted"] for r in json.loads(forkd(home, "images", "--json").stdout)}


def test_images_json_reports_compaction_as_recorded(
    home: Path, images: list[Path], tmp_path: Path
):
    forkd(home, "import", "--tag", "base", "--memory", str(images[0]))
    forkd(home, "import", "--tag", "d1", "--memory", str(images[1]), "--parent", "base")
    forkd(home, "compact", "d1", "--to", "flat")
    # a diff past the auto-compaction depth is stored flat, with its provenance
    proc = subprocess.run(
        ["forkd", "import", "--tag", "auto", "--memory", str(images[2]), "--parent", "d1",
         "--json"],
        env={**os.environ, "FORKD_HOME": str(home), "FORKD_AUTO_COMPACT_DEPTH": "1"},
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300, check=True,
    )
    assert json.loads(proc.stdout)["compacted"] is True
    # `forkd tag` names the same compacted content
    forkd(home, "tag", "flat", "flat-alias")
    assert _compacted(home) == {
        "base:latest": False,
        "d1:latest": False,
        "flat:latest": True,
        "auto:latest": True,
        "flat-alias:latest": True,
    }
    # the provenance travels with the layer: an exported pack keeps it compacted
    pack = tmp_path / "flat.pack"
    forkd(home, "export", "flat", "--out", str(pack))
    other = tmp_path / "other-home"
    forkd(other, "import", "--pack", str(pack))
    assert _compacted(other) == {"flat:latest": True}
    assert "compacted from d1:latest" in forkd(other, "inspect", "flat").stdout
