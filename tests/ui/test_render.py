"""README sanitising, session cookies and redirect targets (no hub, no browser)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest
import ui_support  # noqa: F401  (makes forkd.hub importable under `python3 -m pytest`)

from forkd.hub.accounts import Principal
from forkd.hub.ui.common import local_path
from forkd.hub.ui.render import human_size, ratio, render_markdown
from forkd.hub.ui.session import Sessions


def _elements(html: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    """Every element the browser would build from ``html``, with its attributes."""
    found: list[tuple[str, list[tuple[str, str | None]]]] = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            found.append((tag, attrs))

    Collect().feed(html)
    return found


@pytest.mark.parametrize(
    "source",
    [
        "<script>alert(1)</script>",
        '<img src=x onerror="alert(1)">',
        "[x](javascript:alert(1))",
        "[x](JaVaScRiPt:alert(1))",
        "![x](javascript:alert(1))",
        '<a href="javascript:alert(1)">x</a>',
        "<iframe src=https://example.com></iframe>",
        "<svg onload=alert(1)>",
        '<div style="background:url(javascript:alert(1))">x</div>',
        "[x](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
        "<details open ontoggle=alert(1)>",
    ],
)
def test_markdown_cannot_run_script(source: str) -> None:
    tags = _elements(render_markdown(source))
    for tag, attrs in tags:
        assert tag not in ("script", "iframe", "svg", "object", "embed", "style", "details"), tags
        for name, value in attrs:
            assert not name.startswith("on") and name != "style", tags
            assert not (value or "").strip().lower().startswith(("javascript:", "data:")), tags


def test_markdown_keeps_what_a_readme_needs() -> None:
    html = render_markdown(
        "# Title\n\nSome **bold** and `code`.\n\n- a\n- b\n\n"
        "```\nforkd fork x -n 4\n```\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
        "[docs](https://example.com/docs) ![logo](https://example.com/logo.png)\n"
    )
    for good in ("<h1>Title</h1>", "<strong>bold</strong>", "<code>code</code>", "<li>a</li>",
                 "<pre><code>forkd fork x -n 4", "<table>", "<td>1</td>",
                 'href="https://example.com/docs"', 'rel="nofollow noopener noreferrer"',
                 '<a href="https://example.com/logo.png" '
                 'rel="nofollow noopener noreferrer">logo</a>'):  # fmt: skip
        assert good in html, (good, html)


def test_session_cookie_is_signed_and_expires() -> None:
    sessions = Sessions(b"secret")
    cookie, row = sessions.issue(Principal(7, "alice", False, None, 3, "s" * 32))
    claims = sessions.parse(cookie)
    assert claims is not None
    assert (claims.user_id, claims.token_id, claims.stamp) == (7, 3, "s" * 32)
    assert (row.user_id, row.token_id, row.id_hash) == (7, 3, claims.id_hash)
    body, _, sig = cookie.partition(".")
    assert sessions.parse(f"{body}x.{sig}") is None
    assert sessions.parse(cookie + "x") is None
    assert Sessions(b"other").parse(cookie) is None
    assert sessions.parse("") is None and sessions.parse("a" * 5000) is None
    assert sessions.check_csrf(cookie, sessions.csrf(cookie))
    assert not sessions.check_csrf(cookie, "0" * 32)
    assert not sessions.check_csrf("", sessions.csrf(""))


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/alice/devbox", "/alice/devbox"),
        ("//evil.example/x", "/"),
        ("https://evil.example/", "/"),
        ("/\\evil.example", "/"),
        ("", "/"),
        (None, "/"),
    ],
)
def test_redirects_stay_on_the_hub(target: str | None, expected: str) -> None:
    assert local_path(target) == expected


def test_display_filters() -> None:
    assert human_size(None) == "—" and human_size(512) == "512 B"
    assert human_size(8 << 20) == "8.0 MiB"
    assert ratio(8 << 20, 2 << 20) == "4.0×" and ratio(1, 0) == "—"
