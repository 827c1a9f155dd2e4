"""`forkd demo`: the embedded default main job on synthetic images (no VM, no network), and
`forkd demo langgraph`: a LangGraph agent branched mid-reasoning (real VMs)."""

from __future__ import annotations

import filecmp
import tempfile
import time
from pathlib import Path

import click

from forkd import digest as dg
from forkd.cli.output import human
from forkd.errors import IntegrityError
from forkd.names import inert
from forkd.store.store import Store
from forkd.synthetic import write_base, write_diff

LAYERS = ("base", "plus-pandas", "plus-sklearn", "plus-agent")


@click.group(invoke_without_command=True)
@click.option(
    "--size-mib",
    default=256,
    show_default=True,
    type=click.IntRange(1, 8192),
    help="Size of the synthetic memory image.",
)
@click.option("--namespace", default="demo", show_default=True, help="Name prefix of the tags.")
@click.pass_context
def demo(ctx: click.Context, size_mib: int, namespace: str) -> None:
    """Import a synthetic base and three diff layers, show the chain, assemble, compact.

    With a subcommand, that demo instead (`forkd demo langgraph`)."""
    if ctx.invoked_subcommand is None:
        synthetic(size_mib, namespace)


def synthetic(size_mib: int, namespace: str) -> None:
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


@demo.command("langgraph")
@click.option("--tag", default="deeplethe/langgraph-react:latest", show_default=True,
              help="The langgraph-react snapshot (pulled from the default hub if missing).")
@click.option("--model-url", default=None, metavar="URL",
              help="An OpenAI-compatible https:// base URL (default: forkd's stand-in model); "
                   "its key is the host secret OPENAI_API_KEY bound to its host.")
@click.option("--model", "model_name", default="gpt-4o-mini", show_default=True,
              help="Model name sent with --model-url.")
def langgraph(tag: str, model_url: str | None, model_name: str) -> None:
    """Branch a LangGraph ReAct agent mid-reasoning; steer three grandchildren three ways."""
    from forkd.controller import langgraph_demo as lg

    store = Store.open()

    def say(message: str) -> None:
        click.echo(inert(message), err=True)

    if model_url is None:
        report = lg.run_standin(store, tag, say=say)
    else:
        report = lg.run(store, lg.real_endpoint(model_url, model_name), tag, say=say)
    click.echo("")
    for line in [*lg.summary(report), "", *lg.side_by_side(report)]:
        click.echo(inert(line))  # a model's answers and a guest's output: shown, not obeyed
    if report.problems:
        raise click.ClickException("the demo did not show what it should:\n  "
                                   + "\n  ".join(inert(p) for p in report.problems))


def register(cli: click.Group) -> None:
    from forkd.cli.demo_coding import coding_agent

    demo.add_command(coding_agent)  # `forkd demo coding-agent` (CODING's module)
    cli.add_command(demo)
