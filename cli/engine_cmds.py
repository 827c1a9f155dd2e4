"""`forkd` commands of the engine (registered by forkd.cli.main).

doctor, build, fork, ls, exec, eval, kill, branch, extend, pause, resume.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from forkd.cli.errors import MAX_ERROR_CHARS
from forkd.cli.output import RAW_HELP, GuestOutput, emit_json, human
from forkd.errors import ForkdError, InvalidInput
from forkd.names import inert, one_line
from forkd.store.store import Store

if TYPE_CHECKING:
    from forkd.controller.backend import Backend

json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
raw_option = click.option("--raw", is_flag=True, help=RAW_HELP)


def _store() -> Store:
    return Store.open()


def _backend() -> Backend:
    """The daemon's API when `forkd serve` answers on its socket, else the engine in-process."""
    from forkd.controller.sdk import Controller

    return Controller().backend


def _plain(answer: object) -> Any:
    """An API answer (forkd.controller.api types) as JSON values: dicts, lists, str..."""
    import msgspec

    return msgspec.to_builtins(answer)


def _say(msg: str) -> None:
    click.echo(f"  {msg}", err=True)


@click.command()
@json_option
@click.option("--no-store", is_flag=True, help="Skip re-verifying every blob of the store.")
def doctor(as_json: bool, no_store: bool) -> None:
    """Check QEMU, the accelerator (probe: kvm or tcg), cgroups, tools, kernel, store."""
    from forkd.engine import doctor as doc

    checks = doc.run(check_store=not no_store)
    ok = doc.verdict(checks)
    if as_json:
        accel = next((c.detail.split(":", 1)[0] for c in checks
                      if c.name == "accelerator" and c.status != "fail"), None)
        emit_json({"ok": ok, "accelerator": accel, "checks": [c.to_dict() for c in checks]})
    else:
        for c in checks:
            mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL", "info": "info"}[c.status]
            click.echo(f"[{mark}] {c.name:13} {c.detail}")
            if c.hint and c.status in ("warn", "fail"):
                click.echo(f"       {'':13} fix: {c.hint}")
        click.echo("verdict: " + ("ready" if ok else "not ready (see FAIL lines)"))
    if not ok:
        sys.exit(1)


@click.command()
@click.argument("recipe", type=click.Path(exists=True, path_type=Path))
@click.option("--tag", "-t", required=True, help="Tag of the snapshot, NAME[:TAG].")
@click.option("--force", is_flag=True, help="Rebuild even if cached; replace the tag.")
@json_option
def build(recipe: Path, tag: str, force: bool, as_json: bool) -> None:
    """Build a warm snapshot from a TOML RECIPE (a file, or a folder with a recipe.toml)
    and store it as a base layer."""
    from forkd.engine import recipe as rc
    from forkd.engine.build import build as do_build

    r = rc.load(recipe)
    t0 = time.monotonic()
    res = do_build(
        _store(),
        r,
        tag,
        force=force,
        progress=lambda m: _say(f"[{time.monotonic() - t0:6.1f}s] {m}"),
    )
    if as_json:
        emit_json(asdict(res))
        return
    if res.cached:
        click.echo(f"{res.ref} {res.digest[7:19]} (cached, {res.total_s:.1f} s)")
    else:
        click.echo(
            f"built {res.ref} {res.digest[7:19]}: boot {res.boot_s:.2f} s, warm-up "
            f"{res.warmup_s:.2f} s, snapshot {res.snapshot_ms:.1f} ms, "
            f"{human(res.stored_bytes)} stored, total {res.total_s:.1f} s ({res.accel})"
        )


def _egress_option(egress: tuple[str, ...], no_egress: bool) -> list[str] | None:
    if egress and no_egress:
        raise InvalidInput("give --egress or --no-egress, not both")
    return [] if no_egress else list(egress) or None


@click.command()
@click.argument("tag")
@click.option("-n", "count", type=int, default=1, show_default=True, help="Number of children.")
@click.option("--memory-limit-mib", type=int, default=None, help="cgroup memory limit per child.")
@click.option("--netns", is_flag=True, help="Give each child a network namespace + tap.")
@click.option("--no-sandbox", is_flag=True, help="Run QEMU without -sandbox on.")
@click.option("--timeout", "timeout", default=None, metavar="DURATION",
              help="Lifetime of each child (90s, 5m, 1h30m, 2d); then --on-timeout happens.")
@click.option("--on-timeout", type=click.Choice(["kill", "pause"]), default="kill",
              show_default=True, help="What the deadline does to a child.")
@click.option("--cpus", type=float, default=None,
              help="CPU time per child, in CPUs (0.5 = half of one core).")
@click.option("--pids-max", type=int, default=None, help="Host tasks of each child's QEMU.")
@click.option("--disk-bps", type=int, default=None, help="Disk bytes/s per child (read+write).")
@click.option("--disk-iops", type=int, default=None, help="Disk operations/s per child.")
@click.option("--net-kbit", type=int, default=None,
              help="Network kbit/s to each child (needs a network snapshot).")
@click.option("--egress", "egress", multiple=True, metavar="HOST[:PORT]",
              help="A destination children may reach through their egress proxy (repeatable; "
                   "default: the recipe's; docs/agents.md).")
@click.option("--no-egress", is_flag=True, help="No egress, not even the recipe's default.")
@click.option("--lazy", is_flag=True,
              help="TAG is HUB/NS/NAME[:TAG]: fork before the pack has arrived, its memory and "
                   "disk fetched on first access (docs/engine.md, \"Lazy fork\").")
@json_option
def fork(
    tag: str,
    count: int,
    memory_limit_mib: int | None,
    netns: bool,
    no_sandbox: bool,
    timeout: str | None,
    on_timeout: str,
    cpus: float | None,
    pids_max: int | None,
    disk_bps: int | None,
    disk_iops: int | None,
    net_kbit: int | None,
    egress: tuple[str, ...],
    no_egress: bool,
    lazy: bool,
    as_json: bool,
) -> None:
    """Fork COUNT copy-on-write children of snapshot TAG; they keep running after exit."""
    from forkd.engine.lifetimes import parse_duration

    if count <= 0:
        raise InvalidInput(f"-n must be at least 1, got {count}")
    from forkd.controller.api import SpawnRequest

    if lazy:
        from forkd.engine.lazy import fork as lazy_fork
        from forkd.engine.lifecycle import Lifetime, Limits

        got = lazy_fork.fork(
            _store(), tag, count, sandbox=not no_sandbox, with_netns=netns, progress=_say,
            limits=Limits(memory_limit_mib, cpus, pids_max, disk_bps, disk_iops, net_kbit),
            lifetime=Lifetime(parse_duration(timeout) if timeout is not None else None,
                              on_timeout),
            egress=_egress_option(egress, no_egress))
        res: dict[str, Any] = {
            "sandboxes": [asdict(c) for c in got.children], "assemble_ms": got.assemble_ms,
            "total_ms": got.total_ms, "errors": got.errors}
    else:
        res = _plain(_backend().spawn(SpawnRequest(
            tag=tag,
            n=count,
            memory_limit_mib=memory_limit_mib,
            netns=netns,
            sandbox=not no_sandbox,
            timeout=parse_duration(timeout) if timeout is not None else None,
            on_timeout=on_timeout,  # type: ignore[arg-type]  # click.Choice: "kill" or "pause"
            cpus=cpus,
            pids_max=pids_max,
            disk_bps=disk_bps,
            disk_iops=disk_iops,
            net_kbit=net_kbit,
            egress=_egress_option(egress, no_egress),
        )))
    if as_json:
        emit_json(
            {
                "children": res["sandboxes"],
                "assemble_ms": res["assemble_ms"],
                "total_ms": res["total_ms"],
                "errors": res["errors"],
            }
        )
    else:
        for c in res["sandboxes"]:
            t = c["timings_ms"]
            click.echo(
                f"{one_line(c['id'])}  pid {c['pid']}  running {t.get('running', 0):.0f} ms  "
                f"ready {t.get('ready', 0):.0f} ms"
            )
        click.echo(
            f"{len(res['sandboxes'])} children of {one_line(tag)} ready in "
            f"{res['total_ms']:.0f} ms (assemble {res['assemble_ms']:.0f} ms)"
        )
        for e in res["errors"]:
            click.echo(f"failed: {inert(e, MAX_ERROR_CHARS)}", err=True)
    if res["errors"]:
        sys.exit(1)


@click.command("ls")
@json_option
def ls_cmd(as_json: bool) -> None:
    """List children (running, or crashed if their QEMU died)."""
    kids = _plain(_backend().sandboxes())
    if as_json:
        emit_json(kids)
        return
    if not kids:
        click.echo("no children")
        return
    click.echo(f"{'ID':22} {'STATUS':8} {'PID':>8} {'AGE':>7} {'LEFT':>8}  SNAPSHOT")
    for c in kids:
        click.echo(  # every text cell one line, inert: a daemon's answer, not forkd's words
            f"{one_line(c['id']):22} {one_line(c['status']):8} {c['pid']:>8} "
            f"{time.time() - c['created']:6.0f}s {_left(c.get('time_left_s')):>8}  "
            f"{one_line(c.get('origin') or c['ref'])}"
        )


def _left(seconds: float | None) -> str:
    """Time left before the deadline: 42s, 12m05s, 3h20m, or - without one."""
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class GuestCommand(click.Command):
    """A command ending in a guest command line, passed on untouched: it starts at the first
    argument after CHILD_ID that is not one of forkd's options (or after ``--``), so its own
    options (``--help``, ``--json``, ``-e``, ...) are never forkd's."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        start = self._guest_start(ctx, args)
        if start is not None:
            args = [*args[:start], "--", *args[start:]]
        return super().parse_args(ctx, args)

    def _guest_start(self, ctx: click.Context, args: list[str]) -> int | None:
        """Index of the guest command's first argument; None when ``--`` marks it (or absent)."""
        takes_value = {
            name: not (p.is_flag or p.count)
            for p in self.get_params(ctx)
            if isinstance(p, click.Option)
            for name in (*p.opts, *p.secondary_opts)
        }
        positionals, i = 0, 0
        while i < len(args):
            arg = args[i]
            if arg == "--":
                return None
            if arg.startswith("-") and arg != "-":
                name, attached = (arg.split("=", 1)[0], "=" in arg) if arg.startswith("--") \
                    else (arg[:2], len(arg) > 2)
                i += 2 if takes_value.get(name) and not attached else 1
                continue
            positionals += 1
            if positionals == 2:  # CHILD_ID, then the command
                return i
            i += 1
        return None


@click.command("exec", cls=GuestCommand)
@click.argument("child_id")
@click.argument("argv", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--timeout", type=float, default=None, help="Kill the command after SECONDS.")
@click.option("--cwd", default=None, help="Working directory in the guest.")
@click.option("--env", "-e", multiple=True, help="KEY=VALUE for the command's environment.")
@click.option("--stdin", "use_stdin", is_flag=True, help="Pass this command's stdin along.")
@raw_option
@json_option
def exec_cmd(
    child_id: str,
    argv: tuple[str, ...],
    timeout: float | None,
    cwd: str | None,
    env: tuple[str, ...],
    use_stdin: bool,
    raw: bool,
    as_json: bool,
) -> None:
    """Run a command in child CHILD_ID: forkd exec [OPTIONS] ID [OPTIONS] [--] CMD ARGS...

    Everything from CMD on goes to the guest as it is, options included. Its output is
    written as it comes; to a terminal, control characters (ESC, CR, ...) appear as
    escapes unless --raw (docs/api.md, "What the CLI prints")."""
    envd = {}
    for kv in env:
        k, sep, v = kv.partition("=")
        if not sep:
            raise InvalidInput(f"--env {kv!r}: expected KEY=VALUE")
        envd[k] = v
    data = sys.stdin.buffer.read() if use_stdin else None
    from forkd.controller.api import ExecRequest

    req = ExecRequest(argv=list(argv), env=envd or None, cwd=cwd, stdin=data, timeout=timeout)
    if as_json:
        emit_json(_plain(_backend().exec(child_id, req)))
        return
    r: dict[str, Any] = {}
    out = GuestOutput(raw)
    try:
        for frame in _backend().exec_stream(child_id, req):  # output printed as it comes
            if frame.stdout:
                out.write("stdout", frame.stdout)
            if frame.stderr:
                out.write("stderr", frame.stderr)
            if frame.result is not None:
                r = _plain(frame.result)
    except ForkdError:  # an error frame: forkd.cli.errors prints it, on a line of its own
        out.finish()
        out.own_line(err=True)
        raise
    out.finish()
    why = {"timed_out": f"command timed out after {timeout} s (its process group was killed)",
           "oom_killed": "the guest's OOM killer ended the command (give the sandbox more "
                         "memory, or make the command use less)",
           "killed": "the command was killed by a request"}.get(str(r.get("status")))
    if why:
        out.own_line(err=True)
        click.echo(f"forkd: {why}", err=True)
    if "exit_code" not in r:
        out.own_line(err=True)  # the error line forkd.cli.errors prints
        raise ForkdError(f"sandbox {one_line(child_id)}: the command's output ended without "
                         "its result (the daemon or the sandbox went away); `forkd ls` shows "
                         "whether it still runs")
    code = int(r["exit_code"])
    sys.exit(code & 0xFF if code >= 0 else 128 + (-code & 0x7F))  # killed by signal N → 128+N


@click.command("eval")
@click.argument("child_id")
@click.argument("code")
@raw_option
@json_option
def eval_cmd(child_id: str, code: str, raw: bool, as_json: bool) -> None:
    """Evaluate Python CODE in child CHILD_ID's warm interpreter. Its stdout and stderr
    are written as for exec (--raw); the value's repr and the error are forkd's lines,
    shown inert (--json has every part exactly)."""
    from forkd.controller.api import EvalRequest

    r = _plain(_backend().eval(child_id, EvalRequest(code=code)))
    if as_json:
        emit_json(r)
    else:
        out = _cell_output(r, raw)
        if r.get("repr") is not None:
            out.own_line(err=False)
            click.echo(inert(r["repr"], MAX_ERROR_CHARS))
        _cell_error(r, out)
    if r.get("error"):
        sys.exit(1)


def _cell_output(r: dict[str, Any], raw: bool) -> GuestOutput:
    """A cell's stdout and stderr written (GuestOutput: inert to a terminal unless raw)."""
    out = GuestOutput(raw)
    out.write("stdout", r["stdout"])
    out.write("stderr", r["stderr"])
    out.finish()
    return out


def _cell_error(r: dict[str, Any], out: GuestOutput) -> None:
    """A cell's error (its traceback), inert, on a line of its own on stderr."""
    if r.get("error"):
        out.own_line(err=True)
        click.echo(inert(r["error"].get("traceback") or r["error"]["message"],
                         MAX_ERROR_CHARS), err=True)


@click.command("run-code")
@click.argument("child_id")
@click.argument("code")
@click.option("--timeout", type=float, default=None,
              help="Stop the cell after SECONDS (default 300).")
@click.option("--save-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write image results there (result-N.png / .jpeg).")
@raw_option
@json_option
def run_code_cmd(child_id: str, code: str, timeout: float | None, save_dir: Path | None,
                 raw: bool, as_json: bool) -> None:
    """Run a code-interpreter cell (Python CODE, or - for stdin) in child CHILD_ID's warm
    namespace: stdout, stderr, rich results (figures, DataFrames) and the last value.
    stdout and stderr are written as for exec (--raw); the results and the error are
    forkd's lines, shown inert (--json has every part exactly)."""
    from forkd.controller.api import RunCodeRequest

    if code == "-":
        code = sys.stdin.read()
    req = RunCodeRequest(code=code) if timeout is None else RunCodeRequest(code=code,
                                                                           timeout=timeout)
    r = _plain(_backend().run_code(child_id, req))
    if as_json:
        emit_json(r)
    else:
        out = _cell_output(r, raw)
        for i, res in enumerate(r["results"]):
            out.own_line(err=False)
            click.echo(_describe_result(i, res, save_dir))
        _cell_error(r, out)
    if r.get("error"):
        sys.exit(1)


def _describe_result(i: int, res: dict[str, Any], save_dir: Path | None) -> str:
    """A result as text: its text form, and where its image went (or that it has one)."""
    import base64

    lines = [inert(res["text"], MAX_ERROR_CHARS)]
    for kind in ("png", "jpeg"):
        if res.get(kind):
            data = base64.b64decode(res[kind])
            if save_dir is not None:
                save_dir.mkdir(parents=True, exist_ok=True)
                path = save_dir / f"result-{i}.{kind}"
                path.write_bytes(data)
                lines.append(f"[{kind} saved to {path}]")
            else:
                lines.append(f"[{kind} image, {len(data)} bytes; --save-dir writes it]")
    if res.get("html") and not res.get("png"):
        lines.append("[html form available: --json shows it]")
    return "\n".join(lines)


@click.command()
@click.argument("child_ids", nargs=-1)
@click.option("--all", "kill_all", is_flag=True,
              help="Kill every child of this store ($FORKD_HOME), none of another's.")
@json_option
def kill(child_ids: tuple[str, ...], kill_all: bool, as_json: bool) -> None:
    """Stop children and remove everything they had (sockets, disks, cgroups)."""
    if not child_ids and not kill_all:
        raise InvalidInput("name children to kill or pass --all")
    backend = _backend()
    if kill_all:
        child_ids = _children_of_this_store()
    done = [_plain(backend.kill(i)) for i in child_ids]
    if as_json:
        emit_json([{"id": c["id"], "was": c["status"]} for c in done])
    else:
        for c in done:
            state = "killed" if c["status"] == "killed" else "cleaned up (crashed)"
            click.echo(f"{one_line(c['id'])} {state}")


def _children_of_this_store() -> tuple[str, ...]:
    """Ids of the children forked from $FORKD_HOME's store, in $FORKD_RUN (the daemon's too:
    its socket is there). The run directory may hold other stores' children (every root
    user's share /run/forkd): those are left, and counted."""
    from forkd.engine import children as ch

    store = _store()
    every = ch.list_children()
    mine = tuple(c.id for c in every if ch.of_store(c.memory, store))
    if len(every) > len(mine):
        click.echo(f"forkd: {len(every) - len(mine)} children of other stores than {store.home} "
                   "left running (`forkd ls` lists them; name one to kill it)", err=True)
    return mine


@click.command()
@click.argument("child_id")
@click.option("--tag", "-t", required=True, help="Tag of the new diff layer, NAME[:TAG].")
@click.option("--force", is_flag=True, help="Replace the tag if it exists.")
@json_option
def branch(child_id: str, tag: str, force: bool, as_json: bool) -> None:
    """Snapshot a running child as a diff layer (its copied-on-write pages)."""
    from forkd.controller.api import BranchRequest

    res = _plain(_backend().branch(child_id, BranchRequest(tag=tag, force=force)))
    if as_json:
        emit_json(res)
        return
    click.echo(
        f"branched {child_id} → {res['ref']} {res['digest'][7:19]}: pause "
        f"{res['pause_ms']:.1f} ms, diff {res['diff_pages']} pages "
        f"({human(res['diff_bytes'])}), {human(res['stored_bytes'])} stored, "
        f"depth {res['depth']}" + (" (auto-compacted)" if res["compacted"] else "")
    )


@click.command()
@click.argument("child_id")
@click.argument("duration")
@json_option
def extend(child_id: str, duration: str, as_json: bool) -> None:
    """Move child CHILD_ID's deadline DURATION later (90s, 5m, 1h30m; from now if none)."""
    from forkd.controller.api import ExtendRequest
    from forkd.engine.lifetimes import parse_duration

    r = _plain(_backend().extend(child_id, ExtendRequest(seconds=parse_duration(duration))))
    if as_json:
        emit_json(r)
    elif r.get("time_left_s") is None:
        click.echo(f"{child_id} paused: its lifetime will be {r['timeout_s']:.0f} s when resumed")
    else:
        click.echo(f"{child_id} has {_left(r['time_left_s'])} left")


@click.command()
@click.argument("child_id")
@json_option
def pause(child_id: str, as_json: bool) -> None:
    """Save child CHILD_ID (memory, processes, disk) into the store and free its VM."""
    r = _plain(_backend().pause(child_id))
    if as_json:
        emit_json(r)
    else:
        t = r["timings_ms"]
        click.echo(f"{child_id} paused (VM stopped {t.get('pause', 0):.0f} ms, saved and freed "
                   f"in {t.get('freed', 0):.0f} ms); `forkd resume {child_id}` brings it back")


@click.command()
@click.argument("child_id")
@json_option
def resume(child_id: str, as_json: bool) -> None:
    """Bring paused child CHILD_ID back under the same id, as it was."""
    r = _plain(_backend().resume(child_id))
    if as_json:
        emit_json(r)
    else:
        click.echo(f"{child_id} running again, pid {r['pid']}, ready in "
                   f"{r['timings_ms'].get('ready', 0):.0f} ms")


def register(cli: click.Group) -> None:
    """Add the engine's commands to the top-level group."""
    for command in (doctor, build, fork, ls_cmd, exec_cmd, eval_cmd, run_code_cmd, kill,
                    branch, extend, pause, resume):
        cli.add_command(command)
