"""Signed bearer tokens and the verified-credential cache (no I/O)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from dataclasses import dataclass

from forkd.hub.accounts import Principal

BEARER_PREFIX = "fkb."


# -- signed bearer tokens ------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Grant:
    """What a bearer token carries."""

    user_id: int | None
    token_id: int | None
    access: dict[str, frozenset[str]]  # repository → actions
    expires: float
    stamp: str = ""  # the subject's ``accounts.principal_stamp`` when it was issued


class TokenSigner:
    def __init__(self, key: bytes, service: str, ttl: int) -> None:
        self._key = key
        self.service = service
        self.ttl = ttl

    def rekey(self, key: bytes) -> None:
        """Sign and check with ``key`` from now on (the shared key, loaded at start)."""
        self._key = key

    def issue(self, principal: Principal, access: dict[str, frozenset[str]]) -> tuple[str, int]:
        now = int(time.time())
        payload = {
            "sub": principal.user_id,
            "tid": principal.token_id,
            "stp": principal.stamp,
            "aud": self.service,
            "iat": now,
            "exp": now + self.ttl,
            "access": [
                {"type": "repository", "name": name, "actions": sorted(actions)}
                for name, actions in sorted(access.items())
            ],
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        sig = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        return f"{BEARER_PREFIX}{body}.{sig}", now

    def verify(self, token: str) -> Grant | None:
        if not token.startswith(BEARER_PREFIX) or len(token) > 16384:
            return None
        body, _, sig = token[len(BEARER_PREFIX) :].partition(".")
        want = _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())
        # Bytes: the header is the client's text, and compare_digest raises (TypeError, a
        # 500) on a str that is not ASCII.
        if not hmac.compare_digest(want.encode(), sig.encode()):
            return None
        try:
            payload = json.loads(_unb64(body))
            if payload["aud"] != self.service or payload["exp"] < time.time():
                return None
            access = {
                str(item["name"]): frozenset(str(a) for a in item["actions"])
                for item in payload["access"]
            }
            sub, tid, stamp = payload["sub"], payload["tid"], payload.get("stp")
            return Grant(
                sub if isinstance(sub, int) else None,
                tid if isinstance(tid, int) else None,
                access,
                float(payload["exp"]),
                stamp if isinstance(stamp, str) else "",
            )
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None


# -- failed-login rate limit ---------------------------------------------------
class CredentialCache:
    """Recently verified Basic credentials, so clients that send Basic on every request
    do not pay an argon2 verification each time. Keys are an HMAC-SHA256 of user and
    secret under a random key of this process (not a bare sha256: a memory dump of the
    hub then holds nothing a dictionary of common passwords can be run against); the
    subject is re-read from the database on every hit and must still carry the stamp it
    had (``accounts.token_principal``), so removals, revocations and password changes
    apply at once, even where a user or token id was handed out again."""

    def __init__(self, ttl: float = 60.0, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[int, int | None, str, float]] = {}
        self._salt = secrets.token_bytes(32)

    def key(self, user: str, secret: str) -> str:
        message = f"{user}\x00{secret}".encode()
        return hmac.new(self._salt, message, hashlib.sha256).hexdigest()

    def get(self, key: str) -> tuple[int, int | None, str] | None:
        """(user id, token id, stamp) of a credential verified recently."""
        hit = self._entries.get(key)
        if hit is None or hit[3] < time.monotonic():
            self._entries.pop(key, None)
            return None
        return hit[0], hit[1], hit[2]

    def drop(self, key: str) -> None:
        self._entries.pop(key, None)

    def put(self, principal: Principal, key: str) -> None:
        assert principal.user_id is not None
        if len(self._entries) >= self.max_entries:
            now = time.monotonic()
            self._entries = {k: v for k, v in self._entries.items() if v[3] >= now}
            if len(self._entries) >= self.max_entries:
                self._entries.clear()
        self._entries[key] = (
            principal.user_id,
            principal.token_id,
            principal.stamp,
            time.monotonic() + self.ttl,
        )
