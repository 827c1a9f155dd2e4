"""Chain assembly by depth: forkd's flattened-map assembly vs the naive way, in one run.

A synthetic base (default 512 MiB: mostly zero pages, some random, some
repeated) gets 1…8 diff layers of ~5% changed pages each. For every depth it
prints forkd's first assembly (cache empty), cached assembly and the layer's
stored bytes, next to a naive baseline measured in the same run: sha256 of
every link's full image, then copy the base and overlay each link in full
(what forkd v0.5 does on every spawn).

    python bench/chain_assembly.py [--size-mib 512] [--depth 8] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff


def naive_spawn(links: list[Path], out: Path) -> None:
    for link in links:  # verify every parent, in full, on every spawn
        h = hashlib.sha256()
        with open(link, "rb") as f:
            while block := f.read(8 << 20):
                h.update(block)
    shutil.copyfile(links[0], out)
    with open(out, "r+b") as dst:
        for link in links[1:]:  # overlay each link's full image
            dst.seek(0)
            with open(link, "rb") as src:
                while block := src.read(8 << 20):
                    dst.write(block)


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--share", type=float, default=0.05, help="changed pages per layer")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="forkd-bench-", dir=args.dir))
    try:
        store = Store(work / "home", auto_compact_depth=max(args.depth, 1))
        images = [work / "l0.mem"]
        print(f"generating a {args.size_mib} MiB base and {args.depth} diff layers in {work}")
        write_base(images[0], args.size_mib << 20, seed=1, random_share=0.15, repeated_share=0.1)
        for d in range(1, args.depth + 1):
            images.append(work / f"l{d}.mem")
            write_diff(images[d - 1], images[d], share=args.share, seed=d)

        print(
            f"\n{'depth':>5} {'import s':>8} {'stored MiB':>10} {'changed MiB':>11} "
            f"{'first ms':>9} {'cached ms':>9} {'naive ms':>9} {'naive/first':>11}"
        )
        rows = []
        for d, image in enumerate(images):
            parent = f"l{d - 1}" if d else None
            start = time.perf_counter()
            info = store.import_layer(f"l{d}", memory=image, parent=parent)
            import_s = time.perf_counter() - start
            cache = store.cache_dir / info.digest.split(":")[1]

            def first(cache: Path = cache, tag: str = f"l{d}") -> None:
                shutil.rmtree(cache, ignore_errors=True)
                store.assemble(tag)

            first_ms = timed(first, args.repeat)
            cached_ms = timed(lambda tag=f"l{d}": store.assemble(tag), args.repeat * 3)
            out = work / "naive.out"
            naive_ms = timed(
                lambda links=images[: d + 1], out=out: naive_spawn(links, out), args.repeat
            )
            changed = info.new_pages * 4096 / (1 << 20)
            stored = info.stored_bytes / (1 << 20)
            rows.append((d, first_ms, cached_ms, naive_ms))
            print(
                f"{d:>5} {import_s:>8.2f} {stored:>10.1f} {changed:>11.1f} {first_ms:>9.0f} "
                f"{cached_ms:>9.1f} {naive_ms:>9.0f} {naive_ms / first_ms:>10.1f}x"
            )
            assert store.assemble(f"l{d}").memory.read_bytes() == image.read_bytes()

        base_first, base_cached = rows[0][1], rows[0][2]
        d3 = rows[min(3, len(rows) - 1)]
        print(
            f"\ndepth {d3[0]} vs depth 0: first assembly {d3[1] / base_first:.2f}x "
            f"(target <= 1.5x), cached {d3[2] / base_cached:.2f}x (target <= 1.1x); "
            f"naive depth {d3[0]} vs naive depth 0: {d3[3] / rows[0][3]:.2f}x"
        )
        print(
            "stored bytes of a diff layer are its changed pages (compressed), "
            "not the full image (see the stored/changed columns)"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
