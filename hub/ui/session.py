"""The browser session: a signed cookie naming a session stored on the server, its user
(and the API token, when someone signed in with one) and their stamp, re-checked against
the database on every request.

Cookie: ``forkd_session = b64(json{u, t, p, e, n}) . b64(hmac-sha256)``, HttpOnly,
SameSite=Lax, Secure behind HTTPS. ``n`` is the session's random id; the hub stores its
sha256 in ``ui_sessions``, and sign-out deletes that row, so a copied cookie dies with
the session. ``p`` is ``accounts.principal_stamp``: removing the user or token, or
changing the password, ends every session of theirs even where an id came back.

Forms that change state carry a CSRF token derived from the cookie (HMAC), so another
site cannot post them.

Over HTTPS (the request's scheme, or an https ``public_url``) every cookie's name has the
``__Host-`` prefix (and so ``Secure``, ``Path=/`` and no ``Domain``), and the hub reads
only the prefixed names there: a browser takes a ``__Host-`` cookie from this host alone,
so a neighbouring host of the same site (``other.example.com`` next to
``hub.example.com``) cannot set one (a ``Domain=example.com`` cookie of the plain name
is never read). Without it such a host tossed in its own ``forkd_login`` nonce, whose
form field it had read from the sign-in page, and signed a visitor into its account
("login CSRF" by cookie injection), or its own session cookie.

Before there is a session, the sign-in form is guarded the same way: its GET sets a
short-lived random cookie ``forkd_login = EXPIRY.RANDOM`` (path ``/-/signin``) and the
form carries its HMAC; a POST without the matching pair is refused. So another site
cannot sign a visitor into its own account ("login CSRF").

A new token's secret is shown once, on the GET after the form's POST (Post/Redirect/Get):
the POST puts it in a cookie ``forkd_new_token = b64(nonce + AES-GCM(json{s, n, e}))``,
encrypted with a key of its own and bound to the session cookie (associated data),
HttpOnly, path ``/-/settings/tokens``, a browser-session cookie whose content expires
after a few minutes; the page that shows it clears it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from litestar import Request
from litestar.datastructures import State
from sqlalchemy.orm import Session

from forkd.hub import accounts
from forkd.hub.accounts import ANONYMOUS, Principal
from forkd.hub.models import UiSession, utcnow
from forkd.hub.services import Hub

COOKIE = "forkd_session"
SESSION_TTL = 12 * 3600
LOGIN_COOKIE = "forkd_login"
LOGIN_PATH = "/-/signin"
LOGIN_TTL = 30 * 60
NEW_TOKEN_COOKIE = "forkd_new_token"
NEW_TOKEN_PATH = "/-/settings/tokens"
NEW_TOKEN_TTL = 5 * 60


HOST_PREFIX = "__Host-"


def over_https(request: Request[object, object, State]) -> bool:
    """Whether the browser reaches the hub over HTTPS: the request's scheme, or an https
    ``public_url`` (a TLS-terminating proxy forwards plain HTTP)."""
    public_url: str = request.app.state.hub.settings.public_url
    return request.url.scheme == "https" or urlsplit(public_url).scheme == "https"


def cookie_name(request: Request[object, object, State], base: str) -> str:
    """The name the cookie ``base`` has for this request: ``__Host-`` + ``base`` over
    HTTPS (only this host can set it), else ``base``."""
    return HOST_PREFIX + base if over_https(request) else base


def cookie_path(request: Request[object, object, State], path: str) -> str:
    """The path a cookie is set with: ``/`` over HTTPS (``__Host-`` requires it)."""
    return "/" if over_https(request) else path


def read_cookie(request: Request[object, object, State], base: str) -> str:
    """The value of the cookie ``base`` under its name for this request ("" if absent):
    over HTTPS the ``__Host-`` one only, never a plain one another host may have set."""
    return request.cookies.get(cookie_name(request, base), "")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _same(expected: str, given: str) -> bool:
    """Constant-time comparison that also takes non-ASCII input (which is never equal)."""
    return hmac.compare_digest(expected.encode(), given.encode())


def _seal(payload: dict[str, Any], sign: Callable[[str], str]) -> str:
    """``b64(json) . signature``: a value the browser keeps and cannot forge."""
    body = _b64(json.dumps(payload, separators=(",", ":")).encode())
    return f"{body}.{sign(body)}"


def _open(value: str, limit: int, sign: Callable[[str], str]) -> dict[str, Any] | None:
    """The payload of a ``_seal``ed value when its signature matches and its expiry ``e``
    has not passed; None for anything else (too long, forged, expired, malformed)."""
    if not value or len(value) > limit:
        return None
    body, _, sig = value.partition(".")
    if not _same(sign(body), sig):
        return None
    try:
        return _fresh(_unb64(body))
    except (ValueError, binascii.Error):
        return None


def _fresh(text: bytes) -> dict[str, Any] | None:
    """A JSON object whose expiry ``e`` (Unix time) has not passed, else None."""
    try:
        payload = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(payload, dict):
        return None
    expires = payload.get("e")
    if not isinstance(expires, int) or expires < time.time():
        return None
    return payload


@dataclass(frozen=True)
class Claims:
    """What a valid session cookie says."""

    user_id: int
    token_id: int | None
    stamp: str
    id_hash: str  # sha256 of the session id: the ``ui_sessions`` row


def session_id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


def session_principal(session: Session, claims: Claims, now: datetime) -> Principal | None:
    """The principal of a session that is still open on the server, else None."""
    row = session.get(UiSession, claims.id_hash)
    if row is None or row.user_id != claims.user_id or row.token_id != claims.token_id:
        return None
    if accounts.aware(row.expires_at) <= now:
        return None
    return accounts.token_principal(session, claims.user_id, claims.token_id, claims.stamp)


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
        self.rekey(secret)

    def rekey(self, secret: bytes) -> None:
        """Derive the keys from ``secret`` (the hub's shared key, loaded at start)."""
        # A key of its own, derived from the hub's secret: a session cookie is never a
        # bearer token and the other way round.
        self._key = hashlib.sha256(b"forkd-ui-session\x00" + secret).digest()
        self._new_token_aead = AESGCM(
            hmac.new(self._key, b"new-token-key", hashlib.sha256).digest()
        )

    def _sign(self, body: str) -> str:
        return _b64(hmac.new(self._key, body.encode(), hashlib.sha256).digest())

    def issue(self, principal: Principal) -> tuple[str, UiSession]:
        """A new session's cookie and the row to store for it (the caller adds it)."""
        assert principal.user_id is not None
        session_id = secrets.token_urlsafe(24)
        expires = int(time.time()) + SESSION_TTL
        payload = {
            "u": principal.user_id,
            "t": principal.token_id,
            "p": principal.stamp,
            "e": expires,
            # Random: names the server-side row; two sessions never share a cookie.
            "n": session_id,
        }
        row = UiSession(
            id_hash=session_id_hash(session_id),
            user_id=principal.user_id,
            token_id=principal.token_id,
            expires_at=datetime.fromtimestamp(expires, UTC),
        )
        return _seal(payload, self._sign), row

    def parse(self, cookie: str) -> Claims | None:
        payload = _open(cookie, 1024, self._sign)
        if payload is None:
            return None
        user, token = payload.get("u"), payload.get("t")
        stamp, session_id = payload.get("p"), payload.get("n")
        if not isinstance(user, int) or not isinstance(stamp, str):
            return None
        if not isinstance(session_id, str) or not session_id:
            return None
        return Claims(
            user, token if isinstance(token, int) else None, stamp, session_id_hash(session_id)
        )

    def _mac(self, purpose: bytes, value: str) -> str:
        mac = hmac.new(self._key, purpose + b"\x00" + value.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]

    def csrf(self, cookie: str) -> str:
        return self._mac(b"csrf", cookie)

    def check_csrf(self, cookie: str, given: str) -> bool:
        return bool(cookie) and _same(self.csrf(cookie), given or "")

    # -- the sign-in form, before there is a session -------------------------
    @staticmethod
    def login_nonce() -> str:
        """A new value for the ``forkd_login`` cookie: its expiry and 144 random bits."""
        return f"{int(time.time()) + LOGIN_TTL}.{secrets.token_urlsafe(18)}"

    def login_csrf(self, nonce: str) -> str:
        """The sign-in form's hidden field for the ``forkd_login`` cookie ``nonce``."""
        return self._mac(b"login-csrf", nonce)

    def check_login_csrf(self, nonce: str, given: str) -> bool:
        expires, _, rand = nonce.partition(".")
        if not rand or len(nonce) > 128 or not (expires.isascii() and expires.isdigit()):
            return False
        if int(expires) < time.time():
            return False
        return _same(self.login_csrf(nonce), given or "")

    # -- a new token's secret, from the POST to the GET that shows it once ---
    def seal_new_token(self, session_cookie: str, secret: str, owner: str) -> str:
        """The new token's secret for the ``forkd_new_token`` cookie: encrypted (AES-GCM, a
        key of its own) and bound to this session cookie, so it is readable by this hub
        for this session only, and only for ``NEW_TOKEN_TTL`` seconds."""
        payload = {"s": secret, "n": owner, "e": int(time.time()) + NEW_TOKEN_TTL}
        nonce = secrets.token_bytes(12)
        plain = json.dumps(payload, separators=(",", ":")).encode()
        return _b64(nonce + self._new_token_aead.encrypt(nonce, plain, session_cookie.encode()))

    def open_new_token(self, session_cookie: str, sealed: str) -> tuple[str, str] | None:
        """(secret, owner) from ``seal_new_token``, for the same session, while fresh."""
        if not session_cookie or not sealed or len(sealed) > 2048:
            return None
        try:
            raw = _unb64(sealed)
            plain = self._new_token_aead.decrypt(raw[:12], raw[12:], session_cookie.encode())
        except (ValueError, binascii.Error, InvalidTag):
            return None
        payload = _fresh(plain)
        if payload is None:
            return None
        secret, owner = payload.get("s"), payload.get("n")
        if not (isinstance(secret, str) and isinstance(owner, str)):
            return None
        return secret, owner

    async def viewer(self, hub: Hub, request: Request[object, object, State]) -> Viewer:
        cookie = read_cookie(request, COOKIE)
        claims = self.parse(cookie)
        if claims is None:
            return Viewer(ANONYMOUS)
        principal = await hub.db.read(session_principal, claims, utcnow())
        if principal is None:  # signed out, or user or token removed since
            return Viewer(ANONYMOUS)
        return Viewer(principal, self.csrf(cookie))
