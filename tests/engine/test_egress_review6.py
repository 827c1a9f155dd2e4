"""The egress proxy against the sixth review: what of a secret-bearing reply's head is
scrubbed. No VM.

The proxy swapped a bound secret's value back to its placeholder in an upstream reply's
header VALUES and reason phrase, and in the exact case only. An upstream that echoes the
request's headers (which the guest chooses: the guest puts the placeholder where the value
goes) could hand the guest the value as a header's NAME (in the final head or a 1xx's),
or in another case (HTTP/1.1 servers lower-case names, and many a value): the guest read
the key, or the key less its case. The head is now scrubbed whole, in any case. What the
strict parser already refuses (obs-fold, a control byte in a name, from either side) is
checked here too: nothing of such a reply reaches the guest, and such a request reaches
no upstream.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_egress import (  # the shared fixtures and helpers of the proxy's tests
    REAL,
    audit_path,
    proxy_ca,
    store,
    test_ca,
)
from test_egress_http1 import hostile_exchange, hostile_upstream, terminated_exchange
from test_egress_review import GET_CLOSE

from forkd.engine.egress import EgressCA, SecretStore

__all__ = ["audit_path", "proxy_ca", "store", "test_ca"]  # fixtures, used by name

BODY = "Content-Length: 2\r\n\r\nno"
ECHOES = {
    "a header's name": f"HTTP/1.1 200 OK\r\n{REAL}: echoed\r\n{BODY}",
    "a lower-cased name": f"HTTP/1.1 200 OK\r\nx-{REAL.lower()}: 1\r\n{BODY}",
    "an upper-cased value": f"HTTP/1.1 200 OK\r\nX-Echo: Bearer {REAL.upper()}\r\n{BODY}",
    "a lower-cased reason": f"HTTP/1.1 401 bad key {REAL.lower()}\r\n{BODY}",
    "a 1xx's name": (f"HTTP/1.1 103 Early Hints\r\n{REAL}: x\r\n\r\n"
                     f"HTTP/1.1 200 OK\r\n{BODY}"),
    "a 1xx's value, mixed case": (f"HTTP/1.1 103 Early Hints\r\nLink: {REAL.swapcase()}\r\n"
                                  f"\r\nHTTP/1.1 200 OK\r\n{BODY}"),
}


@pytest.mark.parametrize("reply", ECHOES.values(), ids=ECHOES.keys())
def test_a_reply_s_head_gives_no_spelling_of_the_value_in_any_case(
    reply: str, test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    got, secret = hostile_exchange([reply.encode()], test_ca, proxy_ca, store, audit_path,
                                   GET_CLOSE)
    assert got.startswith(b"HTTP/1.1 "), got[:200]
    assert REAL.lower().encode() not in got.lower()
    assert secret.placeholder.encode() in got  # the value's place is kept, as in a value's
    assert got.endswith(b"2\r\nno\r\n0\r\n\r\n")  # the head's framing is whole


BROKEN = {
    "obs-fold": f"HTTP/1.1 200 OK\r\nX-A: a\r\n {REAL}\r\n{BODY}",
    "a control byte in a name": f"HTTP/1.1 200 OK\r\nX\x01{REAL}: a\r\n{BODY}",
    "a space before the colon": f"HTTP/1.1 200 OK\r\n{REAL} : a\r\n{BODY}",
}


@pytest.mark.parametrize("reply", BROKEN.values(), ids=BROKEN.keys())
def test_a_malformed_reply_head_reaches_the_guest_not_at_all(
    reply: str, test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    got, _ = hostile_exchange([reply.encode()], test_ca, proxy_ca, store, audit_path,
                              GET_CLOSE)
    assert REAL.lower().encode() not in got.lower()
    assert b"200 OK" not in got


SMUGGLED_NAMES = {
    "a control byte in a name": b"X-\x1bA: 1\r\n",
    "NUL in a name": b"X-\x00A: 1\r\n",
    "a non-ASCII name": "X-\u00e9: 1\r\n".encode(),
    "obs-fold after an auth header": b"Authorization: Bearer x\r\n y\r\n",
    "an empty name": b": 1\r\n",
}


@pytest.mark.parametrize("line", SMUGGLED_NAMES.values(), ids=SMUGGLED_NAMES.keys())
def test_a_guest_s_malformed_header_reaches_no_upstream(
    line: bytes, test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    upstream, proxy, _ = hostile_upstream([b"HTTP/1.1 200 OK\r\n" + BODY.encode()], test_ca,
                                          proxy_ca, store, audit_path)
    try:
        request = b"GET /v1/models HTTP/1.1\r\nHost: AUTHORITY\r\n" + line + b"\r\n"
        got = terminated_exchange(proxy, upstream.port, proxy_ca, request, timeout=5)
    finally:
        proxy.stop()
        upstream.join()
    assert got.startswith(b"HTTP/1.1 400 "), got[:200]
    assert b"forkd egress" in got
    assert not any(upstream.requests)  # its connection opened at the CONNECT; no byte came
