"""Hostile review 15: what one client could take from every other client.

- The audit budget of provoked records (refusals, anonymous registry tokens, refused
  logins) was one per kind for the whole hub: one account looping on refused requests,
  or one address looping anonymously or on wrong passwords, spent the minute's budget
  of its kind, and every other client's refusals of that minute went unrecorded (a
  flood to hide a probe behind). Now one client (an account; for anonymous callers and
  logins, an address) has a share of its kind's budget (``Hub.provoked``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
from hub_server import HubServer
from hub_support import unique_name

from forkd.hub.services import PROVOKED_SHARES

PER_MINUTE = 40


def audit_lines(server: HubServer) -> list[dict[str, Any]]:
    path = server.data_dir / "audit.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_one_client_cannot_spend_every_clients_audit_budget(tmp_path: Path) -> None:
    """Before: account ``flooder`` made ``PER_MINUTE`` refused requests and the refusal
    of ``prober`` that followed in the same minute was not recorded; so were an
    anonymous address's and a login guesser's floods to everyone else of their kind."""
    server = HubServer(
        tmp_path / "hub",
        {"audit_provoked_per_minute": PER_MINUTE, "trusted_proxies": "127.0.0.1"},
    ).start()
    flood, other = {"X-Forwarded-For": "10.9.0.1"}, {"X-Forwarded-For": "10.9.0.2"}
    try:
        share = PER_MINUTE // PROVOKED_SHARES
        flooder = server.add_user(unique_name("flooder"))
        prober = server.add_user(unique_name("prober"))
        secret = "victim/secret"
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for i in range(PER_MINUTE + 5):
                r = c.get(f"/v2/{secret}/manifests/v{i}", auth=flooder)
                assert r.status_code == 404
                r = c.get(f"/v2/{secret}/manifests/v{i}", headers=flood)
                assert r.status_code == 401
                r = c.get("/v2/", auth=(f"guess{i}", "wrong"), headers=flood)
                assert r.status_code in (401, 429)
            assert c.get("/v2/victim/probe/manifests/v1", auth=prober).status_code == 404
            r = c.get("/v2/victim/anon/manifests/v1", headers=other)
            assert r.status_code == 401
            r = c.get("/v2/", auth=("other-guess", "wrong"), headers=other)
            assert r.status_code == 401
        lines = audit_lines(server)
        refused = [e for e in lines if e["result"] in ("denied", "rate-limited")]
        # Each flood wrote its client's share, no more (plus a minute's turn, at most).
        assert len([e for e in refused if e["actor"] == flooder[0]]) <= 2 * share
        from_flood = [e for e in refused if e["ip"] == "10.9.0.1"]
        assert len([e for e in from_flood if e["action"] == "login"]) <= 2 * share
        assert len([e for e in from_flood if e["action"] != "login"]) <= 2 * share
        # And every other client's refusal is still in the log.
        assert any(e["actor"] == prober[0] and e["target"] == "victim/probe" for e in refused)
        assert any(e["ip"] == "10.9.0.2" and e["target"] == "victim/anon" for e in refused)
        assert any(e["ip"] == "10.9.0.2" and e["actor"] == "other-guess" for e in refused)
    finally:
        server.stop()
