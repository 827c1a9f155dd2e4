"""Headers every answer of the hub carries, set in one place (an ASGI middleware) rather
than by each route.

- ``X-Content-Type-Options: nosniff`` on every answer: blobs and manifests set it
  themselves, but the tag lists, referrers (an OCI index of annotations a pusher wrote),
  ``_catalog``, ``/api/v1`` JSON (a README's text) and errors did not, so a browser was
  free to guess what they were.
- ``Cache-Control: private, no-cache`` on every answer to a request that carried a
  credential (an ``Authorization`` header, or cookies: the UI's session) and set no
  ``Cache-Control`` of its own. Those answers are the caller's: a private repository's
  manifests, blobs, tags and referrers, the listings of what the caller may see, its
  tokens' names and scopes. Without the header a caching proxy in front of the hub
  (nginx ``proxy_cache_valid``, a CDN, which key on the URL and not on who asked) kept
  them and served them to the next client of that URL, anonymous or of another
  organisation, without the hub ever being asked. An answer to an anonymous request
  holds nothing private (public repositories only) and stays cacheable: a CDN in front
  of public packs still works.
- ``Vary: Authorization, Cookie`` on every answer (added to a route's own ``Vary``): what
  the hub answers at one URL depends on who asks, so a cache that keeps the anonymous
  answer (a public repository's listing) must not hand it to a logged-in client, nor
  the other way round; caches that ignore ``Cache-Control: private`` still key on it.
"""

from __future__ import annotations

from typing import Any

# What an answer for one caller says to caches: only that caller's own (a browser) may
# keep it, and asks again before using it. The UI's pages send the same.
PRIVATE = "private, no-cache"
NOSNIFF = "nosniff"
_CREDENTIALS = (b"authorization", b"cookie")
VARY = ("Authorization", "Cookie")


def with_vary(value: str) -> str:
    """``value`` (a route's own ``Vary``, maybe empty) with ``VARY`` added, each once."""
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if "*" in tokens:
        return "*"
    held = {t.lower() for t in tokens}
    return ", ".join(tokens + [t for t in VARY if t.lower() not in held])


class AnswerHeaders:
    """ASGI middleware: adds ``X-Content-Type-Options: nosniff`` and ``Vary`` to every
    answer, and ``Cache-Control: private, no-cache`` to an answer to a request with
    credentials, where the route set neither (a route's own value, such as ``no-store``
    on a secret, is kept)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        private = any(name.lower() in _CREDENTIALS for name, _ in scope.get("headers", ()))

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                given = list(message.get("headers", ()))
                varies = [v.decode("latin-1") for n, v in given if n.lower() == b"vary"]
                headers = [(n, v) for n, v in given if n.lower() != b"vary"]
                present = {name.lower() for name, _ in headers}
                headers.append((b"vary", with_vary(", ".join(varies)).encode("latin-1")))
                if b"x-content-type-options" not in present:
                    headers.append((b"x-content-type-options", NOSNIFF.encode()))
                if private and b"cache-control" not in present:
                    headers.append((b"cache-control", PRIVATE.encode()))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
