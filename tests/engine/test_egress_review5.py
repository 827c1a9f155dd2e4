"""The egress proxy against the fifth review: the proxy's own words about a secret-bearing
reply. No VM.

A reply from a bound host that the proxy refuses (a Content-Encoding it cannot scrub) was
answered with a 502 quoting the upstream's Content-Encoding, lower-cased and unscrubbed:
an upstream that put the request's key there (an echo of the request's headers, which the
guest chooses) handed the guest the value the proxy had swapped in (in lower case: most of
a key), and wrote it into the audit log. The quote is the header as it came, scrubbed,
then cut; the refusal's words are scrubbed as the reply's own would have been.
"""

from __future__ import annotations

from pathlib import Path

from test_egress import (  # the shared fixtures and helpers of the proxy's tests
    REAL,
    audit_lines,
    audit_path,
    proxy_ca,
    store,
    test_ca,
)
from test_egress_http1 import hostile_exchange
from test_egress_review import GET_CLOSE

from forkd.engine.egress import EgressCA, SecretStore

__all__ = ["audit_path", "proxy_ca", "store", "test_ca"]  # fixtures, used by name

def test_a_refused_reply_quotes_no_secret(
    test_ca: EgressCA, proxy_ca: EgressCA, store: SecretStore, audit_path: Path
) -> None:
    pieces = [f"HTTP/1.1 401 Unauthorized\r\nContent-Encoding: x{REAL}\r\n"
              "Content-Length: 2\r\n\r\nno".encode()]
    reply, secret = hostile_exchange(pieces, test_ca, proxy_ca, store, audit_path,
                                       GET_CLOSE)
    assert reply.startswith(b"HTTP/1.1 502 ")
    assert REAL[:8].encode() not in reply  # not even its start (the quote is cut at 40)
    assert b"Content-Encoding 'x" + secret.placeholder[:30].encode() in reply
    assert REAL[:8] not in audit_path.read_text()
    assert audit_lines(audit_path)[-1]["status"] == 502
