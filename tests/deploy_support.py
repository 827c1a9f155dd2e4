"""What the deployment files (deploy/) are checked against: the real CLI and the real settings.

The systemd units and the Kubernetes manifests name `forkd` commands, their flags and
environment variables. These helpers answer from the installed code, not from a list kept
beside the manifests: the flags are parsed by the click commands themselves, the hub's
variables come from forkd.hub.settings and the CLI's options, the controller's from the
names the installed package reads.
"""

from __future__ import annotations

import ast
import shutil
import sysconfig
from functools import cache
from pathlib import Path

import click

import forkd

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def forkd_entry_point() -> Path:
    """The installed `forkd` console script (its real path, not a shim that wraps it)."""
    script = Path(sysconfig.get_path("scripts")) / "forkd"
    if script.is_file():
        return script
    found = shutil.which("forkd")
    if found is None:
        raise FileNotFoundError("no forkd console script: pip install -e . first")
    return Path(found).resolve()


def command(*path: str) -> click.Command:
    """The click command at ``path`` of the real `forkd` CLI, e.g. ("hub", "serve")."""
    from forkd.cli.main import cli

    cmd: click.Command = cli
    for name in path:
        assert isinstance(cmd, click.Group), f"forkd {' '.join(path)}: {name} is not a group"
        sub = cmd.commands.get(name)
        assert sub is not None, f"forkd has no command {' '.join(path)}"
        cmd = sub
    return cmd


def parse_args(path: tuple[str, ...], args: list[str]) -> None:
    """Parse ``args`` with the real command (click.UsageError for an unknown flag or a
    bad value); nothing runs."""
    cmd = command(*path)
    with cmd.make_context(" ".join(("forkd", *path)), list(args)):
        pass


@cache
def hub_env_names() -> frozenset[str]:
    """The environment variables the hub reads: forkd.hub.settings.ENV_KEYS, the envvars
    of `forkd hub serve`'s options, and the AWS credential variables boto3 takes S3
    credentials from (docs/hub.md)."""
    from botocore.credentials import EnvProvider

    from forkd.hub.settings import ENV_KEYS

    names = set(ENV_KEYS.values())
    for param in command("hub", "serve").params:
        envvar = getattr(param, "envvar", None)
        if isinstance(envvar, str):
            names.add(envvar)
    names |= {EnvProvider.ACCESS_KEY, EnvProvider.SECRET_KEY}
    return frozenset(names)


@cache
def controller_env_names() -> frozenset[str]:
    """``FORKD_*`` names the installed forkd package reads: string constants that are
    exactly such a name (``os.environ.get("FORKD_RUN")``, ``FORCE_ENV = "FORKD_ACCEL"``),
    in the code of forkd, forkd.engine, forkd.controller, … (docstrings do not count:
    they are never exactly a name)."""
    names: set[str] = set()
    for root in forkd.__path__:
        for source in Path(root).rglob("*.py"):
            tree = ast.parse(source.read_text(), filename=str(source))
            for node in ast.walk(tree):
                if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                        and node.value.startswith("FORKD_")
                        and node.value.replace("_", "").isalnum()
                        and node.value.upper() == node.value):
                    names.add(node.value)
    return frozenset(names)


def unit_bounding_set(unit: Path) -> list[str]:
    """A unit's CapabilityBoundingSet as setpriv names them (``CAP_NET_ADMIN`` →
    ``net_admin``)."""
    values = [line.partition("=")[2].split() for line in unit.read_text().splitlines()
              if line.startswith("CapabilityBoundingSet=")]
    assert len(values) == 1, f"{unit.name}: expected one CapabilityBoundingSet line"
    return [c.lower().removeprefix("cap_") for c in values[0]]


def setpriv_bounded(caps: list[str]) -> list[str]:
    """The setpriv prefix that starts a command as systemd starts a root service with
    CapabilityBoundingSet=caps: root, nothing else in the bounding set, none inherited."""
    return ["setpriv", "--bounding-set=" + ",".join(["-all", *(f"+{c}" for c in caps)]),
            "--inh-caps=-all"]
