"""Recipes: parsing, validation, content digests (no VMs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from forkd.engine import recipe
from forkd.errors import InvalidInput

REPO = Path(__file__).resolve().parents[2]


def test_shipped_recipes_parse() -> None:
    tiny = recipe.load(REPO / "recipes" / "tiny.toml")
    assert tiny.name == "tiny" and tiny.memory_mib <= 256 and "python3" in tiny.apt
    numpy = recipe.load(REPO / "recipes" / "python-numpy.toml")
    assert "python3-numpy" in numpy.apt and "numpy" in numpy.warmup


def test_digest_tracks_content() -> None:
    a = recipe.parse('[recipe]\nname = "a"\n[warmup]\npython = "x = 1"\n')
    b = recipe.parse('[recipe]\nname = "a"\n[warmup]\npython = "x = 2"\n')
    assert a.content_digest() != b.content_digest()
    assert a.content_digest() == recipe.parse('[recipe]\nname = "a"\n[warmup]\n'
                                              'python = "x = 1"\n').content_digest()


def test_python_is_always_included() -> None:
    r = recipe.parse('[recipe]\nname = "a"\n[packages]\napt = ["curl"]\n')
    assert r.apt[0] == "python3"


def test_files_inline_and_source(tmp_path: Path) -> None:
    (tmp_path / "data.txt").write_text("hello")
    (tmp_path / "r.toml").write_text('[recipe]\nname = "f"\n[files]\n"/etc/a" = "inline"\n'
                                     '"/etc/b" = { source = "data.txt", mode = "0600" }\n')
    r = recipe.load(tmp_path / "r.toml")
    got = {f.path: (f.content, f.mode) for f in r.files}
    assert got == {"/etc/a": (b"inline", 0o644), "/etc/b": (b"hello", 0o600)}


@pytest.mark.parametrize("text, needle", [
    ("not toml [", "not valid TOML"),
    ('[recipe]\nname = "../x"\n', "name"),
    ('[recipe]\nname = "a"\n[guest]\nmemory_mib = 1\n', "memory_mib"),
    ('[recipe]\nname = "a"\n[guest]\nvcpus = "two"\n', "vcpus"),
    ('[recipe]\nname = "a"\n[packages]\napt = ["bad pkg; rm -rf /"]\n', "package"),
    ('[recipe]\nname = "a"\n[files]\n"etc/x" = "y"\n', "absolute"),
    ('[recipe]\nname = "a"\n[files]\n"/etc/../x" = "y"\n', "absolute"),
    ('[recipe]\nname = "a"\n[warmup]\npython = "def ("\n', "compile"),
    ('[recipe]\nname = "a"\n[bogus]\n', "unknown table"),
    ('[recipe]\nname = "a"\n[guest]\nmirror = "ftp://x"\n', "mirror"),
    # the snapshot's config holds it as one line: refused here, not at the end of a build
    ('[recipe]\nname = "a"\ndescription = """two\nlines"""\n', "description may not"),
    ('[recipe]\nname = "a"\ndescription = "\\u001b]52;c;eA==\\u0007"\n', "description may not"),
    ('[recipe]\nname = "a"\ndescription = 3\n', "description must be a string"),
])
def test_bad_recipes_are_refused(text: str, needle: str) -> None:
    with pytest.raises(InvalidInput, match=needle):
        recipe.parse(text)


def test_missing_recipe_file(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="does not exist"):
        recipe.load(tmp_path / "nope.toml")
