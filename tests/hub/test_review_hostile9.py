"""Hostile review 9: no credential reaches the audit log through a refused login, and a
cross-repository mount never links a blob a concurrent GC sweep removed.

* a refused login is audited with the user name the client sent; a token pasted as the
  user name (``fkd_…``) or a password typed there went into the append-only log in
  clear. Only a name an account could have is recorded now, on the registry and on the
  UI's sign-in form;
* a mount read the source repository's link and the blob's presence before it took the
  writers' side of the GC lock, so on PostgreSQL a sweep could remove both in between
  and the mount then linked (201) a blob whose bytes were gone: a manifest pushed next
  was accepted and its pulls failed. The mount now reads under the lock.
"""

from __future__ import annotations

import base64
import json
import re
import time
from pathlib import Path

from hub_support import HubServer

TIMEOUT = 60


def _name(prefix: str) -> str:
    return f"{prefix}{time.monotonic_ns() % 10**9}"


def _audit(hub: HubServer) -> list[dict[str, object]]:
    path: Path = hub.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def _basic(user: str, password: str) -> dict[str, str]:
    raw = base64.b64encode(f"{user}:{password}".encode()).decode()
    return {"Authorization": f"Basic {raw}"}


# -- 1. a refused login's user field is not kept when it is no user name ------------------
def test_a_credential_sent_as_the_user_name_is_not_audited(hub: HubServer) -> None:
    """Before: ``{"actor": "fkd_…", "action": "login", "result": "denied"}``: the token
    in clear in the audit log (also a password typed into the user field)."""
    alice = hub.add_user(_name("alice"))
    secret = hub.token(alice[0], f"{alice[0]}:pull")
    assert secret.startswith("fkd_")
    typed_password = "Correct Horse Battery Staple!"
    with hub.client() as c:
        # A token as the user name (a client that sends TOKEN:x), with the wrong password.
        assert c.get("/v2/", headers=_basic(secret, "x")).status_code == 401
        assert c.get("/v2/", headers=_basic(secret, "fkd_not-a-token")).status_code == 401
        # A password typed into the user name field.
        assert c.get("/v2/", headers=_basic(typed_password, "")).status_code == 401
        # The UI's sign-in form goes through the same check.
        page = c.get("/-/signin")
        csrf = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
        assert csrf
        r = c.post(
            "/-/signin",
            data={"login_csrf": csrf.group(1), "username": secret, "password": "wrong-one"},
        )
        assert r.status_code == 401, r.text
        # A name an account could have is still what the record names.
        wrong = c.get("/v2/", headers=_basic(alice[0], "not-her-password"))
        assert wrong.status_code == 401
    log_text = (hub.data_dir / "audit.log").read_text()
    assert secret not in log_text
    assert secret[4:20] not in log_text
    assert typed_password not in log_text
    denied = [e for e in _audit(hub) if e["action"] == "login" and e["result"] == "denied"]
    actors = [e["actor"] for e in denied]
    assert actors.count("(not a user name)") >= 4, actors
    assert alice[0] in actors
