"""One child's egress proxy as its own host process (started by engine/lifecycle.py).

``python3 -P -m forkd.engine.egress.serve --child ID --netns forkd-ID --ready DIR/egress.ready
[--secrets DIR] --audit FILE [--upstream-ca FILE] [--pin HOST=ADDR]... ALLOW...``

It loads the child's policy (the ALLOW entries), the secrets bound to destinations the
policy allows (none without ``--secrets``: a recipe's default egress) and (when there are
any) the egress CA, opens the audit log, makes its
listening socket inside the child's network namespace (``GW_IP:3128``: the guest reaches
it at the same address in every child) and serves with an event loop in the host's
namespace, so every upstream connection is the host's. When it listens it writes the
``--ready`` file; SIGTERM or SIGINT ends it. It outlives the command that forked the child
(like the child's QEMU) and is ended with the child by ``ChildVM.cleanup``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

from forkd.audit import AuditLog
from forkd.engine import netns
from forkd.engine.egress.ca import EgressCA
from forkd.engine.egress.netns_listen import DEFAULT_PROXY_PORT, REFUSAL_PORT, listen_in_netns
from forkd.engine.egress.policy import EgressPolicy
from forkd.engine.egress.proxy import EgressProxy, new_event_loop
from forkd.engine.egress.secrets import Secret, SecretStore
from forkd.errors import ForkdError

RELOAD_S = 1.0  # how often the secret store is checked for a change


def bound_secrets(store: SecretStore, policy: EgressPolicy) -> list[Secret]:
    return [s for s in store.all() if any(policy.allowing(b) for b in s.bindings)]


def load(store: SecretStore, policy: EgressPolicy) -> tuple[list[Secret], EgressCA | None]:
    secrets = bound_secrets(store, policy)
    return secrets, EgressCA.load_or_create(store.root / "ca") if secrets else None


async def follow_store(proxy: EgressProxy, store: SecretStore) -> None:
    """Reload the secrets when the store's directory changes (`forkd secret set` renames a
    new file in, `rm` unlinks one): a rotated value reaches running children."""
    seen = os.stat(store.root).st_mtime_ns
    while True:
        await asyncio.sleep(RELOAD_S)
        try:
            now = os.stat(store.root).st_mtime_ns
            if now != seen:
                seen = now
                proxy.set_secrets(*load(store, proxy.policy))
        except (ForkdError, OSError) as exc:  # keep the secrets it has; say why
            print(f"forkd egress proxy: the secret store could not be reloaded: {exc}",
                  file=sys.stderr, flush=True)


def build_proxy(args: argparse.Namespace) -> EgressProxy:
    policy = EgressPolicy.parse(args.allow)
    secrets, ca = load(SecretStore(Path(args.secrets)), policy) if args.secrets else ([], None)
    trust = None
    if args.upstream_ca:
        trust = ssl.create_default_context()
        trust.load_verify_locations(cafile=args.upstream_ca)
        trust.set_alpn_protocols(["http/1.1"])
    pins = dict(p.split("=", 1) for p in args.pin)
    return EgressProxy(policy, secrets, AuditLog(Path(args.audit)), ca, child_id=args.child,
                       upstream_trust=trust, hosts=pins)


async def serve(proxy: EgressProxy, store: SecretStore | None, ns: str, ready: Path) -> None:
    sock = listen_in_netns(ns, netns.GW_IP, DEFAULT_PROXY_PORT)
    server = await proxy.serve(sock)
    refusals = await proxy.serve_refusals(listen_in_netns(ns, netns.GW_IP, REFUSAL_PORT))
    follower = asyncio.create_task(follow_store(proxy, store) if store else asyncio.sleep(0))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready.write_text("listening\n")
    try:
        await stop.wait()
    finally:
        follower.cancel()
        refusals.close()
        server.close()
        await proxy.aclose()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="forkd.engine.egress.serve",
                                description="one child's egress proxy")
    p.add_argument("--child", required=True)
    p.add_argument("--netns", required=True)
    p.add_argument("--ready", required=True, help="file written once the proxy listens")
    p.add_argument("--secrets", default=None,
                   help="the secret store directory (none: no secret is bound)")
    p.add_argument("--audit", required=True, help="the egress audit log")
    p.add_argument("--upstream-ca", default=None, help="extra CA bundle for upstreams")
    p.add_argument("--pin", action="append", default=[], metavar="HOST=ADDR")
    p.add_argument("allow", nargs="+", help="the egress policy: HOST[:PORT] entries")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.netns.startswith(netns.PREFIX):
        print(f"refusing namespace {args.netns!r} (not {netns.PREFIX}*)", file=sys.stderr)
        return 2
    try:
        proxy = build_proxy(args)
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            store = SecretStore(Path(args.secrets)) if args.secrets else None
            runner.run(serve(proxy, store, args.netns, Path(args.ready)))
    except (ForkdError, OSError, ValueError) as exc:
        print(f"forkd egress proxy for {args.child}: {exc}", file=sys.stderr)
        return 1
    finally:
        with contextlib.suppress(OSError):
            Path(args.ready).unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
