"""What an IP address reaches, for the code that decides whether to connect there: the
egress proxy (a sandbox's names may lead only to global addresses) and the registry
client (a hub's redirects may not lead to a cloud's metadata service or this host)."""

from __future__ import annotations

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

NAT64 = ipaddress.ip_network("64:ff9b::/96")  # RFC 6052: an IPv4 address in the low bits
IPV4_COMPATIBLE = ipaddress.ip_network("::/96")  # RFC 4291's deprecated ::a.b.c.d
SHARED = ipaddress.ip_network("100.64.0.0/10")  # RFC 6598 (Alibaba's metadata 100.100.100.200)
# Global addresses that are still a cloud host's own services (Azure's wire server).
HOST_SERVICES = frozenset({ipaddress.ip_address("168.63.129.16")})
# Cloud metadata services that are not link-local (AWS's IPv6 one is a ULA).
METADATA = frozenset({ipaddress.ip_address("fd00:ec2::254")})


def parsed(address: str) -> IPAddress:
    """``address`` (brackets and an IPv6 zone allowed) as an address; ValueError if it is
    not one."""
    return ipaddress.ip_address(address.strip("[]").split("%", 1)[0])


def embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one stands for (mapped, 6to4, NAT64, compatible), if any:
    ``::ffff:127.0.0.1``, ``2002:7f00:1::`` and ``64:ff9b::7f00:1`` all reach loopback."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip in NAT64 or (ip in IPV4_COMPATIBLE and int(ip) > 1):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def reached(address: str) -> IPAddress:
    """The address a connection to ``address`` reaches: an IPv6 one wrapping an IPv4 one
    (embedded_ipv4) stands for that."""
    ip = parsed(address)
    if isinstance(ip, ipaddress.IPv6Address):
        return embedded_ipv4(ip) or ip
    return ip


def public_enough(address: str) -> bool:
    """A name may lead only to a global address: never loopback, link-local (cloud
    metadata at 169.254.169.254, fd00:ec2::254), private (RFC 1918, IPv6 ULA), shared
    (100.64.0.0/10, Alibaba's metadata at 100.100.100.200), reserved or multicast, nor to
    one of those wrapped in IPv6, nor to a cloud host's own services."""
    ip = reached(address)
    return ip.is_global and not ip.is_multicast and ip not in HOST_SERVICES


def kind(address: str) -> str:
    """"loopback"; "special" for an address no service a client is sent to lives at: a
    cloud's metadata or host services (link-local 169.254.169.254, fd00:ec2::254, shared
    100.64.0.0/10 with 100.100.100.200, Azure's 168.63.129.16), multicast, unspecified or
    reserved, wrapped in IPv6 or not; "other" for the rest (global or private)."""
    ip = reached(address)
    if ip.is_loopback:
        return "loopback"
    if (ip.is_link_local or ip.is_multicast or ip.is_unspecified or ip.is_reserved
            or ip in HOST_SERVICES or ip in METADATA
            or (isinstance(ip, ipaddress.IPv4Address) and ip in SHARED)):
        return "special"
    return "other"


def this_host(address: str) -> bool:
    """``address`` is one of this host's own (on any of its interfaces, in this process's
    network namespace): a connection to it would reach the host's own services, the ones
    listening on 0.0.0.0 or ::. Asked of the kernel's routing: the source address it picks
    for a destination is that destination exactly when the destination is local (its
    route is in the ``local`` table). Nothing is sent (a UDP socket is only connected)."""
    ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:a.b.c.d reaches a.b.c.d
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((str(ip), 9))
            source = ipaddress.ip_address(str(probe.getsockname()[0]).split("%", 1)[0])
    except OSError:  # no route at all: not this host's (and a TCP connect fails too)
        return False
    return source == ip


def reaches_this_host(address: str) -> str | None:
    """What of this host (or of the cloud it runs in) a connection from it to ``address``
    reaches, said for a message, or None when it reaches another host: loopback, one of
    this host's own addresses, a cloud's metadata or host services (kind "special": with
    link-local, multicast, reserved and unspecified, since a connection to 0.0.0.0 or ::
    reaches loopback)."""
    if kind(address) == "loopback":
        return "this host's loopback"
    if kind(address) == "special":
        return ("a cloud's metadata or host services, or a link-local, unspecified, multicast "
                "or reserved address")
    if this_host(address):
        return "one of this host's own addresses"
    return None
