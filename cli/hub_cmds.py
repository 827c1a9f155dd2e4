"""`forkd hub …`: serve, migrate, shell administration (registered by forkd.cli.main)."""

from __future__ import annotations

import asyncio
import secrets
import sys
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import click
from click.core import ParameterSource
from sqlalchemy.ext.asyncio import AsyncSession

from forkd.cli.errors import ForkdGroup
from forkd.names import one_line

T = TypeVar("T")

data_option = click.option(
    "--data",
    "data_dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="FORKD_HUB_DATA",
    default="./hub-data",
    show_default=True,
    help="Data directory: SQLite database, blobs, uploads (env FORKD_HUB_DATA).",
)
CONFIG_KEY = "forkd.hub.config"
database_url_option = click.option(
    "--database-url",
    envvar="FORKD_HUB_DATABASE_URL",
    default="",
    help="postgresql://USER:PASS@HOST/DB (default: SQLite in the data directory).",
)


def _remember_config(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    ctx.meta[CONFIG_KEY] = value


config_option = click.option(
    "--config",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    envvar="FORKD_HUB_CONFIG",
    expose_value=False,
    callback=_remember_config,
    help="TOML file of hub settings; options and FORKD_HUB_* variables override it.",
)


def db_option(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--database-url`` and ``--config`` (every command reaches the same database)."""
    return config_option(database_url_option(f))


def _given(name: str) -> bool:
    """Whether option ``name`` came from the command line or the environment."""
    source = click.get_current_context().get_parameter_source(name)
    return source is not None and source is not ParameterSource.DEFAULT


def _settings(data_dir: Path, database_url: str, **extra: Any) -> Any:
    """Settings: defaults ← --config file ← FORKD_HUB_* environment ← options given."""
    from forkd.hub.settings import HubSettings, load_config

    config = click.get_current_context().meta.get(CONFIG_KEY)
    return HubSettings.from_env(
        data_dir if _given("data_dir") else None,
        base=load_config(config) if config else None,
        database_url=database_url or None,
        **extra,
    )


def blob_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--blob-backend`` and the S3 options (``serve`` and ``gc`` reach the same blobs)."""
    options = [
        click.option(
            "--blob-backend",
            type=click.Choice(["fs", "s3"]),
            default=None,
            help="Where blobs live: fs (DATA/blobs, default) or s3 (env FORKD_HUB_BLOB_BACKEND).",
        ),
        click.option("--s3-bucket", default=None, help="S3 bucket (env FORKD_HUB_S3_BUCKET)."),
        click.option(
            "--s3-endpoint",
            "s3_endpoint_url",
            default=None,
            help="S3 endpoint URL for MinIO, Ceph, … (default AWS; env FORKD_HUB_S3_ENDPOINT_URL).",
        ),
        click.option("--s3-region", default=None, help="S3 region (env FORKD_HUB_S3_REGION)."),
        click.option(
            "--s3-prefix", default=None, help="Key prefix in the bucket (env FORKD_HUB_S3_PREFIX)."
        ),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def _admin(data_dir: Path, database_url: str, op: Callable[[AsyncSession], Awaitable[T]]) -> T:
    """Run one administrative operation in a transaction, after migrating the schema."""
    from forkd.hub.db import Database

    settings = _settings(data_dir, database_url)

    async def go() -> T:
        db = Database(settings.database_url)
        try:
            await db.migrate()
            async with db.transaction() as session:
                return await op(session)
        finally:
            await db.close()

    return asyncio.run(go())


@click.group("hub", cls=ForkdGroup)
def hub() -> None:
    """Run and administer the hub (OCI registry for packs)."""


@hub.command("serve")
@data_option
@db_option
@click.option("--listen", default="127.0.0.1:5000", show_default=True, help="HOST:PORT to bind.")
@click.option(
    "--public-url",
    envvar="FORKD_HUB_PUBLIC_URL",
    default="",
    help="Base URL clients use (token realm); default: from each request.",
)
@click.option(
    "--workers",
    type=int,
    default=1,
    show_default=True,
    help="Processes sharing the socket (one per core helps small requests; see docs/hub.md).",
)
@blob_options
def serve(
    data_dir: Path,
    database_url: str,
    listen: str,
    public_url: str,
    workers: int,
    **blob: str | None,
) -> None:
    """Serve the hub; migrations are applied on start."""
    import uvicorn

    from forkd.hub import workers as prefork
    from forkd.hub.settings import parse_listen

    host, port = parse_listen(listen) if _given("listen") else (None, None)
    settings = _settings(
        data_dir, database_url, host=host, port=port, public_url=public_url or None, **blob
    )
    prefork.check(settings, workers)
    if workers > 1:
        prefork.serve(settings, workers)
        return
    prefork.prepare(settings)  # a refused start says why here, not in a lifespan traceback
    uvicorn.Server(prefork.server_config(settings)).run()


@hub.command("migrate")
@data_option
@db_option
@click.option("--revision", default="head", show_default=True)
def migrate(data_dir: Path, database_url: str, revision: str) -> None:
    """Apply the database migrations (Alembic) up to REVISION."""
    from forkd.hub.db import run_migrations

    run_migrations(_settings(data_dir, database_url).database_url, revision)
    click.echo(f"database at revision {revision}")


@hub.command("gc")
@data_option
@db_option
@click.option(
    "--grace-minutes",
    type=click.IntRange(min=0),
    default=60,
    show_default=True,
    help="Spare blobs stored or linked more recently than this.",
)
@click.option(
    "--upload-ttl-hours",
    type=click.IntRange(min=0),
    default=None,
    help="Drop upload sessions idle for longer than this [default: the hub's "
    "upload_idle_timeout, 1 h].",
)
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
@click.option(
    "--retention",
    "with_retention",
    is_flag=True,
    help="First delete the tags the retention rules of the config file no longer keep.",
)
@blob_options
def gc(
    data_dir: Path,
    database_url: str,
    grace_minutes: int,
    upload_ttl_hours: int | None,
    dry_run: bool,
    with_retention: bool,
    **blob: str | None,
) -> None:
    """Remove blobs no manifest references, orphan files and stale uploads (safe while
    the hub serves: pushes in flight keep their blobs)."""
    from forkd.errors import InvalidInput
    from forkd.hub import retention
    from forkd.hub.gc import collect
    from forkd.hub.services import Hub

    settings = _settings(data_dir, database_url, **blob)
    if with_retention and not settings.retention:
        raise InvalidInput(
            "--retention: no retention rules configured; add [[retention]] tables to the "
            "--config file"
        )

    async def go() -> Any:
        hub_ = Hub.build(settings)
        try:
            await hub_.db.migrate()
            if with_retention:
                kept = await retention.sweep(
                    hub_.db, settings.retention, hub_.audit, dry_run=dry_run
                )
                verb = "would delete" if dry_run else "deleted"
                click.echo(
                    f"retention: {verb} {len(kept.tags)} tags"
                    + (f" ({', '.join(kept.tags)})" if kept.tags else "")
                    + f", {len(kept.manifests)} untagged manifests; "
                    f"{len(kept.protected)} tags kept as parents of kept tags"
                )
            report = await collect(
                hub_.db,
                hub_.blobs,
                hub_.uploads,
                grace=timedelta(minutes=grace_minutes),
                upload_ttl=timedelta(hours=upload_ttl_hours)
                if upload_ttl_hours is not None
                else timedelta(seconds=settings.upload_idle_timeout),
                dry_run=dry_run,
                shared=hub_.shared,
            )
            if not dry_run:
                hub_.audit.record(
                    "-",
                    "cli",
                    "gc",
                    "-",
                    "ok",
                    blobs=len(report.blobs),
                    bytes=report.bytes,
                    orphans=len(report.orphan_files),
                    uploads=len(report.uploads),
                )
            return report
        finally:
            await hub_.close()

    report = asyncio.run(go())
    verb = "would remove" if dry_run else "removed"
    click.echo(
        f"{verb} {len(report.blobs)} blobs ({report.bytes} bytes), "
        f"{len(report.orphan_files)} orphan files, {len(report.uploads)} stale uploads, "
        f"{len(report.temp_files)} temporary files"
    )


@hub.group("user")
def user() -> None:
    """Manage users."""


@user.command("add")
@data_option
@db_option
@click.argument("name")
@click.option("--admin", is_flag=True, help="Site administrator (every action everywhere).")
@click.option("--robot", is_flag=True, help="Robot account: no password, API tokens only.")
@click.option("--password-stdin", is_flag=True, help="Read the password from standard input.")
def user_add(
    data_dir: Path, database_url: str, name: str, admin: bool, robot: bool, password_stdin: bool
) -> None:
    """Create user NAME (with a personal namespace NAME unless --robot)."""
    from forkd.hub import accounts

    password: str | None = None
    generated = False
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    elif not robot:
        password, generated = secrets.token_urlsafe(18), True

    async def op(session: AsyncSession) -> None:
        await accounts.create_user(session, name, password, admin=admin, robot=robot)

    _admin(data_dir, database_url, op)
    click.echo(f"created {'robot' if robot else 'user'} {name}")
    if generated:
        click.echo(f"password: {password}")


@user.command("list")
@data_option
@db_option
def user_list(data_dir: Path, database_url: str) -> None:
    """List users and robots."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> list[str]:
        return [
            f"{u.name}\t{'robot' if u.is_robot else 'admin' if u.is_admin else 'user'}\t"
            f"{u.created_at:%Y-%m-%d %H:%M}"
            for u in await accounts.list_users(session)
        ]

    for line in _admin(data_dir, database_url, op):
        click.echo(line)


@user.command("remove")
@data_option
@db_option
@click.argument("name")
def user_remove(data_dir: Path, database_url: str, name: str) -> None:
    """Remove user NAME, their memberships and tokens (their repositories stay)."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.remove_user(session, name)

    _admin(data_dir, database_url, op)
    click.echo(f"removed user {name}")


@user.command("passwd")
@data_option
@db_option
@click.argument("name")
@click.option("--password-stdin", is_flag=True, help="Read the new password from standard input.")
def user_passwd(data_dir: Path, database_url: str, name: str, password_stdin: bool) -> None:
    """Give user NAME a new password (generated unless --password-stdin). Every session
    and bearer token of NAME ends; their API tokens keep working (revoke those apart)."""
    from forkd.hub import accounts

    generated = not password_stdin
    password = secrets.token_urlsafe(18) if generated else sys.stdin.readline().rstrip("\r\n")
    hashed = accounts.hash_password(password)

    async def op(session: AsyncSession) -> None:
        await accounts.set_password(session, name, hashed)

    _admin(data_dir, database_url, op)
    click.echo(f"new password set for {name}; their sessions have ended")
    if generated:
        click.echo(f"password: {password}")


@hub.group("token")
def token() -> None:
    """Manage API tokens."""


@token.command("create")
@data_option
@db_option
@click.option("--user", "username", required=True, help="User or robot the token acts as.")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    required=True,
    help="NAMESPACE:pull|push|admin ('*' for any namespace); repeatable.",
)
@click.option("--name", default="cli", show_default=True, help="Label for the token.")
@click.option("--expires-days", type=click.IntRange(min=1), default=None)
def token_create(
    data_dir: Path,
    database_url: str,
    username: str,
    scopes: tuple[str, ...],
    name: str,
    expires_days: int | None,
) -> None:
    """Create an API token and print it once (it is stored hashed)."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> str:
        return await accounts.create_token(
            session,
            username,
            name,
            " ".join(scopes),
            expires_in=timedelta(days=expires_days) if expires_days else None,
        )

    click.echo(_admin(data_dir, database_url, op))


@token.command("list")
@data_option
@db_option
@click.option("--user", "username", required=True)
def token_list(data_dir: Path, database_url: str, username: str) -> None:
    """List a user's tokens (ids, names, scopes, expiry; never the secrets)."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> list[str]:
        return [
            # A name stored before names were checked is shown with its escapes visible.
            f"{t.id}\t{one_line(t.name)}\t{t.scopes}\t"
            f"{f'expires {t.expires_at:%Y-%m-%d}' if t.expires_at else 'no expiry'}"
            for t in await accounts.list_tokens(session, username)
        ]

    for line in _admin(data_dir, database_url, op):
        click.echo(line)


@token.command("revoke")
@data_option
@db_option
@click.argument("token_id", type=int)
def token_revoke(data_dir: Path, database_url: str, token_id: int) -> None:
    """Revoke token TOKEN_ID; it stops working at once."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.revoke_token(session, token_id)

    _admin(data_dir, database_url, op)
    click.echo(f"revoked token {token_id}")


@hub.group("org")
def org() -> None:
    """Manage organisations (shared namespaces)."""


@org.command("add")
@data_option
@db_option
@click.argument("name")
@click.option("--member", "members", multiple=True, help="USER=pull|push|admin; repeatable.")
def org_add(data_dir: Path, database_url: str, name: str, members: tuple[str, ...]) -> None:
    """Create organisation NAME with members."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.create_org(session, name)
        for member in members:
            username, _, role = member.partition("=")
            await accounts.set_member(session, name, username, role)

    _admin(data_dir, database_url, op)
    click.echo(f"created organisation {name}")


@org.command("member")
@data_option
@db_option
@click.argument("name")
@click.argument("username")
@click.argument("role", type=click.Choice(["pull", "push", "admin", "remove"]))
def org_member(data_dir: Path, database_url: str, name: str, username: str, role: str) -> None:
    """Give USERNAME a ROLE in organisation NAME, or remove them."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        if role == "remove":
            await accounts.remove_member(session, name, username)
        else:
            await accounts.set_member(session, name, username, role)

    _admin(data_dir, database_url, op)
    click.echo(
        f"{username} removed from {name}" if role == "remove" else f"{username}: {role} in {name}"
    )


@hub.group("team")
def team() -> None:
    """Manage an organisation's teams (members with one role on its repositories)."""


@team.command("add")
@data_option
@db_option
@click.argument("org")
@click.argument("name")
@click.option("--role", type=click.Choice(["pull", "push", "admin"]), required=True)
@click.option(
    "--repositories",
    default="",
    help="Only repositories matching this glob on full names, e.g. 'acme/app-*' (default: all).",
)
@click.option("--member", "members", multiple=True, help="User to add; repeatable.")
def team_add(
    data_dir: Path,
    database_url: str,
    org: str,
    name: str,
    role: str,
    repositories: str,
    members: tuple[str, ...],
) -> None:
    """Create team NAME in organisation ORG with ROLE on its repositories."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.create_team(
            session, org, name, role, repositories=repositories, members=members
        )

    _admin(data_dir, database_url, op)
    click.echo(
        f"created team {name} in {org}: {role}" + (f" on {repositories}" if repositories else "")
    )


@team.command("remove")
@data_option
@db_option
@click.argument("org")
@click.argument("name")
def team_remove(data_dir: Path, database_url: str, org: str, name: str) -> None:
    """Delete team NAME of organisation ORG."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.delete_team(session, org, name)

    _admin(data_dir, database_url, op)
    click.echo(f"removed team {name} from {org}")


@team.command("member")
@data_option
@db_option
@click.argument("org")
@click.argument("name")
@click.argument("username")
@click.argument("action", type=click.Choice(["add", "remove"]))
def team_member(
    data_dir: Path, database_url: str, org: str, name: str, username: str, action: str
) -> None:
    """Add USERNAME to team NAME of ORG, or remove them."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        if action == "add":
            await accounts.add_team_member(session, org, name, username)
        else:
            await accounts.remove_team_member(session, org, name, username)

    _admin(data_dir, database_url, op)
    click.echo(f"{username} {'added to' if action == 'add' else 'removed from'} {org}/{name}")


@team.command("list")
@data_option
@db_option
@click.argument("org")
def team_list(data_dir: Path, database_url: str, org: str) -> None:
    """List the teams of ORG with their roles and members."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> list[tuple[str, str, str, list[str]]]:
        rows = await accounts.list_teams(session, org)
        return [(t.name, t.role, t.repositories, m) for t, m in rows]

    for name, role, repositories, members in _admin(data_dir, database_url, op):
        line = f"{name}\t{role}\t{repositories or '*'}\t{','.join(members)}"
        problem = repositories and accounts.team_glob_problem(org, repositories)
        if problem:  # stored before the checks, or by hand: it grants nothing
            line += f"\t(grants nothing: {problem}; remove the team and make it again)"
        click.echo(line)


@hub.group("quota")
def quota() -> None:
    """Per-namespace storage quotas."""


def _parse_bytes(text: str) -> int | None:
    from forkd.errors import InvalidInput

    if text.lower() in ("none", "off"):
        return None
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = units.get(t[-1:], 1)
    number = t[:-1] if t[-1:] in units else t
    if not number.isdigit():
        raise InvalidInput(f"invalid size {text!r}: use bytes (e.g. 1073741824, 10GiB) or none")
    return int(number) * mult


@quota.command("set")
@data_option
@db_option
@click.argument("namespace")
@click.argument("size")
def quota_set(data_dir: Path, database_url: str, namespace: str, size: str) -> None:
    """Limit NAMESPACE to SIZE bytes of blobs (e.g. 1073741824 or 10GiB; 'none' removes it)."""
    from forkd.hub import quotas

    limit = _parse_bytes(size)

    async def op(session: AsyncSession) -> None:
        await quotas.set_quota(session, namespace, limit)

    _admin(data_dir, database_url, op)
    click.echo(f"{namespace}: quota {'none' if limit is None else f'{limit} bytes'}")


@quota.command("show")
@data_option
@db_option
@click.argument("namespace")
def quota_show(data_dir: Path, database_url: str, namespace: str) -> None:
    """Show NAMESPACE's quota and the bytes it uses."""
    from forkd.hub import quotas

    async def op(session: AsyncSession) -> tuple[int | None, int]:
        return await quotas.show(session, namespace)

    limit, used = _admin(data_dir, database_url, op)
    click.echo(f"{namespace}: {used} bytes used of {'no quota' if limit is None else limit}")


@hub.group("repo")
def repo() -> None:
    """Manage repositories."""


@repo.command("visibility")
@data_option
@db_option
@click.argument("name")
@click.argument("visibility", type=click.Choice(["public", "private"]))
def repo_visibility(data_dir: Path, database_url: str, name: str, visibility: str) -> None:
    """Make repository NAME public (anonymous pull) or private."""
    from forkd.hub import accounts

    async def op(session: AsyncSession) -> None:
        await accounts.set_visibility(session, name, visibility == "public")

    _admin(data_dir, database_url, op)
    click.echo(f"{name} is {visibility}")


def register(cli: click.Group) -> None:
    """Add the hub's commands to the top-level group."""
    cli.add_command(hub)
