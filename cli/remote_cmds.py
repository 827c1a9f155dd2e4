"""`forkd login/logout/push/pull/config`: talk to a hub or any OCI registry."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path

import click

from forkd.cli.output import emit_json, human, progress_bar
from forkd.errors import InvalidInput
from forkd.registry import credentials
from forkd.registry.client import RegistryClient, RegistryNotFound
from forkd.registry.readme import read_readme, set_readme
from forkd.registry.reference import (
    SET_HUB_HINT,
    Hub,
    RemoteRef,
    parse_hub,
    parse_remote,
    resolve_default_hub,
    set_default_hub,
)
from forkd.registry.transfer import TransferResult, pull, push
from forkd.store.store import Store

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def _client(hub_text: str | None, remote_text: str) -> tuple[RegistryClient, RemoteRef]:
    remote = parse_remote(remote_text, parse_hub(hub_text) if hub_text else None)
    return RegistryClient(remote.hub, credentials.load(remote.hub.host)), remote


def _report(result: TransferResult, verb: str, seconds: float, as_json: bool) -> None:
    if as_json:
        emit_json({**asdict(result), "seconds": round(seconds, 3)})
        return
    click.echo(
        f"{verb} {result.ref} ({result.layers} layers): {result.blobs_sent} blobs, "
        f"{human(result.bytes_sent)} transferred, {result.blobs_skipped} already there "
        f"({seconds:.2f} s)"
    )


@click.command()
@click.argument("hub")
@click.option("--username", "-u", prompt=True, help="User or robot name.")
@click.option("--password-stdin", is_flag=True, help="Read the password or token from stdin.")
@click.option(
    "--default",
    "make_default",
    is_flag=True,
    help="Also make HUB the default hub (replaces the configured one). Without it, and "
    "when no default hub is set, a terminal asks.",
)
def login(hub: str, username: str, password_stdin: bool, make_default: bool) -> None:
    """Check credentials against HUB and store them (mode 0600) for push and pull."""
    target = parse_hub(hub)
    if password_stdin:
        secret = sys.stdin.readline().rstrip("\n")
    else:
        secret = click.prompt("Password", hide_input=True)
    if not secret:
        raise InvalidInput("empty password; pass it on stdin with --password-stdin")
    cred = credentials.Credential(username, secret, target.scheme)
    with RegistryClient(target, cred) as client:
        client.ping()
    path = credentials.save(target.host, cred)
    click.echo(f"logged in to {target.host} as {username} (credentials in {path})")
    _offer_default(target, make_default)


def _offer_default(target: Hub, make_default: bool) -> None:
    """``--default`` sets it; with no default hub set, a terminal is asked; else a hint."""
    if not make_default:
        if resolve_default_hub() is not None:
            return
        question = f"no default hub is set: make {target.address} the default for pull and push?"
        if not sys.stdin.isatty():
            click.echo(f"no default hub is set; `forkd login {target.address} --default` or "
                       f"{SET_HUB_HINT} makes one", err=True)
            return
        if not click.confirm(question, default=True):
            return
    _store_default(target)


def _store_default(target: Hub) -> None:
    path = set_default_hub(target)
    click.echo(f"default hub: {target.address} (in {path})")
    chosen = resolve_default_hub()
    if chosen is not None and chosen.hub != target:
        click.echo(f"note: {chosen.source} names {chosen.hub.address}, which takes precedence "
                   "while it is set", err=True)


@click.command()
@click.argument("hub")
def logout(hub: str) -> None:
    """Forget the stored credentials of HUB."""
    target = parse_hub(hub)
    if credentials.forget(target.host):
        click.echo(f"logged out of {target.host}")
    else:
        click.echo(f"no credentials stored for {target.host}")


@click.command("push")
@click.argument("tag")
@click.argument("remote")
@click.option(
    "--hub", help="Hub to use when REMOTE names none (default: the default hub, forkd config)."
)
@click.option(
    "--readme",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Markdown file to publish as the pack's README (forkd hub only).",
)
@click.option("--description", help="One-line description shown in the catalog (forkd hub only).")
@click.option(
    "--access-order",
    is_flag=True,
    help="Record the working set (the pages a child of TAG touches up to its first answer, "
    "and the order a lazy child needs its chunks in) and publish it with the pack, so the "
    "first lazy fork on any host prefetches it. TAG's memory chunks are split by those "
    "pages first: the same image as a new layer, which TAG then names "
    '(docs/engine.md, "Lazy fork").',
)
@json_option
def push_cmd(
    tag: str,
    remote: str,
    hub: str | None,
    readme: Path | None,
    description: str | None,
    access_order: bool,
    as_json: bool,
) -> None:
    """Push local TAG with its ancestors to [HUB/]NS/NAME[:TAG]; only missing blobs are sent.

    REMOTE is always remote: without a HUB it names the default hub ($FORKD_HUB, else
    `forkd config set hub`)."""
    client, ref = _client(hub, remote)
    text = read_readme(readme) if readme else None  # bad input fails before any upload
    store = Store.open()
    start = time.perf_counter()
    if access_order:
        from forkd.engine.lazy import record

        before = store.resolve(tag)
        after = record.split_working_set(store, tag)
        if after != before:
            click.echo(f"split {tag}'s memory chunks by its working set: {before} → {after} "
                       "(the same image; the tag names the new layer)", err=True)
    with client, progress_bar(f"pushing {tag}", None) as advance:
        result = push(store, tag, ref, client, progress=advance)
        if text is not None or description is not None:
            set_readme(client, ref.name, text, description)
        if access_order:
            record.publish_order(store, tag, client, ref.name)
    _report(result, "pushed", time.perf_counter() - start, as_json)


@click.command("pull")
@click.argument("remote")
@click.option(
    "--hub", help="Hub to use when REMOTE names none (default: the default hub, forkd config)."
)
@click.option("--tag", "local", help="Local tag (default: NS/NAME:TAG as pulled).")
@click.option("--force", is_flag=True, help="Replace the local tag if it points at other content.")
@json_option
def pull_cmd(remote: str, hub: str | None, local: str | None, force: bool, as_json: bool) -> None:
    """Pull [HUB/]NS/NAME[:TAG] with its whole chain; every blob is verified before tagging.

    REMOTE is always remote: without a HUB it names the default hub ($FORKD_HUB, else
    `forkd config set hub`). A local tag that already names other content is kept unless
    --force (re-pulling the same content is fine)."""
    client, ref = _client(hub, remote)
    store = Store.open()
    start = time.perf_counter()
    with client, progress_bar(f"pulling {remote}", None) as advance:
        try:
            result = pull(store, ref, client, local, progress=advance, force=force)
        except RegistryNotFound as exc:
            from forkd.controller.bundles_job import pending_hint

            hint = pending_hint(store.home / "quickstart", ref.name)
            if hint is None:
                raise
            raise RegistryNotFound(f"{exc}; {hint}") from exc
    problems = _host_problems(store, result.digest)
    if as_json:
        emit_json(
            {
                **asdict(result),
                "seconds": round(time.perf_counter() - start, 3),
                "host_problems": problems,
            }
        )
        return
    _report(result, "pulled", time.perf_counter() - start, False)
    for problem in problems:
        click.echo(f"warning: this host cannot fork {result.ref}: {problem}", err=True)


def _host_problems(store: Store, digest: str) -> list[str]:
    """The pulled snapshot's compat metadata against this host (empty when it can fork it)."""
    from forkd.engine.accel import cached_probe
    from forkd.engine.children import host_problems
    from forkd.errors import ForkdError

    compat = store.config(digest).compat
    if compat is None:
        return []  # not a VM snapshot (a synthetic pack): nothing to check
    try:
        return host_problems(compat, cached_probe())
    except ForkdError as exc:  # no QEMU here, for example
        return [str(exc)]


CONFIG_KEYS = click.Choice(["hub"])


@click.group("config")
def config() -> None:
    """The client config (next to the credentials): `hub` is the default hub, used by
    pull, push and compact --remote when a reference names none. $FORKD_HUB beats it."""


@config.command("set")
@click.argument("key", type=CONFIG_KEYS)
@click.argument("value")
def config_set(key: str, value: str) -> None:
    """Set KEY to VALUE: `forkd config set hub HOST[:PORT]` (http:// or https:// allowed)."""
    _store_default(parse_hub(value))


@config.command("get")
@click.argument("key", type=CONFIG_KEYS)
@json_option
def config_get(key: str, as_json: bool) -> None:
    """Print KEY's value in effect and where it comes from ($FORKD_HUB or the config file)."""
    chosen = resolve_default_hub()
    if as_json:
        emit_json(
            {"hub": chosen.hub.address, "url": chosen.hub.url, "source": chosen.source}
            if chosen
            else {"hub": None, "url": None, "source": None}
        )
        return
    if chosen is None:
        click.echo(f"no default hub: export FORKD_HUB=HOST[:PORT] or run {SET_HUB_HINT}")
        sys.exit(1)
    click.echo(f"{chosen.hub.address} (from {chosen.source})")


@config.command("unset")
@click.argument("key", type=CONFIG_KEYS)
def config_unset(key: str) -> None:
    """Remove KEY from the config file ($FORKD_HUB, when set, still applies)."""
    if credentials.forget_default_hub():
        click.echo(f"default hub removed from {credentials.config_path()}")
    else:
        click.echo("no default hub was configured")


def register(cli: click.Group) -> None:
    for command in (login, logout, push_cmd, pull_cmd, config):
        cli.add_command(command)
