"""`forkd demo coding-agent`: one source sandbox, a branch, three grandchildren, three fixes.

The source reproduces the failing test of the recipe's project (recipes/coding-agent/) and
takes notes; it is BRANCHED; three grandchildren forked from the branch each apply a
different fix to ``ledger/split.py``, commit it and run the tests. Then every sandbox is
inspected from the inside: the 50 MiB data file hashes the same in all four, each one sees
only its own edits, notes and ``__pycache__/``, and each has its own test result.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from forkd.errors import ForkdError, NotFound
from forkd.store.store import Store

REPO = "/work/repo"
DATA = "/work/data/corpus.bin"
DEFAULT_TAG = "deeplethe/coding-agent:latest"  # what the main job publishes on its hub
EXEC_TIMEOUT = 300.0  # seconds for one command in a sandbox (TCG is slow, hashing 50 MiB)
Say = Callable[[str], None]


def recipe_dir() -> Path:
    """The bundled recipe's folder (recipes/coding-agent/): the project and the fixes."""
    return Path(str(resources.files("forkd.recipes").joinpath("coding-agent")))


@dataclass(frozen=True)
class Fix:
    """One grandchild's attempt: a new ``ledger/split.py`` (recipes/coding-agent/fixes/) and
    the summary line unittest should print with it."""

    name: str
    summary: str
    expected: str

    @property
    def source(self) -> str:
        return (recipe_dir() / "fixes" / f"{self.name}.py").read_text()


FIXES: tuple[Fix, ...] = (
    Fix("divmod", "the first `rest` shares get one cent more", "OK"),
    Fix("last-takes-rest", "the last share takes the whole remainder", "FAILED (failures=1)"),
    Fix("round", "every share is the rounded quotient", "FAILED (failures=1)"),
)
SOURCE_EXPECTED = "FAILED (failures=1, errors=1)"

# Run in a sandbox with python3: what it sees, as JSON (one round trip per inspection).
INSPECT = r"""
import hashlib, json, os, subprocess, sys
repo, data = sys.argv[1], sys.argv[2]
def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
caches = {}
for top, dirs, files in os.walk(repo):
    dirs[:] = sorted(d for d in dirs if d != ".git")
    if os.path.basename(top) == "__pycache__":
        for name in sorted(files):
            path = os.path.join(top, name)
            caches[os.path.relpath(path, repo)] = sha(path)
git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True).stdout
print(json.dumps({
    "data_sha256": sha(data), "data_bytes": os.path.getsize(data),
    "split_sha256": sha(os.path.join(repo, "ledger", "split.py")),
    "pycache": caches,
    "notes": sorted(n for n in os.listdir(repo) if n.startswith("NOTES-")),
    "head": git("rev-parse", "HEAD").strip(), "branch": git("branch", "--show-current").strip(),
}))
"""


@dataclass
class SandboxView:
    """What one sandbox sees of its workspace."""

    role: str  # "source" or a fix's name
    child_id: str
    tests: str  # the last line unittest printed
    tests_exit: int
    data_sha256: str
    data_bytes: int
    split_sha256: str
    pycache: dict[str, str]  # path under /work/repo -> sha256
    notes: list[str]
    head: str
    branch: str
    seconds: float = 0.0  # apply + commit + tests (grandchildren)
    ready_ms: float = 0.0


@dataclass
class CodingDemoReport:
    tag: str
    branch_tag: str
    branch_pause_ms: float
    branch_ms: float
    sandboxes: list[SandboxView] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


def original_split() -> str:
    return (recipe_dir() / "repo" / "ledger" / "split.py").read_text()


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _exec(child_id: str, argv: list[str], stdin: bytes | None = None) -> dict[str, Any]:
    from forkd.engine import children as ch

    return ch.exec_in(child_id, argv, cwd=REPO, stdin=stdin, timeout=EXEC_TIMEOUT)


def _checked(child_id: str, argv: list[str], stdin: bytes | None = None) -> str:
    reply = _exec(child_id, argv, stdin)
    if reply.get("exit_code") != 0:
        raise ForkdError(
            f"`{' '.join(argv)}` failed in {child_id} (exit {reply.get('exit_code')}): "
            f"{str(reply.get('stderr', ''))[-500:]}"
        )
    return str(reply.get("stdout", ""))


def write_file(child_id: str, path: str, text: str) -> None:
    """Write ``text`` to ``path`` (relative to the repo) inside the sandbox."""
    _checked(child_id, ["sh", "-c", 'cat > "$1"', "sh", path], text.encode())


def run_tests(child_id: str) -> tuple[int, str]:
    """`python3 -m unittest` in the repo: exit code and the summary line (OK / FAILED …)."""
    reply = _exec(child_id, ["python3", "-m", "unittest"])
    lines = [ln for ln in str(reply.get("stderr", "")).splitlines() if ln.strip()]
    return int(reply.get("exit_code", -1)), lines[-1] if lines else "(no output)"


def inspect(child_id: str, role: str, tests: tuple[int, str]) -> SandboxView:
    seen = json.loads(_checked(child_id, ["python3", "-c", INSPECT, REPO, DATA]))
    return SandboxView(role=role, child_id=child_id, tests=tests[1], tests_exit=tests[0], **seen)


def try_fix(child_id: str, fix: Fix) -> SandboxView:
    """A grandchild's work: its own git branch, the fix, a note, a commit, the tests."""
    t0 = time.perf_counter()
    _checked(child_id, ["git", "switch", "-q", "-c", f"fix/{fix.name}"])
    write_file(child_id, "ledger/split.py", fix.source)
    write_file(child_id, f"NOTES-{fix.name}.md", f"# {fix.name}\n\n{fix.summary}\n")
    _checked(child_id, ["git", "commit", "-q", "-am", f"split: {fix.summary}"])
    tests = run_tests(child_id)
    view = inspect(child_id, fix.name, tests)
    view.seconds = time.perf_counter() - t0
    return view


def check(report: CodingDemoReport) -> list[str]:
    """What must be true of the four views; one message per violation."""
    problems: list[str] = []
    views = report.sandboxes
    source, kids = views[0], views[1:]
    if len({v.data_sha256 for v in views}) != 1:
        problems.append(f"{DATA} differs: " + ", ".join(f"{v.role} {v.data_sha256}" for v in views))
    if source.split_sha256 != sha256_text(original_split()):
        problems.append("the source's ledger/split.py changed: a grandchild's edit leaked")
    if source.notes != ["NOTES-source.md"]:
        problems.append(f"the source sees notes {source.notes}, expected only its own")
    if source.tests != SOURCE_EXPECTED:
        problems.append(f"the source's tests gave {source.tests!r}, expected {SOURCE_EXPECTED!r}")
    for view, fix in zip(kids, FIXES, strict=True):
        if view.split_sha256 != sha256_text(fix.source):
            problems.append(f"{fix.name}: ledger/split.py is not its own fix")
        if view.notes != sorted(["NOTES-source.md", f"NOTES-{fix.name}.md"]):
            problems.append(f"{fix.name}: sees notes {view.notes} (only the source's and its own)")
        if view.tests != fix.expected:
            problems.append(f"{fix.name}: tests gave {view.tests!r}, expected {fix.expected!r}")
        if view.branch != f"fix/{fix.name}":
            problems.append(f"{fix.name}: on git branch {view.branch!r}")
    compiled = [v.pycache.get(_split_pyc(v)) for v in views]
    if None in compiled or len(set(compiled)) != len(views):
        problems.append(
            "ledger/__pycache__ is not each sandbox's own: "
            + ", ".join(f"{v.role} {c}" for v, c in zip(views, compiled, strict=True))
        )
    if len({v.head for v in views}) != len(views):
        problems.append("two sandboxes share a git HEAD: " + ", ".join(v.head for v in views))
    return problems


def _split_pyc(view: SandboxView) -> str:
    names = [p for p in view.pycache if p.startswith("ledger/__pycache__/split.")]
    return names[0] if names else "ledger/__pycache__/split.pyc"


def ensure_snapshot(store: Store, tag: str, say: Say) -> None:
    """``tag`` in the local store, pulled from the default hub if it is not there yet."""
    with contextlib.suppress(NotFound):
        store.resolve(tag)
        return
    from forkd.registry import credentials
    from forkd.registry.client import RegistryClient
    from forkd.registry.reference import parse_remote
    from forkd.registry.transfer import pull

    try:
        remote = parse_remote(tag)
        with RegistryClient(remote.hub, credentials.load(remote.hub.host)) as client:
            say(f"pulling {remote}")
            pull(store, remote, client)
    except ForkdError as exc:
        raise NotFound(
            f"no snapshot {tag} here and pulling it failed ({exc}); run the main job "
            "(scripts/run.sh publishes deeplethe/coding-agent on its hub) or "
            "`forkd build recipes/coding-agent/recipe.toml --tag TAG` and pass --tag TAG"
        ) from exc


def run(store: Store, tag: str = DEFAULT_TAG, *, say: Say) -> CodingDemoReport:
    """The whole demo; every sandbox it starts is killed and its branch tag removed."""
    from forkd.engine import branch as br
    from forkd.engine import children as ch

    t_start = time.perf_counter()
    ensure_snapshot(store, tag, say)
    branch_tag = f"coding-agent-demo:{secrets.token_hex(4)}"
    started: list[str] = []
    try:
        source = ch.fork(store, tag, 1).children[0]
        started.append(source.id)
        say(f"source {source.id} ready in {source.timings_ms.get('ready', 0):.0f} ms")
        write_file(source.id, "NOTES-source.md", "# source\n\nsplit() loses the remainder.\n")
        source_tests = run_tests(source.id)
        say(f"source: tests {source_tests[1]} (the bug, reproduced)")
        t0 = time.perf_counter()
        branched = br.branch(store, source.id, branch_tag)
        report = CodingDemoReport(
            tag, branch_tag, branched.pause_ms, (time.perf_counter() - t0) * 1000
        )
        say(f"branch {branch_tag}: source paused {branched.pause_ms:.1f} ms")
        forked = ch.fork(store, branch_tag, len(FIXES))
        started.extend(c.id for c in forked.children)
        if forked.errors or len(forked.children) != len(FIXES):
            raise ForkdError("grandchildren failed to start:\n" + "\n".join(forked.errors))
        with ThreadPoolExecutor(len(FIXES)) as pool:
            kids = list(pool.map(try_fix, [c.id for c in forked.children], FIXES))
        for view, child in zip(kids, forked.children, strict=True):
            view.ready_ms = child.timings_ms.get("ready", 0.0)
        report.sandboxes = [inspect(source.id, "source", source_tests), *kids]
        report.sandboxes[0].ready_ms = source.timings_ms.get("ready", 0.0)
        report.problems = check(report)
    finally:
        for child_id in started:
            with contextlib.suppress(ForkdError):
                ch.kill(child_id, store)
        with contextlib.suppress(ForkdError):
            store.remove(branch_tag)
    report.seconds = time.perf_counter() - t_start
    return report


def table(report: CodingDemoReport) -> list[str]:
    """The four views side by side."""
    views = report.sandboxes
    rows: list[tuple[str, list[str]]] = [
        ("sandbox", [v.child_id for v in views]),
        ("ready ms", [f"{v.ready_ms:.0f}" for v in views]),
        ("git branch", [v.branch for v in views]),
        ("HEAD", [v.head[:12] for v in views]),
        ("corpus.bin sha256", [v.data_sha256[:16] for v in views]),
        ("split.py sha256", [v.split_sha256[:16] for v in views]),
        ("split.*.pyc sha256", [v.pycache.get(_split_pyc(v), "-")[:16] for v in views]),
        (
            "notes",
            [
                ",".join(n.removeprefix("NOTES-").removesuffix(".md") for n in v.notes)
                for v in views
            ],
        ),
        ("tests", [v.tests for v in views]),
        ("fix + tests s", [f"{v.seconds:.1f}" if v.seconds else "-" for v in views]),
    ]
    width = max(28, *(len(c) for _, cells in rows for c in cells)) + 2
    out = [f"{'':<20}" + "".join(f"{v.role:<{width}}" for v in views)]
    out += [f"{label:<20}" + "".join(f"{c:<{width}}" for c in cells) for label, cells in rows]
    return out
