"""Guest image build: debootstrap rootfs, Debian cloud kernel as PVH vmlinux, initramfs.

Everything is cached under $FORKD_CACHE (see paths.py) keyed by the inputs, so a
second build of the same recipe reuses the rootfs, kernel and images.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import lzma
import os
import re
import shutil
import ssl
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from forkd import digest
from forkd.engine.errors import GuestBuildError, HostError
from forkd.engine.paths import cache_dir
from forkd.engine.phases import phase
from forkd.engine.recipe import Recipe
from forkd.names import inert
from forkd.store.tags import flock

Progress = Callable[[str], None]

KERNEL_PACKAGE = "linux-image-cloud-amd64"
# Loaded in this order by the initramfs (paths under lib/modules/<ver>/kernel/).
VIRTIO_MODULES = (
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_mmio",
    "drivers/char/virtio_console",
    "drivers/block/virtio_blk",
    "drivers/char/hw_random/virtio-rng",
    "net/core/failover",
    "drivers/net/net_failover",
    "drivers/net/virtio_net",
)
AGENT_GUEST_PATH = "/opt/forkd/agent.py"
# Bumped whenever what goes into a root disk image changes (part of its cache key).
ROOT_IMAGE_LAYOUT = "3"
# Left out of the root disk (docs/recipes.md, "Slim root disk"): nothing the guest runs reads
# them. Globs relative to the root; a directory matched is removed with its content.
SLIM_REMOVE = (
    "usr/share/man/*",
    "usr/share/info/*",
    "usr/share/lintian/*",
    "usr/share/locale/*",  # message translations (locale.alias stays: SLIM_KEEP)
    "var/lib/apt/lists/*",  # the package index: `apt-get update` fetches it again
    "var/cache/apt/*.bin",
    "var/cache/debconf/*-old",
)
SLIM_KEEP = frozenset({"usr/share/locale/locale.alias"})
# Later `apt-get install`s in a sandbox skip the same files (dpkg path-exclude).
DPKG_SLIM_CFG = """# forkd: keep the root disk small (docs/recipes.md)
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/lintian/*
path-exclude=/usr/share/locale/*/LC_MESSAGES/*.mo
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
"""


@dataclass(frozen=True)
class Kernel:
    version: str
    vmlinux: Path
    modules: Path  # .../lib/modules/<version>/kernel
    digest: str  # sha256 of vmlinux


@dataclass(frozen=True)
class GuestImage:
    kernel: Kernel
    initrd: Path
    root: Path  # raw ext4 image
    key: str


def _noop(_: str) -> None:
    pass


def _run(argv: list[str], what: str, *, cwd: Path | None = None, timeout: float = 1800,
         env: dict[str, str] | None = None) -> str:
    try:
        p = subprocess.run(argv, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=timeout, env=env, check=False)
    except FileNotFoundError as e:
        raise HostError(f"{what}: {argv[0]} is not installed; run `forkd doctor` for the apt "
                        "packages the engine needs") from e
    except subprocess.TimeoutExpired as e:
        raise GuestBuildError(f"{what}: {argv[0]} did not finish within {timeout:.0f} s") from e
    if p.returncode != 0:
        tail = (p.stderr or p.stdout).strip().splitlines()[-15:]
        raise GuestBuildError(f"{what} failed (exit {p.returncode}): {' '.join(argv[:6])}...\n"
                              + inert("\n".join(tail)))
    return p.stdout


def agent_source() -> bytes:
    return resources.files("forkd.engine").joinpath("guest/agent.py").read_bytes()


def init_source() -> bytes:
    return resources.files("forkd.engine").joinpath("guest/init").read_bytes()


def guest_code_digest() -> str:
    """Changes whenever the guest agent or init changes (part of every build cache key)."""
    return digest.of_bytes(agent_source() + b"\0" + init_source())


# ---------------------------------------------------------------- debs
def _apt_download(package: str, progress: Progress) -> Path:
    """`apt-get download` the candidate version of a package into the cache (once)."""
    debs = cache_dir() / "debs"
    debs.mkdir(exist_ok=True)
    out = _run(["apt-cache", "show", "--no-all-versions", package], f"apt-cache show {package}")
    m = re.search(r"^Version: (\S+)$", out, re.M)
    if not m:
        raise GuestBuildError(f"apt knows no package {package!r}; run `apt-get update` and retry")
    version = m.group(1)
    for f in debs.glob(f"{package}_*.deb"):
        if f.name.startswith(f"{package}_{version.replace(':', '%3a')}_"):
            return f
    progress(f"downloading {package} {version}")
    _run(["apt-get", "download", f"{package}={version}"], f"apt-get download {package}", cwd=debs)
    for f in debs.glob(f"{package}_*.deb"):
        if f.name.startswith(f"{package}_{version.replace(':', '%3a')}_"):
            return f
    raise GuestBuildError(f"apt-get download {package} produced no .deb in {debs}")


def _extract_deb(deb: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _run(["dpkg-deb", "-x", str(deb), str(tmp)], f"dpkg-deb -x {deb.name}")
    tmp.rename(dest)


# ---------------------------------------------------------------- kernel
def _pvh_vmlinux_from_bzimage(bz: bytes) -> bytes:
    """Pull the uncompressed ELF (which carries the PVH note) out of a bzImage."""
    candidates: list[tuple[int, str]] = []
    for magic, kind in ((b"\x02\x21\x4c\x18", "lz4"), (b"\xfd7zXZ\x00", "xz"),
                        (b"\x28\xb5\x2f\xfd", "zstd"), (b"\x1f\x8b\x08", "gzip")):
        i = bz.find(magic)
        if i >= 0:
            candidates.append((i, kind))
    for off, kind in sorted(candidates):
        data = bz[off:]
        out = b""
        try:
            if kind == "lz4":
                p = subprocess.run(["lz4", "-dc"], input=data, capture_output=True, check=False)
                out = p.stdout
            elif kind == "xz":
                out = lzma.LZMADecompressor().decompress(data)
            elif kind == "gzip":
                out = gzip.GzipFile(fileobj=io.BytesIO(data)).read()
            else:
                import zstandard

                out = zstandard.ZstdDecompressor().decompressobj().decompress(data)
        except FileNotFoundError as e:
            raise HostError("the kernel is LZ4-compressed and `lz4` is missing: "
                            "apt-get install -y lz4") from e
        except Exception:
            continue
        if out.startswith(b"\x7fELF"):
            return out
    raise GuestBuildError("could not find an ELF vmlinux inside the bzImage "
                          "(unknown compression); report the kernel package version")


def fetch_kernel(progress: Progress = _noop) -> Kernel:
    """Debian's cloud kernel: the metapackage's dependency, downloaded and unpacked once."""
    out = _run(["apt-cache", "depends", KERNEL_PACKAGE], f"apt-cache depends {KERNEL_PACKAGE}")
    m = re.search(r"Depends: (linux-image-[0-9][\w.\-]*-cloud-amd64)\b", out)
    if not m:
        raise GuestBuildError(f"{KERNEL_PACKAGE} has no linux-image dependency in apt's lists; "
                              "run `apt-get update` (bookworm main must be in sources)")
    deb = _apt_download(m.group(1), progress)
    kdir = cache_dir() / "kernel" / digest.hex_part(digest.of_file(deb.open("rb")))[:16]
    vmlinux = kdir / "vmlinux"
    if not vmlinux.exists():
        progress(f"extracting {deb.name}")
        shutil.rmtree(kdir, ignore_errors=True)
        kdir.mkdir(parents=True)
        _extract_deb(deb, kdir / "x")
        bzs = sorted((kdir / "x" / "boot").glob("vmlinuz-*"))
        if not bzs:
            raise GuestBuildError(f"{deb.name} contains no boot/vmlinuz-*")
        tmp = kdir / "vmlinux.tmp"
        tmp.write_bytes(_pvh_vmlinux_from_bzimage(bzs[0].read_bytes()))
        tmp.rename(vmlinux)
    bzs = sorted((kdir / "x" / "boot").glob("vmlinuz-*"))
    version = bzs[0].name.removeprefix("vmlinuz-")
    with vmlinux.open("rb") as f:
        kd = digest.of_file(f)
    return Kernel(version, vmlinux, kdir / "x" / "lib" / "modules" / version / "kernel", kd)


# ---------------------------------------------------------------- initramfs
def build_initrd(kernel: Kernel, progress: Progress = _noop) -> Path:
    bb_deb = _apt_download("busybox-static", progress)
    with bb_deb.open("rb") as f:
        key = digest.hex_part(digest.of_chunks([kernel.digest.encode(), digest.of_file(f).encode(),
                                                init_source()]))[:16]
    out = cache_dir() / "images" / f"initrd-{key}.img"
    if out.exists():
        return out
    progress("building initramfs")
    work = cache_dir() / "images" / f"initrd-{key}.d"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _extract_deb(bb_deb, work / "bb")
    tree = work / "tree"
    for d in ("bin", "sbin", "dev", "proc", "sys", "lib/modules", "newroot", "tmp"):
        (tree / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "bb" / "bin" / "busybox", tree / "bin" / "busybox")
    applets = _run([str(tree / "bin" / "busybox"), "--list"], "busybox --list").split()
    for a in applets:
        if a != "busybox":
            (tree / "bin" / a).symlink_to("busybox")
    for m in VIRTIO_MODULES:
        src = kernel.modules / f"{m}.ko"
        if not src.exists():
            raise GuestBuildError(f"kernel {kernel.version} lacks module {m}.ko")
        shutil.copy2(src, tree / "lib" / "modules" / src.name)
    (tree / "init").write_bytes(init_source())
    (tree / "init").chmod(0o755)
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*"))
    tmp = out.with_suffix(".tmp")
    with tmp.open("wb") as f:
        p = subprocess.run(["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree,
                           input=("\n".join([".", *files]) + "\n").encode(), stdout=f,
                           stderr=subprocess.PIPE, check=False)
    if p.returncode != 0:
        raise GuestBuildError(f"cpio failed: {p.stderr.decode(errors='replace')}")
    tmp.rename(out)
    shutil.rmtree(work, ignore_errors=True)
    return out


# ---------------------------------------------------------------- rootfs
# The debootstrap every recipe starts from (docs/recipes.md, "Build time"): minbase plus
# these packages (the guest agent needs python3), made once per suite, mirror and
# architecture; a recipe's rootfs is a copy of it plus `apt-get install` of its own packages.
BASE_PACKAGES = ("python3",)
BASE_LAYOUT = "1"  # bumped whenever the steps that make the shared base change


@functools.cache
def host_arch() -> str:
    """dpkg's name for this host's architecture (asked once per process: every rootfs key
    includes it)."""
    return _run(["dpkg", "--print-architecture"], "dpkg --print-architecture").strip()


def base_key(suite: str, mirror: str) -> str:
    """The shared base's cache key: what its content depends on."""
    body = json.dumps({"suite": suite, "mirror": mirror, "arch": host_arch(),
                       "packages": sorted(BASE_PACKAGES), "layout": BASE_LAYOUT},
                      sort_keys=True)
    return digest.hex_part(digest.of_bytes(body.encode()))[:16]


def _rootfs_key(r: Recipe) -> str:
    body = json.dumps({"suite": r.suite, "mirror": r.mirror, "apt": sorted(r.apt),
                       "pip": sorted(r.pip), "base": base_key(r.suite, r.mirror)},
                      sort_keys=True)
    return digest.hex_part(digest.of_bytes(body.encode()))[:16]


def recipe_packages(r: Recipe) -> list[str]:
    """The apt packages a recipe installs on top of the shared base, in its order."""
    wanted = list(r.apt) + (["python3-pip"] if r.pip else [])
    return [p for i, p in enumerate(wanted) if p not in BASE_PACKAGES and p not in wanted[:i]]


def _debootstrap(suite: str, mirror: str, root: Path, packages: list[str]) -> None:
    _run(["debootstrap", "--variant=minbase", f"--include={','.join(packages)}", suite,
          str(root), mirror], "debootstrap", timeout=3600)
    _run(["chroot", str(root), "apt-get", "clean"], "apt-get clean")


def shared_base(suite: str, mirror: str, progress: Progress = _noop) -> Path:
    """The shared base's root directory, debootstrapped once per ``base_key``. It is built
    in a ``.partial`` directory renamed into place when complete, so an interrupted build
    is never used (its leftovers are removed by the next one)."""
    entry = cache_dir() / "base" / base_key(suite, mirror)
    if (entry / "ok").is_file():
        return entry / "root"
    entry.parent.mkdir(parents=True, exist_ok=True)
    with flock(entry.with_name(entry.name + ".lock"), exclusive=True):  # one builder at a time
        if (entry / "ok").is_file():  # another build finished it while we waited
            return entry / "root"
        partial = entry.with_name(entry.name + ".partial")
        discard_partial(partial)
        discard_partial(entry)  # a complete-looking entry without its marker is not trusted
        partial.mkdir(parents=True)
        progress(f"debootstrap {suite} minbase + {', '.join(BASE_PACKAGES)}, the base every "
                 "recipe shares (once; takes a minute or more)")
        with phase("debootstrap", "shared base", progress):
            _debootstrap(suite, mirror, partial / "root", list(BASE_PACKAGES))
        (partial / "ok").write_text("ok\n")
        os.rename(partial, entry)
    return entry / "root"


def _apt_install(root: Path, packages: list[str]) -> None:
    """`apt-get install` packages into a rootfs (with the package lists debootstrap left
    there; no recommends, like debootstrap's own --include)."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    policy = root / "usr" / "sbin" / "policy-rc.d"  # nothing is started in the chroot
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    (root / "proc").mkdir(exist_ok=True)
    _run(["mount", "-t", "proc", "proc", str(root / "proc")], "mount /proc in the rootfs")
    try:
        _run(["chroot", str(root), "apt-get", "install", "-y", "-q", "--no-install-recommends",
              *packages], "apt-get install in the guest rootfs", timeout=3600, env=env)
    finally:
        subprocess.run(["umount", "-l", str(root / "proc")], stdin=subprocess.DEVNULL,
                       capture_output=True, check=False)
        policy.unlink(missing_ok=True)


HOST_CA_IN_CHROOT = "/tmp/forkd-host-ca.pem"
CA_BUNDLE_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "SSL_CERT_FILE")


def _host_ca_bundle() -> Path | None:
    """The CA bundle the host's own pip trusts: $PIP_CERT, $SSL_CERT_FILE or OpenSSL's."""
    for candidate in (os.environ.get("PIP_CERT"), os.environ.get("SSL_CERT_FILE"),
                      ssl.get_default_verify_paths().cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None


def mounts_below(path: Path) -> list[Path]:
    """Mount points at or below ``path`` (from /proc/self/mounts), deepest first."""
    top = os.path.realpath(path)
    found: list[Path] = []
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 2:
                continue
            point = fields[1].replace("\\040", " ")
            if point == top or point.startswith(top + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def discard_partial(base: Path) -> None:
    """Remove what an interrupted build left at ``base``: a debootstrap killed mid-way leaves
    /proc (and more) mounted in its chroot, which a plain rmtree cannot remove."""
    for point in mounts_below(base):
        subprocess.run(["umount", "-l", str(point)], stdin=subprocess.DEVNULL,
                       capture_output=True, check=False)
    shutil.rmtree(base, ignore_errors=True)
    if base.exists():
        left = ", ".join(str(p) for p in mounts_below(base)) or "files that cannot be removed"
        raise HostError(f"an interrupted build left {base} behind ({left}); unmount and remove "
                        f"it (`umount -R {base}/root; rm -rf {base}`), then build again")


def build_rootfs(r: Recipe, progress: Progress = _noop) -> Path:
    """A copy of the shared base plus the recipe's apt packages, then pip; cached by those
    inputs."""
    if os.geteuid() != 0:
        raise HostError("building a guest root filesystem needs root (debootstrap, chroot); "
                        "run `sudo forkd build ...`")
    base = cache_dir() / "rootfs" / _rootfs_key(r)
    root = base / "root"
    if (base / "ok").exists():
        return root
    shared = shared_base(r.suite, r.mirror, progress)
    discard_partial(base)
    base.mkdir(parents=True)
    with phase("copy base", r.name, progress):
        _run(["cp", "-a", "--reflink=auto", str(shared), str(root)], "copy the shared base")
    extra = recipe_packages(r)
    if extra:
        progress(f"apt-get install {' '.join(extra)}")
        with phase("apt install", r.name, progress):
            _apt_install(root, extra)
    if r.pip:
        progress(f"pip install {' '.join(r.pip)}")
        # pip in the chroot trusts the host's CA bundle (a TLS-inspecting proxy's CA, say),
        # not only the guest's fresh one; the copy is removed before the rootfs is used
        env = dict(os.environ)
        host_ca = _host_ca_bundle()
        if host_ca is not None:
            shutil.copyfile(host_ca, root / HOST_CA_IN_CHROOT.lstrip("/"))
            # every variable pip's requests reads (REQUESTS_CA_BUNDLE beats --cert)
            env |= dict.fromkeys(CA_BUNDLE_VARIABLES, HOST_CA_IN_CHROOT)
            env.pop("SSL_CERT_DIR", None)
        try:
            with phase("pip install", r.name, progress):
                _run(["chroot", str(root), "python3", "-m", "pip", "install", "--no-cache-dir",
                      "--break-system-packages", *r.pip], "pip install in the guest rootfs",
                     timeout=3600, env=env)
        finally:
            (root / HOST_CA_IN_CHROOT.lstrip("/")).unlink(missing_ok=True)
    _run(["chroot", str(root), "apt-get", "clean"], "apt-get clean")
    (base / "ok").write_text("ok\n")
    return root


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def slim_rootfs(stage: Path) -> None:
    """Drop what no guest program reads from a staged copy of a rootfs: SLIM_REMOVE, the test
    suites inside installed Python packages, documentation but its copyright files, and the
    image build's logs; then write the dpkg excludes so later installs skip the same."""
    for pattern in SLIM_REMOVE:
        for p in stage.glob(pattern):
            if str(p.relative_to(stage)) not in SLIM_KEEP:
                _remove(p)
    for lib in [*stage.glob("usr/lib/python3*"), *stage.glob("usr/local/lib/python3*")]:
        # bytecode: the template writes it again for every module its boot and warm-up import;
        # the rest is compiled on a sandbox's first import (docs/recipes.md)
        for cache in sorted(lib.rglob("__pycache__")):
            if cache.is_dir() and not cache.is_symlink():
                shutil.rmtree(cache, ignore_errors=True)
    for site in [*stage.glob("usr/lib/python3/dist-packages"),
                 *stage.glob("usr/local/lib/python3*/dist-packages")]:
        for tests in sorted(site.glob("*/**/tests")):  # inside a package, never a top-level one
            if tests.is_dir() and not tests.is_symlink():
                shutil.rmtree(tests, ignore_errors=True)
    for p in _files(stage / "usr" / "share" / "doc"):
        if p.name != "copyright":
            p.unlink()
    for p in _files(stage / "var" / "log"):
        p.unlink()
    cfg = stage / "etc" / "dpkg" / "dpkg.cfg.d"
    if cfg.is_dir():
        (cfg / "forkd-slim").write_text(DPKG_SLIM_CFG)
    link_duplicates(stage)


LINK_MIN_BYTES = 64 << 10


def link_duplicates(stage: Path) -> int:
    """Hard-link regular files of equal content, mode and owner (at least LINK_MIN_BYTES each,
    e.g. a shared library shipped twice) so the root disk holds their bytes once; returns the
    bytes saved. Package upgrades replace files by rename, which undoes a link safely."""
    by_size: dict[int, list[Path]] = {}
    seen_inodes: set[int] = set()
    for p in sorted(stage.rglob("*")):
        if p.is_symlink() or not p.is_file():
            continue
        st = p.stat()
        if st.st_size < LINK_MIN_BYTES or st.st_ino in seen_inodes:
            continue
        seen_inodes.add(st.st_ino)
        by_size.setdefault(st.st_size, []).append(p)
    saved = 0
    for size, paths in by_size.items():
        if len(paths) < 2:
            continue
        first: dict[tuple[str, int, int, int], Path] = {}
        for p in paths:
            st = p.stat()
            with p.open("rb") as f:
                key = (digest.of_file(f), st.st_mode, st.st_uid, st.st_gid)
            if key not in first:
                first[key] = p
                continue
            tmp = p.with_name(p.name + ".forkd-link")
            os.link(first[key], tmp)
            os.replace(tmp, p)
            saved += size
    return saved


def _files(top: Path) -> list[Path]:
    """Regular files and file symlinks under top (directories and their symlinks stay)."""
    if not top.is_dir():
        return []
    return [p for p in top.rglob("*") if not p.is_dir()]


def build_root_image(r: Recipe, rootfs: Path, progress: Progress = _noop) -> Path:
    """ext4 image of a copy of the rootfs plus the agent and the recipe's files."""
    key = digest.hex_part(digest.of_chunks([_rootfs_key(r).encode(), ROOT_IMAGE_LAYOUT.encode(),
                                            r.content_digest(guest_code_digest()).encode()]))[:16]
    out = cache_dir() / "images" / f"root-{key}.raw"
    if out.exists():
        return out
    progress("building root disk image")
    with phase("root disk", r.name, progress):
        _make_root_image(r, rootfs, key, out)
    return out


def _make_root_image(r: Recipe, rootfs: Path, key: str, out: Path) -> None:
    stage = cache_dir() / "images" / f"root-{key}.d"
    shutil.rmtree(stage, ignore_errors=True)
    _run(["cp", "-a", "--reflink=auto", str(rootfs), str(stage)], "copy rootfs")
    try:
        agent = stage / AGENT_GUEST_PATH.lstrip("/")
        agent.parent.mkdir(parents=True, exist_ok=True)
        agent.write_bytes(agent_source())
        for gf in r.files:
            dst = stage / gf.path.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(gf.content)
            dst.chmod(gf.mode)
        (stage / "etc" / "hostname").write_text("forkd\n")
        _run(["chroot", str(stage), "python3", "-m", "compileall", "-q", "/opt/forkd"],
             "precompile the agent")
        slim_rootfs(stage)
        used = int(_run(["du", "-sm", str(stage)], "du").split()[0])
        size = used + max(r.disk_free_mib, 8) + used // 8
        tmp = out.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        _run(["mkfs.ext4", "-q", "-F", "-L", "forkdroot", "-E", "root_owner=0:0",
              "-d", str(stage), str(tmp), f"{size}M"], "mkfs.ext4")
        tmp.rename(out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def build_guest(r: Recipe, progress: Progress = _noop) -> GuestImage:
    kernel = fetch_kernel(progress)
    initrd = build_initrd(kernel, progress)
    rootfs = build_rootfs(r, progress)
    root = build_root_image(r, rootfs, progress)
    return GuestImage(kernel, initrd, root, root.stem.removeprefix("root-"))
