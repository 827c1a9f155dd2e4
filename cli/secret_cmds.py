"""`forkd secret`: credentials kept on the host and bound to egress destinations.

set, ls, rm. A value is read from stdin (or a hidden prompt on a terminal) and never
printed; a guest sees only the placeholder (docs/agents.md).
"""

from __future__ import annotations

import click

from forkd.cli.output import emit_json
from forkd.engine.egress.secrets import SecretStore


@click.group("secret")
def secret() -> None:
    """Credentials on the host, swapped in by the egress proxy for bound destinations."""


@secret.command("set")
@click.argument("name")
@click.option(
    "--bind",
    "bindings",
    multiple=True,
    required=True,
    metavar="HOST[:PORT]",
    help="A destination that gets the real value (repeatable; port default 443).",
)
def set_cmd(name: str, bindings: tuple[str, ...]) -> None:
    """Store secret NAME, read from stdin, bound to the --bind destinations.

    \b
    printenv OPENAI_API_KEY | forkd secret set OPENAI_API_KEY --bind api.openai.com
    Setting an existing NAME replaces its value and bindings and keeps its placeholder.
    """
    stdin = click.get_text_stream("stdin")
    if stdin.isatty():
        value = click.prompt(f"value of {name}", hide_input=True, err=True)
    else:
        value = stdin.read(64 << 10)
        value = value.removesuffix("\n").removesuffix("\r")
    stored = SecretStore().set(name, value, bindings)
    click.echo(f"secret {stored.name} stored, bound to {', '.join(map(str, stored.bindings))}")
    click.echo(f"a guest sees it as {stored.placeholder}")


@secret.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
def ls_cmd(as_json: bool) -> None:
    """List secrets: name, bindings and placeholder (never the value)."""
    shown = [
        {"name": s.name, "bindings": [str(b) for b in s.bindings], "placeholder": s.placeholder}
        for s in SecretStore().all()
    ]
    if as_json:
        emit_json(shown)
        return
    if not shown:
        click.echo("no secrets; add one with `forkd secret set NAME --bind HOST`", err=True)
    for s in shown:
        click.echo(f"{s['name']}\t{','.join(s['bindings'])}\t{s['placeholder']}")


@secret.command("rm")
@click.argument("name")
def rm_cmd(name: str) -> None:
    """Remove secret NAME from the host."""
    SecretStore().remove(name)
    click.echo(f"secret {name} removed")


def register(cli: click.Group) -> None:
    cli.add_command(secret)
