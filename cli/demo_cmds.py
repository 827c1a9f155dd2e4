"""`forkd demo`: the embedded default main job on synthetic images (no VM, no network)."""

from __future__ import annotations

import filecmp
import tempfile
import time
from pathlib import Path

import click

from forkd import digest as dg
from forkd.cli.output import human
from forkd.errors import IntegrityError
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

LAYERS = ("base", "plus-pandas", "plus-sklearn", "plus-agent")


@click.command()
@click.option(
    "--size-mib",
    default=256,
    show_default=True,
    type=click.IntRange(1, 8192),
    help="Size of the synthetic memory image.",
)
@click.option("--namespace", default="demo", show_default=True, help="Name prefix of the tags.")
def demo(size_mib: int, namespace: str) -> None:
    """Import a synthetic base and three diff layers, show the chain, assemble, compact."""
    store = Store.open()
    click.echo(f"store: {store.home}")
    with tempfile.TemporaryDirectory(prefix="forkd-demo-") as tmp:
        work = Path(tmp)
        parent: str | None = None
        previous: Path | None = None
        for i, layer in enumerate(LAYERS):
            image = work / f"{layer}.mem"
            if previous is None:
                write_base(image, size_mib << 20, seed=1)
            else:
                write_diff(previous, image, share=0.05, seed=i)
            tag = f"{namespace}/{layer}:v1"
            start = time.perf_counter()
            info = store.import_layer(tag, memory=image, parent=parent, force=True)
            click.echo(
                f"imported {tag:<28} depth {info.depth}  {info.new_pages:>6} pages  "
                f"{human(info.stored_bytes):>10} stored  "
                f"({time.perf_counter() - start:.2f} s)"
            )
            parent, previous = tag, image
        assert parent is not None and previous is not None
        report = store.inspect(parent)
        click.echo(f"\nchain of {parent} (head first):")
        for link in report["chain"]:
            click.echo(f"  {link['tag']:<28} {dg.short(link['digest'])}  depth {link['depth']}")
        click.echo(
            f"logical {human(report['logical_bytes'])}, stored "
            f"{human(report['stored_bytes'])} ({report['dedup_ratio']}x)"
        )
        for attempt in ("first", "cached"):
            start = time.perf_counter()
            asm = store.assemble(parent)
            click.echo(f"assembled ({attempt}) in {(time.perf_counter() - start) * 1000:.0f} ms")
        if not filecmp.cmp(asm.memory, previous, shallow=False):
            raise IntegrityError("assembled image differs from the imported one")
        click.echo("assembled image is byte-identical to the imported one")
        flat = f"{namespace}/compacted:v1"
        info = store.compact(parent, flat, force=True)
        same = filecmp.cmp(store.assemble(flat).memory, previous, shallow=False)
        click.echo(
            f"compacted into {flat}: depth {info.depth}, {human(info.stored_bytes)} "
            f"referenced, bytes identical: {same}"
        )
        if not same:
            raise IntegrityError("compacted image differs from the chain head")


def register(cli: click.Group) -> None:
    cli.add_command(demo)
