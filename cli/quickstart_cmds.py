"""`forkd quickstart` (the main job end to end) and `forkd setup` (host prerequisites only)."""

from __future__ import annotations

import time
from dataclasses import asdict
from importlib import resources
from pathlib import Path

import click

from forkd.cli.output import emit_json
from forkd.names import inert


def bundled_recipe(name: str) -> Path:
    path = Path(str(resources.files("forkd.recipes").joinpath(f"{name}.toml")))
    if not path.is_file():
        raise click.BadParameter(f"no bundled recipe {name!r}; pass --recipe FILE")
    return path


@click.command()
@click.option("--yes", "-y", is_flag=True, help="Install missing host packages without asking.")
def setup(yes: bool) -> None:
    """Install the Debian packages the engine needs (QEMU, qemu-img, debootstrap, …)."""
    from forkd.controller.quickstart import install_packages, missing_prerequisites

    missing = missing_prerequisites()
    if not missing:
        click.echo("host prerequisites are present")
        return
    if not yes:
        click.confirm(f"install {' '.join(missing)} with apt-get?", abort=True)
    install_packages(missing, lambda m: click.echo(m, err=True))
    click.echo(f"installed {' '.join(missing)}")


@click.command()
@click.option("--yes", "-y", is_flag=True, help="Install missing host packages without asking.")
@click.option(
    "--recipe",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Recipe of the base (default: the bundled python-numpy recipe).",
)
@click.option("-n", "count", type=int, default=10, show_default=True, help="Children to fork.")
@click.option(
    "--eval",
    "code",
    default="import numpy; numpy.zeros(5).tolist()",
    show_default=True,
    help="Code to evaluate in every child.",
)
@click.option("--keep", is_flag=True, help="Leave the children running (forkd ls, forkd kill).")
@click.option(
    "--bundle",
    "bundles",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Publish this recipe as deeplethe/NAME instead of the bundled packs; repeatable.",
)
@click.option(
    "--wait",
    "wait_bundles",
    is_flag=True,
    help="Build and publish the bundled packs before returning, waiting first for a "
    "background job an earlier run started (default: in the background when some need a "
    "build; a later run returns without waiting for that job).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def quickstart(
    yes: bool,
    recipe: Path | None,
    count: int,
    code: str,
    keep: bool,
    bundles: tuple[Path, ...],
    wait_bundles: bool,
    as_json: bool,
) -> None:
    """From a fresh machine to N warm forks: prerequisites, hub, build, push, pull, fork, eval."""
    from forkd.controller.quickstart import run

    start = time.perf_counter()
    report = run(
        recipe_path=recipe or bundled_recipe("python-numpy"),
        n=count,
        code=code,
        yes=yes,
        keep=keep,
        confirm=lambda q: click.confirm(q, default=True),
        say=lambda m: click.echo(inert(m), err=True),
        bundled=list(bundles) or None,
        wait_bundles=wait_bundles,
    )
    if as_json:
        emit_json(asdict(report))
        return
    click.echo(
        f"\nforked {len(report.children)} children of {report.tag} in {report.fork_ms:.0f} ms:"
    )
    click.echo(f"  {'CHILD':<28} {'READY ms':>9} {'EVAL ms':>8}  VALUE")
    for c in report.children:
        click.echo(f"  {c.id:<28} {c.ready_ms:>9.0f} {c.eval_ms:>8.1f}  {c.value!r}")
    click.echo(f"\ncatalog: {report.catalog_url}")
    if report.bundled:
        click.echo("bundled packs (forkd pull NS/NAME, then forkd fork NS/NAME -n 3):")
    if report.bundles_log:
        click.echo(
            "bundled packs (deeplethe/…): being built and published in the background; "
            f"follow {report.bundles_log}, or run `forkd quickstart --wait` to wait for them"
        )
    for b in report.bundled:
        what = "built" if b.built else "cached"
        sent = f"pushed {b.push_blobs} blobs" if b.pushed else "nothing pushed (on the hub)"
        click.echo(f"  {b.repository:<28} {what} in {b.build_s:6.1f} s, {sent}")
    click.echo(
        f"done in {time.perf_counter() - start:.1f} s"
        + (" (children kept: forkd ls)" if keep else "")
    )


def register(cli: click.Group) -> None:
    cli.add_command(setup)
    cli.add_command(quickstart)
