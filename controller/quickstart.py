"""`forkd quickstart`: from a fresh machine to ten warm forks, through a local hub.

Steps (each reuses what an earlier run left, so a second run takes seconds):
1. host prerequisites (Debian packages) — installed after asking, or with ``--yes``;
2. a hub: ``$FORKD_HUB`` when set (with stored credentials), else an embedded
   one started in the background with its data in ``$FORKD_HOME/quickstart/hub``,
   made the default hub unless the user configured one;
3. the base snapshot: built from the recipe (cached by recipe content), or
   pulled from the hub when the hub has it and this store does not;
4. push it to the hub (only missing blobs travel);
5. pull it into a second, separate store (``$FORKD_HOME/quickstart/pulled``),
   verified — the path a teammate's machine takes;
6. fork N children from the pulled store, evaluate code in each, print
   per-child timings and the catalog URL;
7. on the embedded hub, the bundled packs (BUNDLED_RECIPES): each built (cached by
   recipe content), pushed as ``deeplethe/<recipe name>:latest`` unless the hub already
   has that digest, and made public, so ``forkd pull deeplethe/NAME`` works anywhere.
   When some still need a build (the first run: minutes), a background job publishes them
   (controller/bundles_job.py) and the command returns after step 6; a later run waits
   for that job. ``--wait`` publishes them before returning.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import httpx

from forkd.errors import Conflict, ForkdError, InvalidInput, NotFound
from forkd.registry import credentials
from forkd.registry.client import RegistryClient, RegistryError, RegistryNotFound
from forkd.registry.reference import Hub, env_hub, parse_remote, set_default_hub
from forkd.registry.transfer import pull, push
from forkd.store.store import Store

# (tool, Debian package) the engine needs on the host: the one list of host prerequisites.
HOST_PREREQUISITES: list[tuple[str, str]] = [
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("qemu-img", "qemu-utils"),
    ("debootstrap", "debootstrap"),
    ("busybox", "busybox-static"),
    ("cpio", "cpio"),
    ("mkfs.ext4", "e2fsprogs"),
    ("lz4", "lz4"),
    ("iptables", "iptables"),  # `forkd fork --egress`: a child's direct TCP is refused
    ("tc", "iproute2"),  # `forkd fork --net-kbit`: a tbf qdisc on the child's tap
    ("fusermount3", "fuse3"),  # `forkd fork --lazy`: the memory image as a FUSE file
]
HUB_USER = "forkd"  # the embedded hub's admin; the base goes to its namespace
# The packs the main job publishes on its embedded hub, as BUNDLED_NAMESPACE/<recipe name>:
# recipe files under recipes/ (the forkd.recipes package). Adding a pack is one line here.
BUNDLED_NAMESPACE = "deeplethe"
BUNDLED_RECIPES: tuple[str, ...] = (
    "python-numpy.toml",
    "langgraph-react/recipe.toml",
    "coding-agent/recipe.toml",
    "code-interpreter.toml",
)
Say = Callable[[str], None]


class QuickstartError(ForkdError):
    """A quickstart step failed; the message names the step and what to do."""


def missing_prerequisites() -> list[str]:
    return sorted({pkg for tool, pkg in HOST_PREREQUISITES if shutil.which(tool) is None})


def install_packages(packages: list[str], say: Say) -> None:
    if not packages:
        return
    if os.geteuid() != 0:
        raise QuickstartError(
            f"installing {' '.join(packages)} needs root: run "
            f"`sudo apt-get install -y {' '.join(packages)}` and try again"
        )
    say(f"installing Debian packages: {' '.join(packages)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
    ):
        proc = subprocess.run(
            argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL
        )
        if proc.returncode != 0:
            raise QuickstartError(f"`{' '.join(argv)}` failed:\n{proc.stderr[-2000:]}")


@dataclass
class EmbeddedHub:
    """A hub this tool started: its data directory, address and admin credential."""

    data: Path
    hub: Hub
    password: str
    started: bool = False

    @property
    def url(self) -> str:
        return self.hub.url

    @property
    def hub_data(self) -> Path:
        return self.data / "data"

    def admin(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run `forkd hub ARGS --data DATA` (the hub's own admin CLI on its data)."""
        return subprocess.run(
            # -P and cwd: the installed forkd, never a checkout's forkd/ folder in the cwd
            [sys.executable, "-P", "-m", "forkd.cli", "hub", *args, "--data", str(self.hub_data)],
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            cwd=self.data,
        )

    def make_public(self, repository: str) -> None:
        """Anonymous pull and browsing of ``repository``."""
        proc = self.admin("repo", "visibility", repository, "public")
        if proc.returncode != 0:
            raise QuickstartError(f"could not make {repository} public: {proc.stderr[-500:]}")

    def ensure_namespace(self, namespace: str) -> None:
        """Organisation ``namespace`` with the admin user as its admin (kept if it exists)."""
        proc = self.admin("org", "add", namespace)
        if proc.returncode not in (0, Conflict.exit_code):  # Conflict: it exists already
            raise QuickstartError(f"could not create namespace {namespace}: {proc.stderr[-500:]}")
        proc = self.admin("org", "member", namespace, HUB_USER, "admin")
        if proc.returncode != 0:
            raise QuickstartError(
                f"could not make {HUB_USER} an admin of {namespace}: {proc.stderr[-500:]}"
            )

    def is_public(self, repository: str, tag: str) -> bool:
        """Whether an anonymous client can read ``repository:tag``."""
        try:
            with RegistryClient(self.hub, None) as anonymous:
                anonymous.get_manifest(repository, tag)
        except RegistryError:
            return False
        return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v2/", timeout=2).status_code in (200, 401)
    except httpx.HTTPError:
        return False


def embedded_hub(root: Path, say: Say) -> EmbeddedHub:
    """Reuse the hub a previous run started, or start one in the background."""
    root.mkdir(parents=True, exist_ok=True)
    state_file = root / "state.json"
    state: dict[str, Any] = {}
    if state_file.exists():
        state = json.loads(state_file.read_text())
    password_file = root / "admin-password"
    if not password_file.exists():
        fd = os.open(password_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(18))
    password = password_file.read_text().strip()
    if state.get("listen") and _answers(f"http://{state['listen']}"):
        say(f"hub: reusing the embedded hub at http://{state['listen']}")
        return EmbeddedHub(root, Hub(state["listen"], "http"), password)
    listen = state.get("listen") or f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "FORKD_HUB_ADMIN_USER": HUB_USER, "FORKD_HUB_ADMIN_PASSWORD": password}
    log = open(root / "hub.log", "ab")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen(
        # -P and cwd: the installed forkd, never a checkout's forkd/ folder in the cwd
        [
            sys.executable,
            "-P",
            "-m",
            "forkd.cli",
            "hub",
            "serve",
            "--data",
            str(root / "data"),
            "--listen",
            listen,
        ],
        env=env,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        cwd=root,
    )
    log.close()
    deadline = time.monotonic() + 60
    while not _answers(f"http://{listen}"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise QuickstartError(f"the embedded hub did not start; see {root / 'hub.log'}")
        time.sleep(0.2)
    state_file.write_text(json.dumps({"listen": listen, "pid": proc.pid}))
    say(f"hub: started an embedded hub at http://{listen} (pid {proc.pid}, data in {root})")
    return EmbeddedHub(root, Hub(listen, "http"), password, started=True)


def make_default_hub(hub: Hub, say: Say) -> bool:
    """Make the embedded ``hub`` the default hub unless the user chose one.

    A default this step stored earlier (an embedded hub of a previous run) is replaced;
    one the user set (`forkd config set hub`, `forkd login --default`), even an unusable
    one, is never touched. Returns whether the default was written."""
    try:
        stored = credentials.load_default_hub()
    except ForkdError as exc:
        say(f"hub: the default hub is left as it is ({exc})")
        return False
    if stored is not None and stored.set_by != "quickstart":
        if stored.address != hub.address:
            say(f"hub: the default hub stays {stored.address} (yours); this hub is {hub.address}")
        return False
    if stored is not None and stored.address == hub.address:
        return False
    path = set_default_hub(hub, set_by="quickstart")
    say(f"hub: {hub.address} is now the default hub (in {path}; `forkd pull NS/NAME` uses it)")
    return True


@dataclass
class ChildReport:
    id: str
    ready_ms: float
    eval_ms: float
    value: Any


@dataclass
class BundledReport:
    """One bundled pack: built or cached, pushed or already on the hub."""

    repository: str
    digest: str
    built: bool
    build_s: float
    pushed: bool  # false: the hub already had this digest under the tag
    push_blobs: int
    stored_bytes: int  # of a pack built in this run (0 when cached)


@dataclass
class QuickstartReport:
    hub: str
    tag: str
    built: bool
    pulled_from_hub: bool
    push_blobs: int
    pull_blobs: int
    fork_ms: float
    children: list[ChildReport] = field(default_factory=list)
    catalog_url: str = ""
    bundled: list[BundledReport] = field(default_factory=list)
    bundles_log: str = ""  # the background job publishing the bundled packs (none: "")
    seconds: float = 0.0


@dataclass
class GuestPrefetch:
    """Guest images (debootstrap, root disk) of the bundled recipes that are not built yet,
    made in a background thread while the base boots, warms and compresses: debootstrap
    waits on the network and the disk, compression on the CPU. The builds later find the
    images in $FORKD_CACHE; a failure here is left for that build to meet and report."""

    thread: threading.Thread

    @classmethod
    def start(cls, store: Store, paths: list[Path], say: Say) -> GuestPrefetch:
        from forkd.engine import image
        from forkd.engine import recipe as recipes
        from forkd.engine.build import cached_snapshot

        def work() -> None:
            for path in paths:
                try:
                    recipe = recipes.load(path)
                    if cached_snapshot(store, recipe) is None:
                        image.build_guest(recipe, _prefixed(say, f"  [prefetch {recipe.name}] "))
                except (ForkdError, OSError) as exc:
                    say(f"  [prefetch {path}] failed, its build will try again: {exc}")

        thread = threading.Thread(target=work, name="forkd-guest-prefetch", daemon=True)
        thread.start()
        return cls(thread)

    def wait(self) -> None:
        self.thread.join()


def bundled_recipe_paths() -> list[Path]:
    """BUNDLED_RECIPES as files of the installed forkd.recipes package."""
    root = Path(str(resources.files("forkd.recipes")))
    paths = [root / name for name in BUNDLED_RECIPES]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise QuickstartError(
            f"bundled recipe(s) {', '.join(missing)} are not installed; reinstall forkd "
            "(`pip install .` from the checkout)"
        )
    return paths


def _prefixed(say: Say, prefix: str) -> Say:
    return lambda message: say(prefix + message)


def hub_digest(client: RegistryClient, repository: str, tag: str) -> str | None:
    """The manifest digest the hub has under ``repository:tag`` (None: it has none)."""
    try:
        return client.get_manifest(repository, tag)[1]
    except RegistryNotFound:
        return None


def publish_bundled(
    store: Store,
    paths: list[Path],
    embedded: EmbeddedHub,
    say: Say,
    on_published: Callable[[BundledReport], None] | None = None,
) -> list[BundledReport]:
    """Build each recipe as BUNDLED_NAMESPACE/<name>:latest (cached by content), push it
    unless the hub has that digest under the tag already, and make it public;
    ``on_published`` hears of each pack once it is public."""
    from forkd.engine import recipe as recipes
    from forkd.engine.build import build

    reports: list[BundledReport] = []
    namespace_ready = False
    with RegistryClient(embedded.hub, credentials.load(embedded.hub.host)) as client:
        for i, path in enumerate(paths, 1):
            recipe = recipes.load(path)
            repository = f"{BUNDLED_NAMESPACE}/{recipe.name}"
            tag = f"{repository}:latest"
            say(f"bundled pack {i}/{len(paths)}: {repository}")
            t0 = time.perf_counter()
            res = build(store, recipe, tag, progress=_prefixed(say, f"  [{recipe.name}] "))
            report = BundledReport(
                repository,
                res.digest,
                not res.cached,
                time.perf_counter() - t0,
                False,
                0,
                res.stored_bytes,
            )
            if hub_digest(client, repository, "latest") != res.digest:
                if not namespace_ready:
                    embedded.ensure_namespace(BUNDLED_NAMESPACE)
                    namespace_ready = True
                remote = parse_remote(f"{embedded.hub.host}/{tag}", embedded.hub)
                report.pushed = True
                t1 = time.perf_counter()
                report.push_blobs = push(store, tag, remote, client).blobs_sent
                say(f"  [{recipe.name}] phase push: {time.perf_counter() - t1:.1f} s")
            if not embedded.is_public(repository, "latest"):
                embedded.make_public(repository)
            say(
                f"  {repository}: {'built' if report.built else 'cached'} in "
                f"{report.build_s:.1f} s, "
                + (
                    f"pushed ({report.push_blobs} blobs)"
                    if report.pushed
                    else "already on the hub (nothing pushed)"
                )
            )
            reports.append(report)
            if on_published is not None:
                on_published(report)
    return reports


def running_job_for(root: Path, repositories: list[str]) -> dict[str, Any] | None:
    """The state of the bundles job running under ``root`` when it publishes every one of
    ``repositories`` (a later run leaves it to finish); else None."""
    from forkd.controller import bundles_job

    state = bundles_job.status(root)
    if state is None or state["state"] != "running":
        return None
    return state if set(repositories) <= set(state.get("repositories", [])) else None


def bundles(
    store: Store,
    root: Path,
    paths: list[Path],
    embedded: EmbeddedHub,
    say: Say,
    wait: bool,
) -> tuple[list[BundledReport], str]:
    """The bundled packs: published here when none needs a build (seconds) or ``wait``,
    else by a background job (controller/bundles_job.py) whose log is returned. A job an
    earlier run started for these packs is left to finish (its log is returned: a second
    run takes seconds however long the bundled builds take); one publishing other packs,
    or any with ``wait``, is waited for first. Either way one recipe is never built twice
    at once."""
    from forkd.controller import bundles_job
    from forkd.engine import recipe as recipes
    from forkd.engine.build import cached_snapshot

    loaded = [recipes.load(p) for p in paths]
    repositories = [f"{BUNDLED_NAMESPACE}/{r.name}" for r in loaded]
    running = None if wait else running_job_for(root, repositories)
    if running is not None:
        log = bundles_job.log_path(root)
        say(f"bundled packs: the background job of an earlier run (pid {running['pid']}) is "
            f"still building and publishing them (log {log}); `forkd quickstart --wait` "
            "waits for it")
        return [], str(log)
    bundles_job.wait(root, say)  # a job publishing other packs: never two builds at once
    to_build = [r.name for r in loaded if cached_snapshot(store, r) is None]
    if wait or not to_build:
        return publish_bundled(store, paths, embedded, say), ""
    log = bundles_job.start(root, paths, repositories)
    say(
        f"bundled packs: {', '.join(to_build)} to build; publishing all {len(paths)} in the "
        f"background (log {log}); `forkd quickstart --wait` waits for them"
    )
    return [], str(log)


def run(
    *,
    recipe_path: Path,
    n: int,
    code: str,
    yes: bool,
    keep: bool,
    confirm: Callable[[str], bool],
    say: Say,
    bundled: list[Path] | None = None,
    wait_bundles: bool = False,
) -> QuickstartReport:
    """The main job (module docstring). ``bundled``: recipes to publish as
    BUNDLED_NAMESPACE/<name> instead of BUNDLED_RECIPES (an empty list: none);
    wait_bundles: publish them before returning even when some need a build."""
    from forkd.engine import children as ch
    from forkd.engine import image
    from forkd.engine import recipe as recipes
    from forkd.engine.build import build, cached_snapshot

    if n <= 0:
        raise InvalidInput(f"number of children must be positive, got {n}")
    start = time.perf_counter()
    missing = missing_prerequisites()
    if missing:
        if not yes and not confirm(f"install the Debian packages {' '.join(missing)}?"):
            raise QuickstartError(f"forkd needs {' '.join(missing)}; install them or pass --yes")
        install_packages(missing, say)
    else:
        say("host: prerequisites present")

    store = Store.open()
    root = store.home / "quickstart"
    hub = env_hub()
    embedded: EmbeddedHub | None = None
    if hub is None:
        embedded = embedded_hub(root / "hub", say)
        hub = embedded.hub
        credentials.save(hub.host, credentials.Credential(HUB_USER, embedded.password,
                                                           hub.scheme))
        make_default_hub(hub, say)
    else:
        say(f"hub: using FORKD_HUB={hub.host}")
    recipe = recipes.load(recipe_path)
    repository = f"{HUB_USER}/{recipe.name}"
    remote = parse_remote(f"{hub.host}/{repository}:latest", hub)
    tag = f"{repository}:latest"

    bundle_paths: list[Path] = []
    if embedded is not None:
        bundle_paths = bundled_recipe_paths() if bundled is None else bundled
    built = pulled = False
    prefetch: GuestPrefetch | None = None
    with RegistryClient(hub, credentials.load(hub.host)) as client:
        try:
            store.resolve(tag)
        except NotFound:
            try:
                result = pull(store, remote, client)
                pulled = True
                say(f"base: pulled {remote} ({result.blobs_sent} blobs)")
            except RegistryNotFound:
                pass
        if not pulled:
            t0 = time.perf_counter()
            if cached_snapshot(store, recipe) is None:
                image.build_guest(recipe, _prefixed(say, "  "))  # kernel, initramfs, rootfs
                # while the base boots and compresses (a cached base has nothing to overlap)
                prefetch = GuestPrefetch.start(store, bundle_paths, say)
            res = build(store, recipe, tag, progress=lambda m: say(f"  {m}"))
            built = not res.cached
            say(
                f"base: {res.ref} {'cached' if res.cached else 'built'} in "
                f"{time.perf_counter() - t0:.1f} s"
            )
        t0 = time.perf_counter()
        pushed = push(store, tag, remote, client)
        say(f"  phase push: {time.perf_counter() - t0:.1f} s")
        say(f"push: {pushed.blobs_sent} blobs sent, {pushed.blobs_skipped} already on the hub")
        if embedded is not None and not embedded.is_public(repository, "latest"):
            embedded.make_public(repository)  # so the catalog shows it signed out
        fresh = Store(root / "pulled")
        got = pull(fresh, remote, client, force=True)  # a scratch mirror of the hub's tag
        say(
            f"pull into a fresh store: {got.blobs_sent} blobs fetched and verified, "
            f"{got.blobs_skipped} already there"
        )

    t0 = time.perf_counter()
    forked = ch.fork(fresh, got.ref, n)
    fork_ms = (time.perf_counter() - t0) * 1000
    report = QuickstartReport(
        hub.host, got.ref, built, pulled, pushed.blobs_sent, got.blobs_sent, fork_ms
    )
    try:
        for child in forked.children:
            t1 = time.perf_counter()
            reply = ch.eval_in(child.id, code)
            if reply.get("error"):
                raise QuickstartError(f"eval in {child.id} failed: {reply['error']}")
            report.children.append(
                ChildReport(
                    child.id,
                    child.timings_ms.get("ready", 0.0),
                    (time.perf_counter() - t1) * 1000,
                    reply.get("value"),
                )
            )
    finally:
        if not keep:
            for child in forked.children:
                ch.kill(child.id)
    if forked.errors:
        raise QuickstartError("some children failed to start:\n" + "\n".join(forked.errors))
    report.catalog_url = f"{hub.url}/{repository}"
    if embedded is None:
        say(f"bundled packs: not published (FORKD_HUB={hub.host} is not this run's hub)")
    else:
        if prefetch is not None:
            prefetch.wait()
        report.bundled, report.bundles_log = bundles(
            store, root, bundle_paths, embedded, say, wait_bundles
        )
    report.seconds = time.perf_counter() - start
    return report
