"""Templates (Jinja, autoescaped), safe Markdown, and the display filters the pages share.

Pages are rendered here rather than through an app-wide template config, so the
whole UI is one router that ``create_app`` mounts with one line.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape
from pathlib import Path
from typing import Any

import anyio
import nh3
from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from litestar import Response
from litestar.enums import MediaType
from markdown_it import MarkdownIt
from markdown_it.renderer import RendererHTML
from markdown_it.token import Token
from markdown_it.utils import EnvType, OptionsDict
from markupsafe import Markup
from markupsafe import escape as escape_markup

from forkd import digest as dg
from forkd.hub.display import page_value
from forkd.hub.headers import PRIVATE
from forkd.hub.manifest_cache import SizedLRU
from forkd.units import human_bytes

TEMPLATES = Path(__file__).parent / "templates"
# No inline scripts or styles anywhere: the copy button's few lines live in /-/static/.
# img-src: the hub's own images, and the data: images a README may embed (no remote ones,
# which would tell another host who reads the page: render_markdown turns them into links).
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    # Pages depend on who is signed in: never from a shared cache.
    "Cache-Control": PRIVATE,
}
README_MAX = 256 * 1024
# What a README may contain after Markdown rendering; everything else is dropped.
README_TAGS = {
    "a", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
    "img", "li", "ol", "p", "pre", "s", "strong", "table", "tbody", "td", "th", "thead", "tr",
    "ul",
}  # fmt: skip
README_ATTRIBUTES = {"a": {"href", "title"}, "img": {"src", "alt", "title"}, "th": {"align"},
                     "td": {"align"}}  # fmt: skip

# The only images a README shows: raster data: URLs (no script can live in them). Any
# other image (remote: a tracking pixel; relative: a request to the hub with the reader's
# cookies) is rendered as a link to it, labelled with its alt text.
SAFE_IMAGE_RE = re.compile(r"^data:image/(?:png|gif|jpeg|webp);base64,[A-Za-z0-9+/=]*$")

_markdown = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")


def _image(
    self: RendererHTML, tokens: Sequence[Token], idx: int, options: OptionsDict, env: EnvType
) -> str:
    """Markdown images: inline for safe data: URLs, else a link (nothing is fetched)."""
    token = tokens[idx]
    src = str(token.attrGet("src") or "")
    if SAFE_IMAGE_RE.match(src):
        return self.image(tokens, idx, options, env)
    label = self.renderInlineAsText(token.children or [], options, env) or "image"
    return f'<a href="{escape(src)}">{escape(label)}</a>'


_markdown.add_render_rule("image", _image)


def _only_safe_urls(tag: str, attribute: str, value: str) -> str | None:
    """nh3's second look: an img keeps only a safe data: source, a link never has one."""
    if tag == "img" and attribute == "src":
        return value if SAFE_IMAGE_RE.match(value) else None
    if tag == "a" and attribute == "href" and value.strip().lower().startswith("data:"):
        return None
    return value


def render_markdown(text: str) -> str:
    """README Markdown → HTML that cannot run script or load anything from elsewhere.

    Two independent layers: markdown-it with raw HTML disabled (``<script>`` and
    ``onerror=`` come out as text, ``javascript:`` links are refused, images other than
    raster data: URLs become links), then nh3 (the ammonia sanitizer) keeps only an
    allow-list of tags, attributes and URL schemes.
    """
    html = _markdown.render(text[:README_MAX])
    return nh3.clean(
        html,
        tags=README_TAGS,
        attributes=README_ATTRIBUTES,
        url_schemes={"http", "https", "mailto", "data"},
        attribute_filter=_only_safe_urls,
        link_rel="nofollow noopener noreferrer",
    )


# Rendered READMEs kept, by the hash of their text: at most this many bytes of HTML.
README_CACHE_BYTES = 32 << 20
# READMEs rendered at once (worker threads): one pusher's costly texts wait for each
# other, never for the event loop.
README_RENDERERS = 1


class ReadmeCache:
    """READMEs rendered once per text, off the event loop.

    Some Markdown costs the parser time that grows faster than its length (256 KiB of
    ``[`` take seconds), and a pack page is a cheap anonymous GET: rendered on the event
    loop at every view, one README stalled the whole hub for every viewer. Here it is
    rendered in a worker thread (``README_RENDERERS`` at a time), once per text (a
    README is rendered again only when a pusher changes it), and a request wanting a
    text another request is rendering waits for it instead of rendering it again."""

    def __init__(self, limit: int = README_CACHE_BYTES, renderers: int = README_RENDERERS):
        self._items = SizedLRU[str](limit)
        self._lock = threading.Lock()
        self._rendering: dict[str, anyio.Event] = {}
        self._renderers = renderers
        self._limiter: anyio.CapacityLimiter | None = None

    async def html(self, text: str) -> str:
        """``render_markdown(text)``, from the cache or rendered in a worker thread."""
        key = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
        mine = anyio.Event()
        while True:
            with self._lock:
                hit = self._items.get(key)
                if hit is not None:
                    return hit
                waiting = self._rendering.get(key)
                if waiting is None:
                    self._rendering[key] = mine
                    break
            await waiting.wait()  # another request renders this text: take it from the cache
        try:
            if self._limiter is None:
                self._limiter = anyio.CapacityLimiter(self._renderers)
            html = await anyio.to_thread.run_sync(render_markdown, text, limiter=self._limiter)
            self._items.put(key, html)
            return html
        finally:
            with self._lock:
                del self._rendering[key]
            mine.set()


def human_size(n: int | None) -> str:
    return human_bytes(n, missing="—")


def when(ts: datetime | None) -> str:
    if ts is None:
        return "—"
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return aware.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def iso(ts: datetime | None) -> str:
    if ts is None:
        return ""
    aware = ts if ts.tzinfo else ts.replace(tzinfo=UTC)
    return aware.astimezone(UTC).isoformat(timespec="seconds")


def ratio(logical: int | None, stored: int | None) -> str:
    if not logical or not stored:
        return "—"
    return f"{logical / stored:.1f}×"


def verbatim(text: str) -> Markup:
    """``text`` HTML-escaped but otherwise as stored: a README's Markdown source in its
    edit form, prose in which bidi marks are the author's (an RTL language's), which
    ``page_value`` would write as escapes, and a save would then store."""
    return escape_markup(text)


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        # Every text a page shows, with its controls and bidi overrides escaped: rows
        # stored before the write checks (a token's name, a description, a team's glob)
        # and annotations no check covers are read back as stored (hub/display.py).
        finalize=page_value,
    )
    env.filters.update(
        bytes=human_size,
        when=when,
        iso=iso,
        short=dg.short,
        ratio=ratio,
        verbatim=verbatim,
    )
    return env


class Renderer:
    """One Jinja environment per app; ``page`` returns an HTML response with security headers."""

    def __init__(self) -> None:
        self.env = _environment()
        self.readmes = ReadmeCache()

    def html(self, template: str, **context: Any) -> str:
        return self.env.get_template(template).render(**context)

    def page(
        self,
        template: str,
        status: int = 200,
        headers: dict[str, str] | None = None,
        **context: Any,
    ) -> Response[str]:
        return Response(
            self.html(template, **context),
            status_code=status,
            media_type=MediaType.HTML,
            headers={**SECURITY_HEADERS, **(headers or {})},
        )
