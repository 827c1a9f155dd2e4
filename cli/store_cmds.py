"""`forkd` commands of the local store.

import, images, inspect, assemble, export, compact, rmi, gc.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import click

from forkd import digest as dg
from forkd.cli.output import emit_json, human, progress_bar
from forkd.errors import IntegrityError, InvalidInput
from forkd.store.packfile import export_pack, import_pack
from forkd.store.store import LayerInfo, Store

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
existing_file = click.Path(exists=True, dir_okay=False, path_type=Path)


def _store() -> Store:
    return Store.open()


def _print_layer(info: LayerInfo, verb: str, as_json: bool, seconds: float) -> None:
    if as_json:
        emit_json({**asdict(info), "seconds": round(seconds, 3)})
        return
    kind = (
        "flat (auto-compacted)"
        if info.compacted and verb == "imported"
        else ("flat" if info.depth == 0 else f"diff, depth {info.depth}")
    )
    click.echo(
        f"{verb} {info.ref} {dg.short(info.digest)}: {kind}, "
        f"{info.new_pages} pages, {human(info.stored_bytes)} stored "
        f"for {human(info.memory_size)} of memory ({seconds:.2f} s)"
    )


@click.command("import")
@click.option("--tag", "-t", help="Tag of the new layer, NAME[:TAG].")
@click.option("--memory", type=existing_file, help="Raw guest memory image.")
@click.option("--vmstate", type=existing_file, help="Device state saved by the VMM.")
@click.option("--disk", type=existing_file, help="Raw root disk image.")
@click.option("--parent", "-p", help="Tag of the parent: store only pages that differ from it.")
@click.option(
    "--pack",
    "pack",
    type=existing_file,
    help="Import a pack file (from `forkd export`) instead of raw files.",
)
@click.option("--description", default="", help="One line describing the snapshot.")
@click.option("--force", is_flag=True, help="Replace the tag if it exists.")
@json_option
def import_cmd(
    tag: str | None,
    memory: Path | None,
    vmstate: Path | None,
    disk: Path | None,
    parent: str | None,
    pack: Path | None,
    description: str,
    force: bool,
    as_json: bool,
) -> None:
    """Make a layer from raw files, or import a pack file.

    \b
    forkd import --tag base --memory mem.img [--vmstate state] [--disk root.img]
    forkd import --tag +pandas --memory mem2.img --parent base
    forkd import --pack base.pack
    """
    store = _store()
    start = time.perf_counter()
    if pack is not None:
        if memory or vmstate or disk or parent or tag:
            raise InvalidInput(
                "--pack imports a whole pack: drop --tag/--memory/--vmstate/--disk/--parent"
            )
        with progress_bar(f"importing {pack.name}", pack.stat().st_size) as advance:
            result = import_pack(store, pack, force=force, progress=advance)
        if as_json:
            emit_json({**asdict(result), "seconds": round(time.perf_counter() - start, 3)})
        else:
            click.echo(
                f"imported {result.head} ({len(result.tags)} tags, {result.blobs} chunks verified)"
            )
            for name in result.skipped_tags:
                click.echo(f"  kept the local tag {name}: it points at other content", err=True)
        return
    if not tag or not memory:
        raise InvalidInput("forkd import needs --tag and --memory (or --pack FILE)")
    with progress_bar(f"importing {memory.name}", memory.stat().st_size * (1 + bool(disk))) as adv:
        info = store.import_layer(
            tag,
            memory=memory,
            vmstate=vmstate,
            disk=disk,
            parent=parent,
            description=description,
            force=force,
            progress=adv,
        )
    _print_layer(info, "imported", as_json, time.perf_counter() - start)


@click.command()
@json_option
def images(as_json: bool) -> None:
    """List tags with chain depth, logical size and stored size."""
    rows = _store().images()
    if as_json:
        emit_json([asdict(r) for r in rows])
        return
    if not rows:
        click.echo("no images yet; `forkd import --tag NAME --memory FILE` makes one")
        return
    click.echo(f"{'TAG':<32} {'DIGEST':<12} {'DEPTH':>5} {'LOGICAL':>10} {'STORED':>10}")
    for r in rows:
        click.echo(
            f"{r.ref:<32} {dg.short(r.digest):<12} {r.depth:>5} "
            f"{human(r.memory_size):>10} {human(r.stored_bytes):>10}"
        )


@click.command()
@click.argument("tag")
@json_option
def inspect(tag: str, as_json: bool) -> None:
    """Show a tag's config, layers, chain, logical vs stored bytes and dedup."""
    data = _store().inspect(tag)
    if as_json:
        emit_json(data)
        return
    cfg = data["config"]
    click.echo(f"{data['ref']}  {data['digest']}")
    click.echo(
        f"  depth {cfg['depth']}, memory {human(cfg['memory_size'])}, "
        f"disk {human(cfg['disk_size'])}, created {cfg['created_at']}"
    )
    if cfg.get("compacted_from"):
        p = cfg["compacted_from"]
        click.echo(
            f"  compacted from {p['from_tag']}@{dg.short(p['from_digest'])} "
            f"(depth {p['from_depth']}, {p['reason']})"
        )
    if cfg.get("compat"):
        c = cfg["compat"]
        click.echo(
            f"  compat: {c['vmm']} {c['vmm_version']}, {c['machine']}, cpu {c['cpu_model']},"
            f" {c['vcpus']} vCPU, {c['memory_mib']} MiB, accel {','.join(c['accelerators'])}"
        )
    click.echo("  chain (head first):")
    for link in data["chain"]:
        click.echo(
            f"    {link['position']}: {link['tag']:<28} {dg.short(link['digest'])} "
            f"depth {link['depth']}, {human(link['stored_bytes'])} stored"
        )
    click.echo(f"  layers of the head: {len(data['layers'])} blobs")
    click.echo(
        f"  logical {human(data['logical_bytes'])}, stored {human(data['stored_bytes'])} "
        f"for the whole chain, dedup {data['dedup_ratio']}x"
    )
    click.echo("  bytes per component (whole chain; stored = compressed, as pushed and pulled):")
    for name, c in data["components"].items():
        if not c["blobs"]:
            click.echo(f"    {name:<8} not in this pack")
            continue
        click.echo(
            f"    {name:<8} stored {human(c['stored_bytes']):>10}  logical "
            f"{human(c['logical_bytes']):>10}  data {human(c['data_bytes']):>10}  "
            f"{c['blobs']} blobs"
        )


@click.command()
@click.argument("tag")
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the memory image.",
)
@click.option(
    "--disk-out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also write the disk image here.",
)
@json_option
def assemble(tag: str, out: Path, disk_out: Path | None, as_json: bool) -> None:
    """Write the chain head's full memory image (uses and fills the assembled-image cache)."""
    store = _store()
    start = time.perf_counter()
    with progress_bar(f"assembling {tag}", None) as advance:
        asm = store.assemble(tag, progress=advance)
    for src, dst in ((asm.memory, out), (asm.disk, disk_out)):
        if dst is None:
            continue
        if src is None:
            raise InvalidInput(f"{tag} has no disk image")
        _copy_sparse(src, dst)
    seconds = time.perf_counter() - start
    if as_json:
        emit_json(
            {
                "digest": asm.digest,
                "memory": str(out),
                "cache": str(asm.memory),
                "seconds": round(seconds, 3),
            }
        )
    else:
        click.echo(f"wrote {out} ({human(asm.config.memory_size)}) in {seconds:.2f} s")


def _copy_sparse(src: Path, dst: Path) -> None:
    """Copy a cached image, keeping holes, via a temp file renamed into place."""
    tmp = dst.with_name(f".{dst.name}.partial")
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            size = os.fstat(fin.fileno()).st_size
            fout.truncate(size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(fin.fileno(), pos, os.SEEK_DATA)
                except OSError:
                    break
                end = os.lseek(fin.fileno(), start, os.SEEK_HOLE)
                fin.seek(start)
                fout.seek(start)
                remaining = end - start
                while remaining:
                    block = fin.read(min(remaining, 8 << 20))
                    fout.write(block)
                    remaining -= len(block)
                pos = end
        tmp.replace(dst)
    finally:
        tmp.unlink(missing_ok=True)


@click.command()
@click.argument("tag")
@click.option(
    "--out",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Pack file to write (an OCI image-layout tar).",
)
@json_option
def export(tag: str, out: Path, as_json: bool) -> None:
    """Write TAG and its ancestors as one pack file."""
    store = _store()
    with progress_bar(f"exporting {tag}", None) as advance:
        size = export_pack(store, tag, out, progress=advance)
    if as_json:
        emit_json({"tag": tag, "out": str(out), "blob_bytes": size})
    else:
        click.echo(f"wrote {out} ({human(size)} of blobs)")


@click.command()
@click.argument("tag")
@click.option("--to", "to", required=True, help="Tag of the new flat layer.")
@click.option("--force", is_flag=True, help="Replace the target tag if it exists.")
@click.option(
    "--remote",
    is_flag=True,
    help="TAG is [HUB/]NS/NAME:TAG on a forkd hub (no HUB: the default hub, $FORKD_HUB or "
    "`forkd config set hub`): compact there, from the blobs the hub holds (nothing is "
    "uploaded); TO is a tag in the same repository.",
)
@json_option
def compact(tag: str, to: str, force: bool, remote: bool, as_json: bool) -> None:
    """Flatten TAG's chain into one layer tagged TO (same bytes, provenance recorded)."""
    start = time.perf_counter()
    if remote:
        _compact_remote(tag, to, force, as_json, start)
        return
    info = _store().compact(tag, to, force=force)
    _print_layer(info, "compacted into", as_json, time.perf_counter() - start)


def _compact_remote(tag: str, to: str, force: bool, as_json: bool, start: float) -> None:
    from forkd.registry import credentials
    from forkd.registry.client import RegistryClient
    from forkd.registry.compaction import compact_remote
    from forkd.registry.reference import parse_remote

    ref = parse_remote(tag)
    with RegistryClient(ref.hub, credentials.load(ref.hub.host)) as client:
        result = compact_remote(
            client, ref.name, ref.tag, to, force,
            on_busy=lambda s: click.echo(
                f"the hub is running its limit of compactions; asking again in {s:.0f} s",
                err=True,
            ),
        )
    seconds = time.perf_counter() - start
    if as_json:
        emit_json({**result, "seconds": round(seconds, 3)})
        return
    source = result["compacted_from"]
    click.echo(
        f"compacted {ref} (depth {source['from_depth']}) into {ref.hub}/{ref.name}:{to} "
        f"{dg.short(result['digest'])} on the hub: flat, {human(result['stored_bytes'])} "
        f"stored, {result['new_blobs']} new blobs ({human(result['new_bytes'])}), "
        f"nothing uploaded ({seconds:.2f} s)"
    )


@click.command()
@click.argument("tags", nargs=-1, required=True)
@click.option("--cascade", is_flag=True, help="Also remove the tags that depend on TAG.")
@json_option
def rmi(tags: tuple[str, ...], cascade: bool, as_json: bool) -> None:
    """Remove tags (refused while other tags depend on one, unless --cascade)."""
    from forkd.engine.children import refuse_saved_state  # the engine, only when removing

    store = _store()
    removed: list[str] = []
    for tag in tags:  # never a sandbox's saved state: its resume needs it
        removed.extend(store.remove(tag, cascade=cascade, refuse=refuse_saved_state))
    if as_json:
        emit_json({"removed": removed})
    else:
        for name in removed:
            click.echo(f"removed {name}")
        click.echo("run `forkd gc` to free the space")


@click.command()
@json_option
def gc(as_json: bool) -> None:
    """Delete blobs and cached images that no tag reaches."""
    count, freed = _store().gc()
    if as_json:
        emit_json({"blobs_removed": count, "bytes_freed": freed})
    else:
        click.echo(f"removed {count} blobs, freed {human(freed)}")


@click.command("tag")
@click.argument("source")
@click.argument("target")
@click.option("--force", is_flag=True, help="Replace TARGET if it exists.")
def tag_cmd(source: str, target: str, force: bool) -> None:
    """Give the snapshot SOURCE (a tag or a sha256 digest) another tag TARGET."""
    digest = _store().tag(target, source, force=force)
    click.echo(f"tagged {dg.short(digest)} as {target}")


@click.command()
@json_option
def verify(as_json: bool) -> None:
    """Re-check every blob's digest and every tag's chain; exit 4 when anything is damaged."""
    problems = _store().verify()
    if as_json:
        emit_json({"ok": not problems, "problems": problems})
    else:
        for problem in problems:
            click.echo(problem)
        click.echo("store is intact" if not problems else f"{len(problems)} problems found")
    if problems:
        raise SystemExit(IntegrityError.exit_code)


def register(cli: click.Group) -> None:
    for command in (
        import_cmd,
        images,
        inspect,
        assemble,
        export,
        compact,
        rmi,
        gc,
        verify,
        tag_cmd,
    ):
        cli.add_command(command)
