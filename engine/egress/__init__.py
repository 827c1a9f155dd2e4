"""Egress for children: the policy, the host-side secret store, the CA, the proxy and a
stand-in model server (docs/agents.md).

The API a child's lifecycle calls::

    policy = EgressPolicy.parse(["api.openai.com", "pypi.org"])
    store = SecretStore()
    ca = EgressCA.load_or_create(store.root / "ca")
    proxy = EgressProxy(policy, store.all(), AuditLog(path), ca, child_id=child.id)
    server = await proxy.serve(listening_socket_made_in_the_childs_netns)
    guest_env = guest_environment(store.all())   # NAME -> placeholder, for the guest
    ca.cert_pem                                   # for the guest's trust store

Names are imported on first use (``forkd.engine.egress.child``, which every child's
lifecycle imports, needs neither httptools nor cryptography).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from forkd.engine.egress.ca import EgressCA
    from forkd.engine.egress.policy import Destination, EgressPolicy, parse_destination
    from forkd.engine.egress.proxy import EgressProxy, ProxyLimits
    from forkd.engine.egress.secrets import Secret, SecretStore, guest_environment

_WHERE = {
    "EgressCA": "ca",
    "Destination": "policy",
    "EgressPolicy": "policy",
    "parse_destination": "policy",
    "EgressProxy": "proxy",
    "ProxyLimits": "proxy",
    "Secret": "secrets",
    "SecretStore": "secrets",
    "guest_environment": "secrets",
}

__all__ = [
    "Destination",
    "EgressCA",
    "EgressPolicy",
    "EgressProxy",
    "ProxyLimits",
    "Secret",
    "SecretStore",
    "guest_environment",
    "parse_destination",
]


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
