"""The browser session: a signed cookie naming the user (and the API token, when someone
signed in with one), re-checked against the database on every request.

Cookie: ``forkd_session = b64(json{u, t, e}) . b64(hmac-sha256)``, HttpOnly,
SameSite=Lax, Secure behind HTTPS. Forms that change state carry a CSRF token
derived from the cookie (HMAC), so another site cannot post them.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import time
from dataclasses import dataclass

from litestar import Request
from litestar.datastructures import State

from forkd.hub import accounts
from forkd.hub.accounts import ANONYMOUS, Principal
from forkd.hub.services import Hub

COOKIE = "forkd_session"
SESSION_TTL = 12 * 3600


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Viewer:
    """Who is looking at a page: the principal, and the CSRF token for their forms."""

    principal: Principal
    csrf: str = ""

    @property
    def signed_in(self) -> bool:
        return not self.principal.anonymous


class Sessions:
    def __init__(self, secret: bytes) -> None:
        # A key of its own, derived from the hub's secret: a session cookie is never a
        # bearer token and the other way round.
        self._key = hashlib.sha256(b"forkd-ui-session\x00" + secret).digest()

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def issue(self, principal: Principal) -> str:
        payload = {
            "u": principal.user_id,
            "t": principal.token_id,
            "e": int(time.time()) + SESSION_TTL,
        }
        body = _b64(json.dumps(payload, separators=(",", ":")).encode())
        return f"{body}.{self._sign(body)}"

    def parse(self, cookie: str) -> tuple[int, int | None] | None:
        if not cookie or len(cookie) > 1024:
            return None
        body, _, sig = cookie.partition(".")
        if not hmac.compare_digest(self._sign(body), sig):
            return None
        try:
            payload = json.loads(_unb64(body))
            user, token, expires = payload["u"], payload["t"], payload["e"]
        except (ValueError, KeyError, TypeError, binascii.Error):
            return None
        if not isinstance(user, int) or not isinstance(expires, int) or expires < time.time():
            return None
        return user, token if isinstance(token, int) else None

    def csrf(self, cookie: str) -> str:
        return hmac.new(self._key, b"csrf\x00" + cookie.encode(), hashlib.sha256).hexdigest()[:32]

    def check_csrf(self, cookie: str, given: str) -> bool:
        return bool(cookie) and hmac.compare_digest(self.csrf(cookie), given or "")

    async def viewer(self, hub: Hub, request: Request[object, object, State]) -> Viewer:
        cookie = request.cookies.get(COOKIE, "")
        ids = self.parse(cookie)
        if ids is None:
            return Viewer(ANONYMOUS)
        principal = await hub.db.read(accounts.token_principal, *ids)
        if principal is None:  # user or token removed since: signed out
            return Viewer(ANONYMOUS)
        return Viewer(principal, self.csrf(cookie))
