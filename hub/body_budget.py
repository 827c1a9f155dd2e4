"""Request and response bodies held in memory: bounded in all and per client.

A manifest ``PUT`` (up to ``manifest_max_bytes``), a UI form (``ui.account.FORM_MAX``), a
README (``ui.api.BODY_MAX``) and every ``/api/v1`` JSON body are read whole before their
handler runs, and kept until it answers. Each route bounds its own body, but nothing
bounded their sum: one anonymous client that opened connections and sent each a sign-in
form short of its last byte (a byte a minute keeps one open) made the hub hold
``FORM_MAX`` per connection, 16 MiB for 40 of them, gigabytes for thousands.

``counted`` counts each request's body (its ``Content-Length``, at most what its route
takes; a chunked body as the most its route takes) from the request's start until its
answer is sent, against ``request_bodies_max`` in all and 1/8 of it per client (the
address ``auth.client_ip`` names, an IPv6 one by its /64: ``services.limited_address``),
as the controller daemon counts its own (``forkd.shares.Shares``). A request past its
client's share is answered 429 at once, past the whole 503, its body never read. Blob
uploads stream to storage (``hub/oci/uploads.py``) and are not counted.

Responses the same way, the other way round: a response's body goes from the hub's
memory to the client at the client's pace (a blob in ``STREAM_CHUNK`` blocks, a manifest
whole), and a client that opened connections and read none of them had the hub hold
about 2 MiB per connection of a public blob: 80 MiB for 40 anonymous ones. Each body
message is counted, for the request's client, from when it is handed to the server until
the server has taken it (``send`` returns once the connection's buffer drained), against
``response_bytes_max`` (1/8 per client). One past that is cut (``ResponseCut``): the
connection closed short of its ``Content-Length``, which every client reads as a failed
transfer to retry; logged at DEBUG only (a client provokes it at will). A response whose
first bytes have no room is answered 429 instead, never begun.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from litestar import Request

from forkd.bodies import held_size
from forkd.hub.auth import client_ip
from forkd.hub.errors import Code
from forkd.hub.observability import StreamCut, route_of
from forkd.hub.services import limited_address
from forkd.hub.settings import CLIENT_PARTS
from forkd.shares import Refusal, Shares

ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]
RETRY_AFTER_S = 1
STREAMED = "blobs/uploads"  # route_of: bodies written to storage as they come


class BodyBudget(Shares):
    """Bytes of request bodies held at once, in all and per client (``CLIENT_PARTS``)."""

    def __init__(self, total: int) -> None:
        super().__init__(total, CLIENT_PARTS)

    def refusal(self, refused: Refusal, n: int, client: str) -> tuple[int, str]:
        """(status, what to tell the client) for a body of ``n`` bytes ``take_or_refuse``
        refused."""
        if refused.bound == "client":
            return 429, (
                f"this client ({client}) has {refused.held} bytes of request bodies being "
                f"received or answered, and this one is {n}: one client holds at most "
                f"{self.share} (1/{self.parts} of request_bodies_max); wait for its "
                "requests to end, or send fewer at once"
            )
        return 503, (
            f"the hub holds as many bytes of request bodies as it takes at once "
            f"({self.total}, request_bodies_max) and this one is {n}; try again shortly"
        )


class ResponseCut(StreamCut):
    """A response body its client's share (or all clients' bound) of
    ``response_bytes_max`` had no room for, after the response's first bytes: the
    response is cut short."""

    level = logging.DEBUG


def _no_room(refused: Refusal, n: int, client: str) -> str:
    bound = "this client's share" if refused.bound == "client" else "all clients' bound"
    return (
        f"{n} more bytes of responses for {client} would pass {bound} of "
        f"response_bytes_max ({refused.held} being sent already): read the responses "
        "begun first, or ask for fewer at once"
    )


def metered(send: Any, scope: Any, budget: Shares, client: str) -> Any:
    """``send`` with each response body message counted against ``budget`` for
    ``client`` until the server has taken it. The response's head waits for its first
    body message: one with no room is answered 429 (Retry-After) instead, never begun;
    a later one is cut (``ResponseCut``)."""
    head: list[Any] = []  # the response's start, until its first body message

    async def counted_send(message: Any) -> None:
        if message["type"] == "http.response.start":
            head.append(message)
            return
        n = len(message.get("body", b"")) if message["type"] == "http.response.body" else 0
        refused = budget.take_or_refuse(n, client) if n else None
        if refused is not None:
            why = _no_room(refused, n, client)
            if head:  # not begun: a whole answer, and the app stops there
                head.clear()
                await _refuse(send, scope, 429, why)
            raise ResponseCut(why)
        try:
            if head:
                await send(head.pop())
            await send(message)
        finally:
            if n:
                budget.give(n, client)

    return counted_send


def body_size(scope: Any, manifest_max: int, other_max: int) -> int:
    """What a request's body may make the hub hold: its ``Content-Length``, else
    (chunked) the most its route takes, never more than that; 0 for a body that is
    streamed to storage (blob uploads) and for no body."""
    route = route_of(scope.get("path", ""))
    if route == STREAMED:
        return 0
    return held_size(scope, manifest_max if route == "manifests" else other_max)


async def _refuse(send: Any, scope: Any, status: int, detail: str) -> None:
    """Answer at once, the body unread, and close the connection: in the registry's error
    form on ``/v2/``, as the rest of the API answers elsewhere."""
    if scope.get("path", "").startswith("/v2/"):
        code = Code.TOOMANYREQUESTS
        doc: dict[str, Any] = {
            "errors": [{"code": code.name, "message": code.message, "detail": detail}]
        }
    else:
        doc = {"status_code": status, "detail": detail}
    body = json.dumps(doc).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def counted(
    app: ASGIApp, budget: BodyBudget, size: Callable[[Any], int], responses: Shares
) -> ASGIApp:
    """``app`` (a Litestar middleware: the scope has the app, for ``client_ip``) with
    each HTTP request's body counted against ``budget`` until its answer is sent, and
    its response's body against ``responses`` while the server takes it (``metered``)."""

    async def middleware(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await app(scope, receive, send)
            return
        n = size(scope)
        client = limited_address(client_ip(Request(scope)))
        refused = budget.take_or_refuse(n, client) if n else None
        if refused is not None:
            await _refuse(send, scope, *budget.refusal(refused, n, client))
            return
        try:
            await app(scope, receive, metered(send, scope, responses, client))
        finally:
            if n:
                budget.give(n, client)

    return middleware
