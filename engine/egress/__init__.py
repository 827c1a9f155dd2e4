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
"""

from forkd.engine.egress.ca import EgressCA
from forkd.engine.egress.policy import Destination, EgressPolicy, parse_destination
from forkd.engine.egress.proxy import EgressProxy, ProxyLimits
from forkd.engine.egress.secrets import Secret, SecretStore, guest_environment

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
