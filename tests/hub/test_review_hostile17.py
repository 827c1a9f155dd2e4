"""Hostile review 17: what one client's connections hold in the hub's memory, summed.

- Request bodies. A manifest ``PUT``, a UI form, a README and every ``/api/v1`` JSON
  body are read whole before their handler runs; each route bounds its own body, but
  nothing bounded their sum. One anonymous client that opened connections and sent each
  a sign-in form short of its last byte (a byte a minute keeps one open) made the hub
  hold 300 KiB per connection: 16 MiB for 40 of them, gigabytes for thousands. Now the
  bodies held at once are counted (``hub/body_budget.py``): ``request_bodies_max`` in
  all, one client (an address; IPv6 by its /64) at most 1/8 of it; a request past its
  client's share is 429, past the whole 503, at once and its body unread. Blob uploads
  stream to storage and are not counted.
- Response bodies, the other way round: a client that opened connections to a public
  blob and read none had the hub hold about 2 MiB per connection (80 MiB for 40
  anonymous ones). Now the response bytes being sent are counted per client against
  ``response_bytes_max`` (1/8 per client): past it a response not begun is 429, one
  begun is cut short of its Content-Length (a failed transfer, retried), and other
  clients are served.
- Request heads. ``forkd hub serve`` bounds each head (1 MiB, 256 fields, 60 s:
  round 12), not their sum: one client that opened connections and sent each most of a
  1 MiB head had a worker buffer 1 MiB per connection. Now the head bytes being received
  are counted per worker (``workers.HEADS``), one peer address at most 1/8: past it (or
  the whole) 503 and the connection closed.
- A UI form whose client went away before its body ended (any anonymous client: open a
  sign-in request, close it) was the 500 page and an ERROR with a traceback of ~30
  lines in the hub's log, as often as a client liked. Now it is the client's end, not
  the hub's error: a 400 no one reads, and silent, as on the JSON routes.
- An answer its client stopped reading (after round 10, the lead): the share of
  response bytes bounded what one client held, not for how long. ``forkd hub serve``
  now ends a connection whose writes stayed paused for ``SEND_STALL_TIMEOUT_S`` (60 s,
  nginx's ``send_timeout``), as the controller's listener does.
"""

from __future__ import annotations

import contextlib
import logging
import re
import selectors
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from hub_server import ADMIN, HubServer, free_port, sha
from net_support import running

from forkd.hub import workers
from forkd.hub.settings import HubSettings
from forkd.shares import Shares

MiB = 1 << 20
SHARE = 2 * MiB  # what one client holds at most here: 1/8 of the budget
BUDGET = 8 * SHARE  # request_bodies_max (and response_bytes_max) here
FORM = 300_000  # a sign-in form's Content-Length: 6 fit in a client's share, not 7
HELD_MOST = SHARE // FORM
ATTACKER, OTHER, THIRD = "203.0.113.9", "198.51.100.7", "192.0.2.44"
DEADLINE_S = 60.0  # only bounds a wait for answers that a failing hub never sends


def _budget_hub(tmp_path: Path) -> HubServer:
    """A hub whose bodies budget is ``BUDGET``, taking the client's address from
    X-Forwarded-For (the test's clients all connect from 127.0.0.1)."""
    return HubServer(
        tmp_path / "hub",
        {
            "request_bodies_max": BUDGET,
            "manifest_max_bytes": SHARE,
            "trusted_proxies": "127.0.0.1",
        },
    ).start()


def _held_form(server: HubServer, client: str) -> socket.socket:
    """A connection that sent a sign-in form all but its last byte, and waits."""
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
    head = (
        f"POST /-/signin HTTP/1.1\r\nHost: {server.address}\r\n"
        f"X-Forwarded-For: {client}\r\n"
        "Content-Type: application/x-www-form-urlencoded\r\n"
        f"Content-Length: {FORM}\r\n\r\n"
    ).encode()
    sock.sendall(head + b"a" * (FORM - 1))
    return sock


@contextmanager
def _held_forms(server: HubServer, client: str, count: int) -> Iterator[list[socket.socket]]:
    socks = [_held_form(server, client) for _ in range(count)]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _answered(socks: list[socket.socket], at_least: int) -> dict[socket.socket, bytes]:
    """The first bytes of the answers the hub sent on ``socks`` (the connections it
    refused; it answers the others only once their bodies end), once ``at_least`` have
    come or ``DEADLINE_S`` has passed."""
    answers: dict[socket.socket, bytes] = {}
    deadline = time.monotonic() + DEADLINE_S
    # A selector (epoll), not select(): the test process's descriptors may number past
    # select()'s 1024 by the time this runs in the whole suite.
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while len(answers) < at_least and time.monotonic() < deadline:
            for key, _ in selector.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                answers[sock] = sock.recv(4096)
                selector.unregister(sock)
    return answers


def _form_status(server: HubServer, client: str) -> int:
    """The status of a whole sign-in form (no login cookie: 403) sent from ``client``."""
    with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
        r = c.post(
            "/-/signin",
            content=b"a" * FORM,
            headers={
                "X-Forwarded-For": client,
                "Content-Type": "application/x-www-form-urlencoded",
            },
        )
        return r.status_code


def test_one_client_holds_at_most_its_share_of_request_bodies(tmp_path: Path) -> None:
    """Before: 12 sign-in forms held open by one client were 12 x 300 KB in the hub's
    memory, and as many more as it opened. Now at most ``HELD_MOST`` are held (1/8 of
    ``request_bodies_max``); the others are answered 429 at once, their bodies unread.
    Another client's forms, and the first client's blob uploads (streamed to storage,
    larger than the whole budget), go on; once its connections close, its share is
    back."""
    server = _budget_hub(tmp_path)
    try:
        pusher = server.add_user("bodies-pusher")
        with _held_forms(server, ATTACKER, HELD_MOST + 6) as socks:
            answers = _answered(socks, 6)
            assert len(answers) >= 6, f"{len(answers)} of {len(socks)} forms refused"
            assert all(a.startswith(b"HTTP/1.1 429 ") for a in answers.values()), answers
            assert all(b"retry-after: 1" in a.lower() for a in answers.values())
            assert _form_status(server, ATTACKER) == 429
            assert _form_status(server, OTHER) == 403  # the login CSRF check: read whole

            blob = b"b" * (BUDGET + MiB)  # streamed: never counted
            with httpx.Client(base_url=server.url, auth=pusher, timeout=DEADLINE_S) as c:
                r = c.post(
                    f"/v2/{pusher[0]}/app/blobs/uploads/",
                    params={"digest": sha(blob)},
                    content=blob,
                    headers={"X-Forwarded-For": ATTACKER},
                )
                assert r.status_code == 201, r.text
        deadline = time.monotonic() + DEADLINE_S
        status = _form_status(server, ATTACKER)
        while status == 429 and time.monotonic() < deadline:
            time.sleep(0.2)  # the closed connections' requests end as the hub reads EOF
            status = _form_status(server, ATTACKER)
        assert status == 403
    finally:
        server.stop()


def test_request_bodies_of_all_clients_are_bounded(tmp_path: Path) -> None:
    """Before: clients each below any bound of their own held as much as they liked
    together. Now past ``request_bodies_max`` in all a request is 503 at once (in the
    registry's error form on ``/v2/``), whoever sends it: ten clients' 56 forms, each
    client within its share, are one more than the budget holds (55)."""
    assert BUDGET // FORM == 55
    server = _budget_hub(tmp_path)
    try:
        with contextlib.ExitStack() as stack:
            socks = []
            for i in range(1, 11):
                count = HELD_MOST if i < 10 else 2
                socks += stack.enter_context(_held_forms(server, f"203.0.113.{i}", count))
            answers = list(_answered(socks, 1).values())
            assert len(answers) == 1 and answers[0].startswith(b"HTTP/1.1 503 "), answers
            with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
                r = c.put(
                    "/v2/someone/app/manifests/v1",
                    content=b"{}" * (FORM // 2),
                    headers={"X-Forwarded-For": "192.0.2.99"},
                )
                assert r.status_code == 503, r.text
                assert r.json()["errors"][0]["code"] == "TOOMANYREQUESTS"
    finally:
        server.stop()


UI_FORMS = (
    "/-/signin",
    "/-/signout",
    "/-/settings/tokens",
    "/-/settings/tokens/1/revoke",
    "/-/settings/robots",
    "/-/members/someone",
    "/-/edit/someone/app",
)


def _ui_posts_answered(server: HubServer) -> int:
    """POSTs to UI pages (``route="other"``) the hub has finished with, by its metrics:
    counted once the app has returned, so its log is written by then."""
    with httpx.Client(base_url=server.url, auth=ADMIN, timeout=DEADLINE_S) as c:
        text = c.get("/metrics").text
    pattern = r'^forkd_hub_requests_total\{method="POST",route="other",status="\d+"\} (\S+)$'
    return sum(int(float(n)) for n in re.findall(pattern, text, re.MULTILINE))


def test_a_client_gone_mid_form_is_no_error_in_the_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: each UI form whose client closed the connection with its body half sent
    logged ``error rendering /-/signin`` at ERROR with Litestar's traceback. Now nothing
    at WARNING or above, on every form route, signed in or not."""
    server = HubServer(tmp_path / "hub").start()
    try:
        with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
            found = re.search(r'name="login_csrf" value="([^"]*)"', c.get("/-/signin").text)
            assert found
            form = {"login_csrf": found.group(1), "username": ADMIN[0], "password": ADMIN[1]}
            assert c.post("/-/signin", data=form).status_code == 303
            session = c.cookies["forkd_session"]
        before = _ui_posts_answered(server)
        with caplog.at_level(logging.INFO):
            for path in UI_FORMS:
                for cookie in ("", f"Cookie: forkd_session={session}\r\n"):
                    sock = socket.create_connection(("127.0.0.1", server.port))
                    sock.sendall(
                        (
                            f"POST {path} HTTP/1.1\r\nHost: {server.address}\r\n{cookie}"
                            "Content-Type: application/x-www-form-urlencoded\r\n"
                            "Content-Length: 1000\r\n\r\ncsrf=abc"
                        ).encode()
                    )
                    sock.close()
            deadline = time.monotonic() + DEADLINE_S
            while _ui_posts_answered(server) < before + 2 * len(UI_FORMS):
                assert time.monotonic() < deadline, "the hub did not finish the requests"
                time.sleep(0.1)
        loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not loud, [(r.name, r.getMessage()) for r in loud]
    finally:
        server.stop()


HEAD_PART = 600 << 10  # of a header sent and not ended: 3 fit in a peer's part, not 4


@pytest.fixture
def served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A hub served as ``forkd hub serve`` serves it (``workers.server_config``), whose
    heads budget is ``BUDGET`` (one peer: 2 MiB); its port."""
    monkeypatch.setattr(workers, "HEADS", Shares(BUDGET, 8), raising=False)
    settings = HubSettings(
        tmp_path / "hub",
        host="127.0.0.1",
        port=free_port(),
        admin_user=ADMIN[0],
        admin_password=ADMIN[1],
    )
    with running(uvicorn.Server(workers.server_config(settings))):
        yield settings.port


def _healthz(port: int, source: str) -> bytes:
    """A whole request from ``source`` (a loopback address); the answer's first bytes."""
    with socket.create_connection(
        ("127.0.0.1", port), timeout=DEADLINE_S, source_address=(source, 0)
    ) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return s.recv(100)


def test_request_heads_one_client_sends_at_once_are_bounded(served: int) -> None:
    """Before: six connections of one client, each with 600 KiB of a head not ended,
    were 3.6 MiB buffered in the worker (and as many more as it opened). Now at most a
    peer's part (1/8: 2 MiB here): the others are 503 and closed. Another peer is served
    meanwhile; once the first one's connections close, it is served again."""
    socks = []
    try:
        for _ in range(6):
            sock = socket.create_connection(("127.0.0.1", served), timeout=DEADLINE_S)
            with contextlib.suppress(OSError):  # the hub may close before it is all sent
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * HEAD_PART)
            socks.append(sock)
        answers = _answered(socks, 3)
        assert len(answers) >= 3, f"{len(answers)} of {len(socks)} heads refused"
        assert all(a.startswith(b"HTTP/1.1 503 ") for a in answers.values()), answers
        assert _healthz(served, "127.0.0.2").startswith(b"HTTP/1.1 200 ")
    finally:
        for sock in socks:
            sock.close()
    deadline = time.monotonic() + DEADLINE_S
    while not (answer := _healthz(served, "127.0.0.1")).startswith(b"HTTP/1.1 200 "):
        assert time.monotonic() < deadline, answer
        time.sleep(0.1)


def _slow_reader(server: HubServer, path: str, client: str) -> socket.socket:
    """A connection that asks for ``path`` and reads nothing (a 4 KiB receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(DEADLINE_S)
    sock.connect(("127.0.0.1", server.port))
    head = f"GET {path} HTTP/1.1\r\nHost: {server.address}\r\nX-Forwarded-For: {client}\r\n"
    sock.sendall(head.encode() + b"\r\n")
    return sock


def _public_blob(server: HubServer) -> bytes:
    """An 8 MiB blob pushed to a public repository of the hub (``ADMIN/pub``)."""
    blob = b"z" * (8 * MiB)
    with httpx.Client(base_url=server.url, auth=ADMIN, timeout=DEADLINE_S) as c:
        r = c.post(f"/v2/{ADMIN[0]}/pub/blobs/uploads/", params={"digest": sha(blob)},
                   content=blob)
        assert r.status_code == 201, r.text
    server.public(f"{ADMIN[0]}/pub")
    return blob


def _blob_gets_ended(server: HubServer) -> int:
    """Blob GETs the hub has finished with (answered whole, or cut), by its metrics."""
    with httpx.Client(base_url=server.url, auth=ADMIN, timeout=DEADLINE_S) as c:
        text = c.get("/metrics").text
    pattern = r'^forkd_hub_requests_total\{method="GET",route="blobs",status="\d+"\} (\S+)$'
    return sum(int(float(n)) for n in re.findall(pattern, text, re.MULTILINE))


def test_responses_one_client_leaves_unread_are_bounded(tmp_path: Path) -> None:
    """Before: 12 connections of one client to an 8 MiB public blob, none read, each
    held its response's chunk in the hub's memory. Now the client's share of
    ``response_bytes_max`` (2 MiB here: two 1 MiB chunks) is held, the others are cut
    short, and its next answers are 429 before they begin; another client pulls the
    blob whole meanwhile."""
    server = HubServer(
        tmp_path / "hub",
        {
            "response_bytes_max": BUDGET,
            "manifest_max_bytes": SHARE,
            "trusted_proxies": "127.0.0.1",
        },
    ).start()
    try:
        blob = _public_blob(server)
        path = f"/v2/{ADMIN[0]}/pub/blobs/{sha(blob)}"
        socks = [_slow_reader(server, path, ATTACKER) for _ in range(12)]
        try:
            # An 8 MiB answer cannot have been taken whole by a client reading nothing:
            # each of these requests the hub is done with was cut.
            deadline = time.monotonic() + DEADLINE_S
            while (ended := _blob_gets_ended(server)) < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert ended >= 4, f"{ended} of {len(socks)} unread downloads cut"
            with httpx.Client(base_url=server.url, timeout=DEADLINE_S) as c:
                r = c.get(path, headers={"X-Forwarded-For": OTHER})
                assert r.status_code == 200 and r.content == blob
                # Its share held, the client's next answer is not begun: 429, whole.
                for page in (path, "/", "/api/v1/repositories"):
                    r = c.get(page, headers={"X-Forwarded-For": ATTACKER})
                    assert r.status_code == 429, (page, r.status_code)
                    assert r.headers["retry-after"] == "1"
        finally:
            for sock in socks:
                sock.close()
    finally:
        server.stop()


def test_an_answer_its_client_stops_reading_ends_its_connection(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a client that asked for a public 8 MiB blob and read none of it kept its
    connection, its request and the answer's bytes in flight for as long as it liked
    (its share of response bytes held the whole time). Now, its writes paused for
    ``SEND_STALL_TIMEOUT_S`` (1 s here), the hub ends the connection: the request ends
    (the hub's metrics count it) and the client, reading at last, finds the answer cut."""
    monkeypatch.setattr(workers, "SEND_STALL_TIMEOUT_S", 1.0)
    server = HubServer(tmp_path / "hub", as_served=True).start()
    try:
        blob = _public_blob(server)
        before = _blob_gets_ended(server)
        with _slow_reader(server, f"/v2/{ADMIN[0]}/pub/blobs/{sha(blob)}", ATTACKER) as sock:
            deadline = time.monotonic() + DEADLINE_S
            while _blob_gets_ended(server) == before and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _blob_gets_ended(server) == before + 1, "the unread download still runs"
            got = 0
            with contextlib.suppress(ConnectionResetError):
                while block := sock.recv(1 << 20):
                    got += len(block)
            assert got < len(blob), "the answer was not cut"
    finally:
        server.stop()
