"""Sequential disk reads through the lazy NBD export vs the assembled raw image, in one run.

The same QEMU client (``qemu-img bench``: 1 MiB reads, in order, queue depth 1 and 8)
reads the whole disk of one chain, three times each, interleaved: from the eagerly
assembled ``disk.img`` (the baseline, page cache warm) and through engine/lazy/nbd.py,
whose every read is cut into chunk pieces, decompressed from the local store (the
ChunkSource's LRU holds 16 chunks) and sent over a unix socket; holes go as NBD holes.
Figures are MB/s and the export's ratio to the baseline (medians). Fetching from a hub
is bench/lazy_fork.py's part.

    python bench/lazy_disk.py [--size-mib 256] [--dir /tmp]      # a synthetic 2-layer chain
    python bench/lazy_disk.py --home ~/.local/share/forkd --ref python-numpy:latest

``disk_read_figures`` is what bench/lazy_fork.py can call on any chain.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from forkd.engine.lazy.chunks import ChunkSource, open_local
from forkd.engine.lazy.nbd import start_disk_export
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

BLOCK = 1 << 20
DEPTHS = (1, 8)


def qemu_img_bench(target: str, size: int, depth: int) -> float:
    """Seconds ``qemu-img bench`` takes to read ``size`` bytes of raw ``target`` in order."""
    count = size // BLOCK
    p = subprocess.run(["qemu-img", "bench", "-f", "raw", "-c", str(count), "-d", str(depth),
                        "-s", str(BLOCK), target], capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, check=True, timeout=1800)
    m = re.search(r"Run completed in ([0-9.]+) seconds", p.stdout)
    if m is None:
        raise RuntimeError(f"qemu-img bench printed no time: {p.stdout}{p.stderr}")
    return float(m.group(1))


def disk_read_figures(source: ChunkSource, assembled: Path, run_dir: Path,
                      repeat: int = 3) -> dict[str, float]:
    """MB/s of sequential reads (the median of ``repeat`` runs, interleaved): the assembled
    image (``raw_dN``) and the export (``nbd_dN``), N the queue depth. The export's first
    run reads chunks nobody decoded yet; its LRU holds 16 of them, so every whole-disk
    pass decodes every chunk again."""
    size = assembled.stat().st_size
    mb = size / 1e6
    assembled.read_bytes()  # the baseline reads from the page cache, as the store's blobs do
    samples: dict[str, list[float]] = {}
    with start_disk_export(source, run_dir) as ex:
        for _ in range(repeat):
            for depth in DEPTHS:
                for key, target in ((f"raw_d{depth}", str(assembled)),
                                    (f"nbd_d{depth}", ex.backing_spec())):
                    samples.setdefault(key, []).append(mb / qemu_img_bench(target, size, depth))
        assert not ex.errors, ex.errors
    return {key: statistics.median(values) for key, values in samples.items()}


def synthetic_chain(work: Path, size: int) -> tuple[Store, str]:
    """A flat base (30% random pages, 10% repeated) and a diff changing 5% of its pages."""
    memory, base, head = work / "memory.img", work / "base.img", work / "head.img"
    write_base(memory, 4 << 20, seed=1)
    write_base(base, size, seed=2, random_share=0.3, repeated_share=0.1)
    write_diff(base, head, share=0.05, seed=3)
    store = Store(work / "home")
    store.import_layer("bench-disk:v1", memory=memory, disk=base)
    store.import_layer("bench-disk:v2", memory=memory, disk=head, parent="bench-disk:v1")
    for p in (memory, base, head):
        p.unlink()
    return store, "bench-disk:v2"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=256, help="synthetic disk size")
    ap.add_argument("--home", type=Path, help="a store to read --ref from")
    ap.add_argument("--ref", help="a tag in --home whose chain has a disk")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="forkd-lazy-disk-", dir=args.dir))
    try:
        if args.ref:
            store, ref = Store(args.home) if args.home else Store.open(), args.ref
        else:
            store, ref = synthetic_chain(work, args.size_mib << 20)
        assembled = store.assemble(ref).disk
        if assembled is None:
            raise SystemExit(f"{ref} has no disk image")
        source = open_local(store, ref)
        figures = disk_read_figures(source, assembled, work / "run")
        size = assembled.stat().st_size
        print(f"{ref}: disk {size >> 20} MiB, {len(source.refs)} chunks in the chain, "
              f"1 MiB sequential reads (qemu-img bench)")
        print(f"{'queue depth':>12} {'raw image MB/s':>15} {'NBD export MB/s':>16} {'NBD/raw':>8}")
        for d in DEPTHS:
            raw, export = figures[f"raw_d{d}"], figures[f"nbd_d{d}"]
            print(f"{d:>12} {raw:>15.0f} {export:>16.0f} {export / raw:>8.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
