"""The store stays in small parts with one job each (issue 11 item 7): no module of
forkd/store over MAX_MODULE_LINES, no class over MAX_CLASS_LINES, no function over
MAX_FUNCTION_LINES; ``Store`` is a facade whose methods hand each job to its module; and
the store's jobs reach blobs through the ``BlobStore`` protocol, never the filesystem
backend's own attributes (its paths, its tmp directory)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

STORE = Path(__file__).resolve().parents[1] / "forkd" / "store"
MAX_MODULE_LINES = 300
MAX_CLASS_LINES = 200
MAX_FUNCTION_LINES = 60
MAX_FACADE_BODY_LINES = 20  # a method's statements, past its signature and docstring
# Attributes only FsBlobStore has: code outside the backends must not need them.
FS_ONLY = frozenset({"path", "tmp", "root", "put_file", "clear_in_flight", "link_in"})
BACKENDS = frozenset({"blobs.py", "s3.py", "s3_client.py"})
MODULES = sorted(STORE.glob("*.py"))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _length(node: ast.AST) -> int:
    assert isinstance(node, ast.stmt) and node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def test_the_store_has_its_modules() -> None:
    names = {p.name for p in MODULES}
    assert {"store.py", "imports.py", "assembly.py", "compaction.py", "gc.py"} <= names


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_store_modules_are_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.name} has {lines} lines; split it by job"
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ClassDef):
            assert _length(node) <= MAX_CLASS_LINES, f"{path.name}: class {node.name} is too big"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert _length(node) <= MAX_FUNCTION_LINES, (
                f"{path.name}: {node.name} has {_length(node)} lines; split it"
            )


def test_store_is_a_facade() -> None:
    tree = _tree(STORE / "store.py")
    (store,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Store"]
    for node in store.body:
        if isinstance(node, ast.FunctionDef) and node.name != "__init__":
            body = [s for s in node.body if not _is_docstring(s)]
            lines = body[-1].end_lineno - body[0].lineno + 1  # type: ignore[operator]
            assert lines <= MAX_FACADE_BODY_LINES, (
                f"Store.{node.name} does a job itself; move it into a module of forkd/store"
            )


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)


@pytest.mark.parametrize(
    "path", [p for p in MODULES if p.name not in BACKENDS], ids=lambda p: p.name
)
def test_store_jobs_use_the_blob_protocol_only(path: Path) -> None:
    for node in ast.walk(_tree(path)):
        if (
            isinstance(node, ast.Attribute)
            and node.attr in FS_ONLY
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "blobs"
        ):
            raise AssertionError(
                f"{path.name}:{node.lineno}: blobs.{node.attr} is the filesystem backend's; "
                "use the BlobStore protocol (forkd.store.blobs)"
            )
