"""A listening socket inside a child's network namespace, for ``EgressProxy.serve``.

A socket belongs to the namespace of the thread that made it, for its whole life. The
proxy's listening socket is made inside the child's namespace (so the guest reaches it
at the same address in every child, e.g. the gateway address); the proxy's event loop
runs in the host's namespace, so every upstream connection it opens is the host's.
"""

from __future__ import annotations

import socket
import threading

from forkd.engine import netns

DEFAULT_PROXY_PORT = 3128
REFUSAL_PORT = 3129  # where the namespace redirects TCP that bypasses the proxy (netns.py)


def listen_in_netns(name: str, address: str, port: int = DEFAULT_PROXY_PORT) -> socket.socket:
    """A TCP socket listening on ``address:port`` inside network namespace ``name``
    (under /run/netns), made by a short-lived thread that enters it."""
    made: list[socket.socket] = []
    failed: list[BaseException] = []

    def make() -> None:
        try:
            with netns.entered(name):
                family = socket.AF_INET6 if ":" in address else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    sock.bind((address, port))
                    sock.listen(128)
                    sock.setblocking(False)
                except BaseException:
                    sock.close()
                    raise
                made.append(sock)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=make, name=f"listen-in-{name}")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]
    return made[0]
