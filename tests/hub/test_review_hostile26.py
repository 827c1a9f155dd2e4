"""Hostile review 26.

1. The UI's tokens page listed every robot its viewer manages, with every token of each,
   and checked each token's minter one by one (``authz.minter_stands``: three reads a
   token) after checking each robot (``authz.may_manage_robot``: three reads a robot).
   Any signed-in user makes 20 organisations of 100 robots with 100 tokens each, so one
   view of that user's page was hundreds of thousands of reads, at will; and a site
   admin manages every robot, so every user's robots were read on every view of the site
   admins' page. Now the page lists ``ROBOTS_PER_PAGE`` robots at a time (``robots_page``),
   which robots a viewer manages is one query (``authz.manageable_robots``, by the rule
   of ``may_manage_robot``), the page's tokens and minters are one query each, and each
   minter is checked once per robot.
"""

from __future__ import annotations

import re

import httpx
from hub_support import ADMIN, HubServer, browser, csrf_of, org_with_pusher, statements

from forkd.hub.ui.account import ROBOTS_PER_PAGE


def _robots_listed(page: httpx.Response) -> list[str]:
    """The robots a tokens page lists, in its order."""
    assert page.status_code == 200, page.text
    return re.findall(r"<h3>([^<]+)</h3>", page.text)


def test_the_tokens_page_lists_one_page_of_robots_in_bounded_reads(hub: HubServer) -> None:
    """Before: the tokens page listed every robot its viewer manages with all their tokens,
    about a dozen reads per robot (three per token), and the site admins' page every robot
    of the hub. Now it lists ``ROBOTS_PER_PAGE`` robots a page, by name, with links to the
    others, and reads their tokens in one query however many robots there are."""
    org, alice, _ = org_with_pusher(hub)
    names = [f"{org}+r{i:02d}" for i in range(ROBOTS_PER_PAGE + 3)]
    with browser(hub, *alice) as b:
        csrf = csrf_of(b.get("/-/settings/tokens").text)
        for name in names:
            for _ in range(2):
                data = {"csrf": csrf, "namespace": org, "robot": name, "role": "push"}
                r = b.post("/-/settings/robots", data=data)
                assert r.status_code == 303, r.text
        with statements() as seen:
            first = b.get("/-/settings/tokens")
        assert _robots_listed(first) == names[:ROBOTS_PER_PAGE]
        assert 'href="/-/settings/tokens?robots_page=2"' in first.text
        token_reads = [s for s in seen if "from api_tokens" in s]
        assert len(token_reads) <= 2, token_reads  # the viewer's own, the page's robots'
        second = b.get("/-/settings/tokens", params={"robots_page": 2})
        assert _robots_listed(second) == names[ROBOTS_PER_PAGE:]
        assert 'href="/-/settings/tokens"' in second.text  # back to the first page
        assert second.text.count("Revoke</button>") >= 2 * 3  # every token of the page
        assert b.get("/-/settings/tokens", params={"robots_page": 3}).status_code == 404
        assert b.get("/-/settings/tokens", params={"robots_page": "0"}).status_code == 400
    with browser(hub, *ADMIN) as b, statements() as seen:
        page = b.get("/-/settings/tokens")
    assert len(_robots_listed(page)) == ROBOTS_PER_PAGE  # the hub has more: in pages
    assert len([s for s in seen if "from api_tokens" in s]) <= 2
