"""The catalog web UI in Debian's Chromium (Playwright), against a seeded real hub."""

from __future__ import annotations

from typing import Any

import httpx
from ui_support import ALICE, BOB, Seeded, shoot


def sign_in(page: Any, base: str, who: tuple[str, str], next_path: str = "/") -> None:
    page.goto(f"{base}/-/signin?next={next_path}")
    page.fill("input[name=username]", who[0])
    page.fill("input[name=password]", who[1])
    page.click("form.stack button[type=submit]")
    page.wait_for_load_state()


def assert_post_redirect_get(page: Any, response: Any, url: str) -> None:
    """The form's POST answered 303 and the page shown is the GET of ``url``."""
    assert page.url == url
    assert response.request.method == "GET" and response.status == 200
    posted = response.request.redirected_from
    assert posted is not None and posted.method == "POST"
    assert posted.response().status == 303


def assert_reload_is_get(page: Any) -> None:
    """Reloading the page sends a GET (not the form's POST again)."""
    methods: list[str] = []

    def record(request: Any) -> None:
        if request.is_navigation_request():
            methods.append(request.method)

    page.on("request", record)
    try:
        resp = page.reload()
    finally:
        page.remove_listener("request", record)
    assert resp is not None and resp.status == 200
    assert methods == ["GET"]


def texts(page: Any, selector: str) -> list[str]:
    return [t.strip() for t in page.locator(selector).all_inner_texts()]


def test_home_pack_and_tag_pages(seeded: Seeded, page: Any) -> None:
    base = seeded.hub.url
    page.goto(base + "/")
    assert page.title() == "forkd hub"
    assert "alice/devbox" in texts(page, ".columns section:nth-child(1) .pack-name")
    assert texts(page, ".columns section:nth-child(2) .pack-name")[0] == "alice/devbox"  # 3 pulls
    assert "alice/secret-lab" not in page.content()  # private, signed out
    shoot(page, "home")

    page.get_by_role("link", name="alice/devbox", exact=True).first.click()
    page.wait_for_url(f"{base}/alice/devbox")
    assert page.get_by_test_id("pack-name").inner_text().startswith("alice/devbox")
    assert page.get_by_test_id("description").inner_text() == "A warm Python dev box"
    # The newest push (no `latest` tag) is the one the pull command names.
    pull = page.get_by_test_id("pull-command").inner_text()
    assert pull == f"forkd pull {seeded.hub.address}/alice/devbox:flat"
    assert page.locator("button.copy-btn").is_visible()  # revealed by the copy script
    rows = page.locator("[data-testid=tags-table] tbody tr")
    table = {
        r.locator("td").nth(0).inner_text(): [c.strip() for c in r.locator("td").all_inner_texts()]
        for r in rows.all()
    }
    assert sorted(table) == ["base", "d1", "d2", "flat"]
    assert table["d2"][1] == seeded.digests["d2"].split(":")[1][:12]
    assert table["d2"][2] == "8.0 MiB"  # logical memory size
    assert [table[t][4].split()[0] for t in ("base", "d1", "d2", "flat")] == ["0", "1", "2", "0"]
    assert "compacted" in table["flat"][4]
    assert [table[t][6] for t in ("base", "d1", "d2", "flat")] == ["0", "0", "3", "0"]  # pulls
    compat = page.get_by_test_id("compat").inner_text()
    for fact in ("qemu 8.2.2", "pc-q35-8.2", "max", "kvm, tcg", "runs without KVM", "8 MiB"):
        assert fact in compat
    shoot(page, "pack")

    page.get_by_test_id("tags-table").get_by_role("link", name="d2", exact=True).click()
    page.wait_for_url(f"{base}/alice/devbox/-/tags/d2")
    assert page.get_by_test_id("tag-name").inner_text() == "alice/devbox:d2"
    assert (
        page.get_by_test_id("pull-command").inner_text()
        == f"forkd pull {seeded.hub.address}/alice/devbox:d2"
    )
    layers = page.locator("[data-testid=layers-table] tbody tr")
    assert layers.count() == 3  # d2 → d1 → base
    kinds = [r.locator("td").nth(1).inner_text() for r in layers.all()]
    assert kinds == ["diff", "diff", "flat"]
    assert "×" in page.locator("[data-testid=layers-table] tfoot").inner_text()
    shoot(page, "tag")


def test_lineage_graph_links(seeded: Seeded, page: Any) -> None:
    base = seeded.hub.url
    page.goto(f"{base}/alice/devbox/-/tags/d2")
    graph = page.get_by_test_id("lineage")
    assert graph.evaluate("el => el.tagName") == "svg"
    for tag in ("base", "d1", "d2", "flat"):
        assert page.get_by_test_id(f"node-{tag}").count() == 1
    assert page.locator("svg line.edge.parent").count() == 2
    assert page.locator("svg line.edge.compaction").count() == 1  # d2 ⇢ flat

    page.get_by_test_id("node-base").click()
    page.wait_for_url(f"{base}/alice/devbox/-/tags/base")
    assert "Descendants: 2" in page.inner_text(".lineage-text")
    assert page.locator("[data-testid=layers-table] tbody tr").count() == 1

    page.get_by_test_id("node-flat").click()
    page.wait_for_url(f"{base}/alice/devbox/-/tags/flat")
    assert "Compaction links: 1" in page.inner_text(".lineage-text")
    assert page.get_by_test_id("node-d2").count() == 1  # where it was flattened from
    assert page.locator("[data-testid=layers-table] tbody tr").count() == 1
    shoot(page, "lineage-compacted")

    page.get_by_test_id("node-d1").click()
    page.wait_for_url(f"{base}/alice/devbox/-/tags/d1")
    assert page.get_by_test_id("tag-name").inner_text() == "alice/devbox:d1"


def test_search_filters_and_pagination(seeded: Seeded, page: Any) -> None:
    base = seeded.hub.url

    def results() -> list[str]:
        return texts(page, ".results .pack-name")

    page.goto(base + "/")
    page.fill(".big-search input[name=q]", "devbox")
    page.click(".big-search button")
    page.wait_for_url("**/-/search?q=devbox")
    assert results() == ["alice/devbox"]

    page.goto(base + "/-/search")
    assert sorted(results()) == ["acme/fc-tool", "alice/devbox"]  # not the private one
    page.select_option("select[name=vmm]", "firecracker")
    page.click(".filters button")
    page.wait_for_load_state()
    assert results() == ["acme/fc-tool"]

    page.goto(base + "/-/search")
    page.check("input[name=nokvm]")
    page.click(".filters button")
    page.wait_for_load_state()
    assert results() == ["alice/devbox"]
    assert page.is_checked("input[name=nokvm]")
    shoot(page, "search")

    page.goto(base + "/-/search?chain=1")
    assert results() == ["alice/devbox"]
    page.goto(base + "/-/search?namespace=acme")
    assert results() == ["acme/fc-tool"]

    page.goto(base + "/-/search?per_page=1&sort=name")
    assert results() == ["acme/fc-tool"]
    assert "page 1 of 2" in page.inner_text(".pager")
    page.click("a[rel=next]")
    page.wait_for_load_state()
    assert results() == ["alice/devbox"]
    assert "page 2 of 2" in page.inner_text(".pager")
    page.click("a[rel=prev]")
    page.wait_for_load_state()
    assert results() == ["acme/fc-tool"]

    page.goto(base + "/-/search?q=no-such-thing")
    assert page.get_by_test_id("empty-search").is_visible()
    assert page.get_by_test_id("result-count").inner_text() == "0 packs"
    shoot(page, "search-empty")

    # Untrusted input is checked, and refused with a page.
    resp = page.goto(base + "/-/search?namespace=Bad..NS")
    assert resp is not None and resp.status == 400
    assert page.get_by_test_id("error").is_visible()


def test_private_pack_needs_sign_in(seeded: Seeded, page: Any) -> None:
    base = seeded.hub.url
    resp = page.goto(f"{base}/alice/secret-lab")
    assert resp is not None and resp.status == 404
    assert "sign in" in page.get_by_test_id("error").inner_text()
    shoot(page, "not-found-private")
    page.goto(base + "/-/search?q=secret")
    assert page.get_by_test_id("empty-search").is_visible()

    page.click("text=Sign in >> nth=0")
    page.wait_for_url("**/-/signin**")
    page.fill("input[name=username]", ALICE[0])
    page.fill("input[name=password]", "wrong-password")
    page.click("form.stack button[type=submit]")
    assert "Wrong user name or password" in page.inner_text("p.error")
    shoot(page, "signin")

    sign_in(page, base, ALICE, "/alice/secret-lab")
    page.wait_for_url(f"{base}/alice/secret-lab")
    assert page.get_by_test_id("pack-name").inner_text().startswith("alice/secret-lab")
    assert "private" in page.get_by_test_id("pack-name").inner_text()
    page.goto(base + "/-/search?q=secret")
    assert texts(page, ".results .pack-name") == ["alice/secret-lab"]
    page.goto(base + "/alice")
    assert "alice/secret-lab" in texts(page, ".pack-name")

    # Its owner edits description and README in the page.
    page.goto(f"{base}/alice/secret-lab")
    page.click("text=Edit description and README")
    page.fill("input[name=description]", "Lab notes")
    page.fill("textarea[name=readme]", "## Notes\n\nOnly for **alice**.")
    page.click(".edit button[type=submit]")
    page.wait_for_url(f"{base}/alice/secret-lab")
    assert page.get_by_test_id("description").inner_text() == "Lab notes"
    assert page.get_by_test_id("readme").locator("h2 >> nth=1").inner_text() == "Notes"
    assert page.get_by_test_id("readme").locator("strong").inner_text() == "alice"

    page.click("text=Sign out")
    page.wait_for_url(base + "/")
    assert page.goto(f"{base}/alice/secret-lab").status == 404  # type: ignore[union-attr]

    sign_in(page, base, BOB, "/alice/secret-lab")  # signed in, not a member: still 404
    assert page.get_by_test_id("error").is_visible()


def test_readme_xss_is_inert(seeded: Seeded, page: Any) -> None:
    dialogs: list[str] = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.goto(f"{seeded.hub.url}/alice/devbox")
    readme = page.get_by_test_id("readme")
    assert readme.locator("h1").inner_text() == "Dev box"
    assert readme.locator("table th").first.inner_text() == "pages"
    # The attempts show as text, never as elements or handlers.
    assert "<script>" in readme.inner_text()
    assert readme.locator("script").count() == 0
    assert readme.locator("img").count() == 0
    assert readme.locator("[onerror], [onclick], [onload]").count() == 0
    assert readme.locator("a[href^='javascript']").count() == 0
    page.wait_for_timeout(300)  # give any stray handler its chance
    assert page.evaluate("window.__pwned") is None
    assert dialogs == []
    shoot(page, "readme-xss")


def test_tokens_robots_and_team(seeded: Seeded, page: Any) -> None:
    base = seeded.hub.url
    sign_in(page, base, ALICE, "/-/settings/tokens")
    page.wait_for_url(f"{base}/-/settings/tokens")
    form = page.locator("form[aria-label='New token']")
    form.locator("input[name=name]").fill("laptop")
    form.locator("input[name=scopes]").fill("alice:pull")
    with page.expect_navigation() as nav:
        form.locator("button").click()
    assert_post_redirect_get(page, nav.value, f"{base}/-/settings/tokens")
    secret = page.get_by_test_id("token-secret").inner_text()
    assert secret.startswith("fkd_")
    assert "laptop" in page.get_by_test_id("my-tokens").inner_text()
    v2 = f"{base}/v2/"
    assert httpx.get(v2, auth=(ALICE[0], secret)).status_code == 200
    shoot(page, "tokens")
    mine = page.locator("[data-testid=my-tokens] tbody tr")
    assert mine.count() == 1
    # Reloading is a GET: the secret is gone and no second token was made.
    assert_reload_is_get(page)
    assert page.get_by_test_id("new-token").count() == 0 and secret not in page.content()
    assert mine.count() == 1

    page.locator("[data-testid=my-tokens] tr:has-text('laptop') button").click()
    page.wait_for_url(f"{base}/-/settings/tokens")
    assert page.get_by_test_id("my-tokens").count() == 0
    assert httpx.get(v2, auth=(ALICE[0], secret)).status_code == 401

    robots = page.locator("form[aria-label='New robot token']")
    robots.locator("select[name=namespace]").select_option("acme")
    robots.locator("input[name=robot]").fill("ci")  # the robot acme+ci (hub review 25)
    robots.locator("select[name=role]").select_option("push")
    with page.expect_navigation() as nav:
        robots.locator("button").click()
    assert_post_redirect_get(page, nav.value, f"{base}/-/settings/tokens")
    robot_secret = page.get_by_test_id("token-secret").inner_text()
    assert "acme+ci" in page.get_by_test_id("new-token").inner_text()
    assert httpx.get(v2, auth=("acme+ci", robot_secret)).status_code == 200
    robot_tokens = page.locator("[data-testid='robot-tokens-acme+ci'] tbody tr")
    assert robot_tokens.count() == 1
    assert_reload_is_get(page)
    assert page.get_by_test_id("new-token").count() == 0 and robot_secret not in page.content()
    assert robot_tokens.count() == 1

    page.goto(f"{base}/acme")
    team = page.get_by_test_id("team")
    assert "acme+ci" in team.inner_text() and "bob" in team.inner_text()
    row = team.locator("tr:has-text('bob')")
    row.locator("select").select_option("push")
    row.locator("button").click()
    page.wait_for_url(f"{base}/acme")
    assert page.get_by_test_id("team").locator("tr:has-text('bob') select").input_value() == "push"
    add = page.locator("form[aria-label='Add member']")
    add.locator("input[name=username]").fill("admin")
    add.locator("select[name=role]").select_option("pull")
    add.locator("button").click()
    page.wait_for_url(f"{base}/acme")
    assert "admin" in texts(page, "[data-testid=team] tbody td:first-child")
    shoot(page, "org-team")

    # A member who is not an admin sees the team, without the forms.
    page.click("text=Sign out")
    sign_in(page, base, BOB, "/acme")
    page.wait_for_url(f"{base}/acme")
    assert page.get_by_test_id("team").is_visible()
    assert page.locator("form[aria-label='Add member']").count() == 0
    teams = page.get_by_test_id("teams").inner_text()
    assert "builders" in teams and "acme/fc-*" in teams and "bob" in teams
    shoot(page, "org-teams")
    # Forged form posts without the session's CSRF token are refused.
    resp = page.request.post(
        f"{base}/-/members/acme", form={"username": "bob", "role": "admin", "csrf": "x"}
    )
    assert resp.status == 403
    # Signed out, an organisation shows its packs, not its members or teams.
    page.click("text=Sign out")
    page.goto(f"{base}/acme")
    assert page.get_by_test_id("team").count() == 0 and page.get_by_test_id("teams").count() == 0


def test_errors_and_empty_states(seeded: Seeded, page: Any, empty_hub: Any) -> None:
    resp = page.goto(f"{seeded.hub.url}/nobody/nothing")
    assert resp is not None and resp.status == 404
    assert "no pack named nobody/nothing" in page.get_by_test_id("error").inner_text()
    shoot(page, "not-found")
    assert page.goto(f"{seeded.hub.url}/alice/devbox/-/tags/nope").status == 404  # type: ignore[union-attr]
    assert page.goto(f"{seeded.hub.url}/-/nowhere").status == 404  # type: ignore[union-attr]
    assert page.get_by_test_id("error").is_visible()
    assert page.goto(f"{seeded.hub.url}/nobody").status == 404  # type: ignore[union-attr]
    assert page.goto(f"{seeded.hub.url}/-/search?page=0").status == 400  # type: ignore[union-attr]
    assert page.get_by_test_id("error").is_visible()

    page.goto(empty_hub.url + "/")
    assert page.get_by_test_id("empty-hub").is_visible()
    assert f"forkd push base {empty_hub.address}/NAMESPACE/NAME:TAG" in page.inner_text("pre")
    shoot(page, "empty-hub")


def test_browsing_without_javascript_on_a_phone(seeded: Seeded, browser: Any) -> None:
    context = browser.new_context(
        java_script_enabled=False, viewport={"width": 390, "height": 844}, is_mobile=True
    )
    try:
        page = context.new_page()
        page.goto(seeded.hub.url + "/")
        page.fill(".big-search input[name=q]", "fc")
        page.click(".big-search button")
        page.wait_for_load_state()
        page.get_by_role("link", name="acme/fc-tool", exact=True).click()
        page.wait_for_url(f"{seeded.hub.url}/acme/fc-tool")
        assert "firecracker" in page.get_by_test_id("compat").inner_text()
        page.goto(seeded.hub.url + "/alice/devbox")
        assert not page.locator("button.copy-btn").is_visible()  # the command is still shown
        assert "forkd pull" in page.get_by_test_id("pull-command").inner_text()
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"page is {overflow}px wider than the phone"
        shoot(page, "pack-phone")
    finally:
        context.close()
