"""Browsing: home, search, organisation/user pages, pack pages, tag pages."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlencode

from litestar import Controller, Response, get
from litestar.di import NamedDependency
from litestar.exceptions import NotFoundException, ValidationException
from litestar.params import FromPath, Parameter
from sqlalchemy import func, select

from forkd import digest as dg
from forkd.errors import InvalidInput
from forkd.hub import accounts, authz
from forkd.hub.models import Repository
from forkd.hub.params import (
    PAGES_MAX,
    QueryNumber,
    SortText,
    page_of,
    parse_sort,
    query_number,
)
from forkd.hub.services import Hub
from forkd.hub.ui import queries
from forkd.hub.ui.common import UI, HubRequest, base_context, checked_query, invalid, viewer
from forkd.hub.ui.errors import HTML_ERRORS
from forkd.names import validate_name, validate_tag

PER_PAGE = 20
# Packs per page of an organisation's or user's page: a namespace holds up to
# ``repositories_max`` (10 000 by default), and each page view was every one of them.
NAMESPACE_PER_PAGE = 50
SEARCH_PAGES = 10_000  # the last page of search results served
FEATURED = 6
VMMS = ("qemu", "firecracker")


class BrowseController(Controller):
    exception_handlers = HTML_ERRORS
    include_in_schema = False

    @get("/")
    async def home(
        self, request: HubRequest, hub: NamedDependency[Hub], ui: NamedDependency[UI]
    ) -> Response[str]:
        who = await viewer(ui, hub, request)
        recent, total = await queries.search(
            hub, ui.facts, who.principal, queries.Filters(sort="updated"), 1, FEATURED
        )
        popular, _ = await queries.search(
            hub, ui.facts, who.principal, queries.Filters(sort="pulls"), 1, FEATURED
        )
        return ui.renderer.page(
            "home.html",
            **base_context(ui, hub, request, who),
            recent=recent,
            popular=popular,
            total=total,
        )

    @get("/-/search")
    async def search(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        q: Annotated[str | None, Parameter(max_length=100)] = None,
        namespace: Annotated[str | None, Parameter(max_length=255)] = None,
        vmm: Annotated[str | None, Parameter(max_length=32)] = None,
        nokvm: Annotated[str | None, Parameter(max_length=8)] = None,
        chain: Annotated[str | None, Parameter(max_length=8)] = None,
        sort: SortText = "updated",
        page: QueryNumber = None,
        per_page: QueryNumber = None,
    ) -> Response[str]:
        pages = page_of(page, per_page, PER_PAGE, 100, SEARCH_PAGES)
        order = parse_sort(sort)
        who = await viewer(ui, hub, request)
        text = checked_query(q)
        ns = (namespace or "").strip()
        if ns:
            try:
                accounts.validate_namespace(ns)
            except InvalidInput as exc:
                raise invalid(exc) from exc
        if vmm and vmm not in VMMS:
            raise ValidationException(f"unknown VMM {vmm[:32]!r}: use one of {', '.join(VMMS)}")
        filters = queries.Filters(
            q=text,
            namespace=ns,
            vmm=vmm or "",
            without_kvm=bool(nokvm),
            chain=bool(chain),
            sort=order,
        )
        items, total = await queries.search(
            hub, ui.facts, who.principal, filters, pages.number, pages.size
        )
        params: dict[str, Any] = {
            k: v
            for k, v in {
                "q": text,
                "namespace": ns,
                "vmm": filters.vmm,
                "nokvm": "1" if filters.without_kvm else "",
                "chain": "1" if filters.chain else "",
                "sort": order if order != "updated" else "",
                "per_page": pages.size if pages.size != PER_PAGE else "",
            }.items()
            if v
        }
        last_page = max(1, -(-total // pages.size))

        def link(n: int) -> str:
            return "/-/search?" + urlencode({**params, "page": n} if n > 1 else params)

        context = base_context(ui, hub, request, who)
        context["q"] = text
        return ui.renderer.page(
            "search.html",
            **context,
            filters=filters,
            vmms=VMMS,
            items=items,
            total=total,
            page=pages.number,
            pages=last_page,
            prev_link=link(pages.number - 1) if pages.number > 1 else "",
            next_link=link(pages.number + 1) if pages.number < last_page else "",
        )

    @get("/-/{path:path}")
    async def unknown(self, path: FromPath[str]) -> Response[str]:
        """Any other ``/-/`` address: a 404 page, not the API's JSON."""
        raise NotFoundException(f"no page at /-/{path.strip('/')[:200]}")

    @get("/{path:path}")
    async def resource(
        self,
        request: HubRequest,
        hub: NamedDependency[Hub],
        ui: NamedDependency[UI],
        path: FromPath[str],
        page: QueryNumber = None,
    ) -> Response[str]:
        """``/NS`` (organisation or user), ``/NS/NAME`` (pack), ``/NS/NAME/-/tags/REF`` (tag);
        a namespace's ``page`` of packs and a pack's ``page`` of tags are 1-100000 in ASCII
        digits."""
        number = query_number(page, "page", 1, PAGES_MAX)
        path = path.strip("/")
        name, sep, rest = path.partition("/-/")
        try:
            validate_name(name)
        except InvalidInput as exc:
            raise NotFoundException(f"no page at /{path[:200]}") from exc
        if "/" not in name and not sep:
            return await self._namespace(request, hub, ui, name, number)
        if not sep:
            return await self._pack(request, hub, ui, name, number)
        kind, _, ref = rest.partition("/")
        if kind == "tags" and ref:
            return await self._tag(request, hub, ui, name, ref)
        raise NotFoundException(f"no page at /{path[:200]}")

    async def _namespace(
        self, request: HubRequest, hub: Hub, ui: UI, name: str, page: int
    ) -> Response[str]:
        """One page of the packs of ``name`` the viewer may see (``NAMESPACE_PER_PAGE``,
        newest first), with its members and teams for members."""
        who = await viewer(ui, hub, request)
        size = NAMESPACE_PER_PAGE
        async with hub.db.reading() as session:
            ns = await accounts.get_namespace(session, name)
            if ns is None:
                raise NotFoundException(f"no user or organisation named {name}")
            role = await queries.role_in(session, who.principal, ns)
            members = await queries.namespace_members(session, ns) if role else []
            teams = [
                (t, m, t.repositories and accounts.team_glob_problem(ns.name, t.repositories))
                for t, m in (
                    await accounts.list_teams(session, ns.name) if role and ns.kind == "org" else []
                )
            ]
            where = (
                Repository.namespace_id == ns.id,
                await session.run_sync(authz.visible, who.principal),
            )
            total = await session.scalar(select(func.count()).select_from(Repository).where(*where))
            rows = (
                await session.execute(
                    select(Repository, queries.tag_count())
                    .where(*where)
                    .order_by(Repository.updated_at.desc(), Repository.name)
                    .offset((page - 1) * size)
                    .limit(size)
                )
            ).all()
        last_page = max(1, -(-(total or 0) // size))
        if page > last_page:
            raise NotFoundException(f"{name} has {last_page} page(s) of packs you can see")
        packs = [queries.summary(r, n) for r, n in rows]

        def link(n: int) -> str:
            return f"/{name}?{urlencode({'page': n})}"

        return ui.renderer.page(
            "namespace.html",
            **base_context(ui, hub, request, who),
            ns=ns,
            role=role,
            members=members,
            teams=teams,
            packs=packs,
            page=page,
            pages=last_page,
            prev_link=link(page - 1) if page > 1 else "",
            next_link=link(page + 1) if page < last_page else "",
            roles=("pull", "push", "admin"),
        )

    async def _pack(
        self, request: HubRequest, hub: Hub, ui: UI, name: str, page: int
    ) -> Response[str]:
        who = await viewer(ui, hub, request)
        detail = await queries.pack(hub, ui.facts, who.principal, name, page)
        if detail is None:
            raise NotFoundException(f"no pack named {name}")
        if page > detail.pages:
            raise NotFoundException(f"{name} has {detail.pages} page(s) of tags")
        featured = detail.featured

        def link(n: int) -> str:
            return f"/{name}?{urlencode({'page': n})}"

        description = detail.repo.description
        if not description and featured and featured.facts.config:
            description = featured.facts.config.description
        return ui.renderer.page(
            "pack.html",
            **base_context(ui, hub, request, who),
            detail=detail,
            repo=detail.repo,
            featured=featured,
            description=description,
            # Off the event loop, once per text (some Markdown costs seconds to parse).
            readme_html=await ui.renderer.readmes.html(detail.repo.readme)
            if detail.repo.readme
            else "",
            pull_tag=featured.name if featured else "latest",
            prev_link=link(page - 1) if page > 1 else "",
            next_link=link(page + 1) if page < detail.pages else "",
        )

    async def _tag(
        self, request: HubRequest, hub: Hub, ui: UI, name: str, ref: str
    ) -> Response[str]:
        who = await viewer(ui, hub, request)
        try:
            if ref.startswith(("sha256:", "sha512:")):
                dg.validate_oci(ref)
            else:
                validate_tag(ref)
        except InvalidInput as exc:
            raise NotFoundException(f"no tag {ref[:130]!r} in {name}") from exc
        detail = await queries.tag(hub, who.principal, name, ref)
        if detail is None:
            raise NotFoundException(f"no pack named {name}")
        if not isinstance(detail, queries.TagDetail):
            raise NotFoundException(f"no tag {ref} in {name}")
        digest = detail.digest
        layers = await queries.chain_layers(hub, ui.facts, detail)
        head = layers[0].facts
        graph = queries.lineage(detail)
        return ui.renderer.page(
            "tag.html",
            **base_context(ui, hub, request, who),
            detail=detail,
            repo=detail.repo,
            ref=ref,
            digest=digest,
            tags=detail.family.tags_of.get(digest, []),
            head=head,
            layers=layers,
            chain_stored=sum(layer.facts.stored for layer in layers),
            graph=graph,
            pull_ref=f"{name}:{ref}" if detail.tagged else f"{name}@{digest}",
        )
