"""`forkd demo coding-agent` (the logic is forkd.controller.coding_demo)."""

from __future__ import annotations

from dataclasses import asdict

import click

from forkd.cli.output import emit_json
from forkd.names import inert


@click.command("coding-agent")
@click.option(
    "--tag",
    default="deeplethe/coding-agent:latest",
    show_default=True,
    help="Snapshot of recipes/coding-agent (pulled from the default hub if not here).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def coding_agent(tag: str, as_json: bool) -> None:
    """Fork a coding sandbox, branch it, let three grandchildren try three fixes."""
    from forkd.controller import coding_demo
    from forkd.store.store import Store

    report = coding_demo.run(Store.open(), tag, say=lambda m: click.echo(inert(m), err=True))
    if as_json:
        emit_json(asdict(report))
    else:
        click.echo("")
        for line in coding_demo.table(report):  # guest output in it: shown, not obeyed
            click.echo(inert(line))
        click.echo(
            f"\nbranch pause {report.branch_pause_ms:.1f} ms, branch {report.branch_ms:.0f} ms, "
            f"whole demo {report.seconds:.1f} s"
        )
        for problem in report.problems:
            click.echo(f"PROBLEM: {inert(problem)}", err=True)
    if report.problems:
        raise click.ClickException(f"{len(report.problems)} isolation check(s) failed (above)")
