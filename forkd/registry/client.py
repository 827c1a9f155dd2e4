"""A small OCI Distribution v1.1 client (httpx): blobs, uploads, manifests, token auth.

Auth follows the registry token flow: a 401 with ``WWW-Authenticate: Bearer
realm=…,service=…,scope=…`` sends the stored credential (Basic) to the realm
and retries with the token; a ``Basic`` challenge is answered directly.
Tokens are cached per scope. Errors carry the registry's OCI error codes.

Retries: a request whose connection failed or broke before an answer arrived, or that
a load balancer answered 502/503/504 (its replica went away), is sent again after a
pause, ``RETRY_DELAYS`` (about 8 s in all: longer than a balancer's health checks take
to drop a dead replica), so a client behind several hub replicas rides out the loss of
one. Every request this client sends is safe to repeat: reads, manifest PUTs, blob
uploads addressed by digest (the same content twice is one blob), and chunk PATCHes
with a ``Content-Range``, which a registry that already has the chunk refuses with 416:
then the upload goes on from where the registry says it stands (``GET`` on the session),
and an upload whose session was lost (its replica's) starts again. A blob stream that
breaks off mid-body is fetched again from the start, its sink going on where it
stopped (``get_blob``).

Credentials go only to the registry's own origin (same scheme, host and port) or to a
token realm origin the user trusts: ``trusted_realms`` or ``FORKD_TRUSTED_REALMS``
(comma-separated origins such as ``https://auth.example.com``). A challenge naming any
other realm (another host or port, or https → http) is refused with AuthError before
anything is sent; without credentials an anonymous token may come from any realm. A
credential ``forkd login`` checked over https (``Credential.scheme``; an entry stored
without one: the host's default scheme) is never sent to a hub addressed over plain http
(``http://HOST`` in a reference or ``$FORKD_HUB``), where anyone on the path reads it:
AuthError instead, before anything is sent.

Bounds (a hostile hub, or a MITM on plain http, picks every byte and every pause): an
answer that is not a blob (errors, 401s, tokens, manifests, referrers, upload answers) is
read up to ``MAX_ANSWER_BYTES`` within the client's ``timeout`` in all; a blob is read up to
its declared size within ``blob_deadline(size)`` (``BLOB_GRACE`` seconds plus its bytes at
``MIN_BLOB_RATE``) or the caller's deadline, retries included: a body that drips a byte a
minute, or never ends, is a RegistryError naming the URL, never a hang or a full memory.
The text of an error answer is quoted only when the hub's own origin (or a trusted token
realm) sent it (a redirect elsewhere, say to a service on the host, is reported by its
status and URL alone), and a redirect or realm leading to a link-local address (a cloud's
metadata service), or to this host's loopback from a hub elsewhere, is refused, named by
its address or by a name resolving to it (resolved once, the request pinned to the address
checked). Only reads
(GET, HEAD) follow redirects: an upload or a manifest PUT answered with a redirect is an
error, so a hub cannot send a pack's bytes to another address (a service on this host).
"""

from __future__ import annotations

import base64
import functools
import os
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from forkd import addresses, jsondoc
from forkd import digest as dg
from forkd.errors import ForkdError, IntegrityError, InvalidInput, NotFound
from forkd.names import one_line
from forkd.pack import mediatypes as mt
from forkd.pack.manifest import MAX_MANIFEST_BYTES
from forkd.registry.credentials import Credential
from forkd.registry.reference import Hub, default_scheme

MANIFEST_ACCEPT = ", ".join([mt.OCI_MANIFEST, mt.OCI_INDEX])
UPLOAD_CHUNK = 16 << 20
# Pauses before the retries of a request that got no answer or a balancer's 502/503/504.
RETRY_DELAYS = (0.25, 0.5, 1.0, 2.0, 4.0)
RETRY_STATUSES = (502, 503, 504)
UPLOAD_RESTARTS = 3  # times a chunked upload whose session was lost starts again
MAX_ANSWER_BYTES = MAX_MANIFEST_BYTES  # an answer that is not a blob: manifest, error, token
BLOB_GRACE = 30.0  # seconds a blob may take whatever its size (connecting, a slow start)
MIN_BLOB_RATE = 64 << 10  # bytes a second a blob's body must average past BLOB_GRACE
_CHALLENGE_RE = re.compile(r'(\w+)="([^"]*)"')
MAX_TOKEN_CHARS = 16 << 10  # a JWT with many scopes is a few KiB
# what a token endpoint's token may hold: it goes into every request's Authorization
# header, where a line break or a character outside ASCII cannot (RFC 6750's b64token and
# the visible ASCII some registries' opaque tokens use)
_TOKEN_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_TOKEN_CHARS}}}")
TRUSTED_REALMS_ENV = "FORKD_TRUSTED_REALMS"
DEFAULT_PORTS = {"http": 80, "https": 443}


class RegistryError(ForkdError):
    """The registry refused a request or could not be reached; ``codes`` are the OCI
    error codes of its answer, ``details`` their detail texts, ``status`` its HTTP
    status (None: no answer)."""

    exit_code = 7

    def __init__(
        self,
        message: str,
        codes: tuple[str, ...] = (),
        details: tuple[str, ...] = (),
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.codes = codes
        self.details = details
        self.status = status


class AuthError(RegistryError):
    """Credentials are missing, wrong, or lack the scope."""

    exit_code = 8


Origin = tuple[str, str, int]


def origin(url: str | httpx.URL) -> Origin:
    """(scheme, host, port) of an absolute http(s) URL, the port filled in by scheme."""
    parsed = httpx.URL(url)
    scheme = parsed.scheme.lower()
    return scheme, parsed.host.lower(), parsed.port or DEFAULT_PORTS.get(scheme, 0)


def trusted_realm_origins(configured: tuple[str, ...] | None = None) -> set[Origin]:
    """The realm origins the user trusts with credentials: ``configured``, else the
    FORKD_TRUSTED_REALMS environment variable."""
    if configured is None:
        configured = tuple(os.environ.get(TRUSTED_REALMS_ENV, "").split(","))
    found = set()
    for text in (t.strip() for t in configured):
        if not text:
            continue
        parsed = httpx.URL(text)
        if parsed.scheme not in DEFAULT_PORTS or not parsed.host:
            raise InvalidInput(
                f"trusted realm {text[:100]!r} ({TRUSTED_REALMS_ENV}): use an origin such as "
                "https://auth.example.com[:PORT]"
            )
        found.add(origin(parsed))
    return found


def tls_context() -> ssl.SSLContext:
    """The TLS trust every RegistryClient of this process shares: building it (the CA
    bundle loaded) costs tens of milliseconds, once per trust setting (SSL_CERT_FILE and
    SSL_CERT_DIR, which httpx reads)."""
    return _tls_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))


@functools.lru_cache(maxsize=4)
def _tls_context(cert_file: str | None, cert_dir: str | None) -> ssl.SSLContext:
    return httpx.create_ssl_context()


def blob_deadline(size: int) -> float:
    """Seconds a blob of ``size`` bytes may take to arrive, retries included."""
    return BLOB_GRACE + size / MIN_BLOB_RATE


def warm_up() -> None:
    """Load what a process's first client loads (httpx's transport, the TLS trust):
    what a waiting lazy server does before it is needed."""
    httpx.Client(verify=tls_context()).close()


class RegistryClient:
    def __init__(
        self,
        hub: Hub,
        credential: Credential | None = None,
        timeout: float = 120.0,
        trusted_realms: tuple[str, ...] | None = None,
    ) -> None:
        self.hub = hub
        self.credential = credential
        self.timeout = timeout
        self.realm_origins = {origin(hub.url)} | trusted_realm_origins(trusted_realms)
        self.http = httpx.Client(
            base_url=hub.url,
            verify=tls_context(),
            timeout=timeout,
            follow_redirects=True,
            limits=httpx.Limits(max_connections=16),
            event_hooks={"request": [self._check_destination]},
        )
        self._tokens: dict[str, str] = {}
        self._basic = False
        self._lock = threading.Lock()

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport and auth -------------------------------------------------
    def request(
        self,
        method: str,
        url: str,
        scope: str,
        *,
        ok: tuple[int, ...] = (200,),
        stream: bool = False,
        headers: dict[str, str] | None = None,
        deadline: float | None = None,
        **kwargs: Any,
    ) -> httpx.Response:
        """Send a request, answering one auth challenge; raise unless the status is in ``ok``.
        Without ``stream`` the answer is read (``read_answer``: bounded in bytes and time);
        ``deadline`` (``time.monotonic()``): when retries stop and the last one times out."""
        for attempt in (1, 2):
            resp = self._send(method, url, scope, stream, headers, kwargs, deadline)
            if resp.status_code == 401 and attempt == 1:
                self.read_answer(resp, f"{method} {one_line(url)} answer")
                self._authenticate(resp.headers.get("www-authenticate", ""), scope)
                continue
            if resp.status_code not in ok:
                self.read_answer(resp, f"{method} {one_line(url)} answer")
                raise self._error(method, url, resp)
            return resp
        raise AuthError(f"{self.hub}: still unauthorized after logging in for {scope}")

    def read_answer(self, resp: httpx.Response, what: str, limit: int = MAX_ANSWER_BYTES,
                    deadline: float | None = None) -> bytes:
        """The body of an answer that is not a blob, read into ``resp`` (``resp.content``)
        and closed: at most ``limit`` bytes, within the client's timeout (or until
        ``deadline``); else RegistryError (a hub that sends a body without end, or a byte
        a minute, does not fill this process's memory nor hold it)."""
        try:
            return self._read_body(resp, what, limit, deadline)
        except httpx.TransportError as exc:
            raise RegistryError(f"{self.hub}: {what} broke off: {exc}") from exc
        except httpx.HTTPError as exc:
            raise RegistryError(f"{self.hub}: {what} is unusable ({exc})") from exc

    def _read_body(self, resp: httpx.Response, what: str, limit: int = MAX_ANSWER_BYTES,
                   deadline: float | None = None) -> bytes:
        """``read_answer``, letting httpx's errors through (``_send`` retries some)."""
        if resp.is_stream_consumed:
            return resp.content
        end = time.monotonic() + self.timeout if deadline is None else deadline
        declared = resp.headers.get("content-length", "")
        data = bytearray()
        try:
            if declared.isdigit() and int(declared) > limit:
                raise RegistryError(f"{self.hub}: {what} is {declared} bytes, over the "
                                    f"{limit} this client reads; refusing it")
            for block in resp.iter_bytes():
                data += block
                if len(data) > limit:
                    raise RegistryError(f"{self.hub}: {what} goes on past {limit} bytes; "
                                        "refusing it")
                if time.monotonic() > end:
                    raise RegistryError(f"{self.hub}: {what} still arriving after "
                                        f"{self.timeout:.0f} s ({len(data)} bytes); the hub "
                                        "sends too slowly: try again, or another hub")
        finally:
            resp.close()
        resp._content = bytes(data)  # what httpx's own read() keeps
        return resp._content

    def _send(
        self,
        method: str,
        url: str,
        scope: str,
        stream: bool,
        headers: dict[str, str] | None,
        kwargs: dict[str, Any],
        deadline: float | None = None,
    ) -> httpx.Response:
        """One request, sent again after ``RETRY_DELAYS`` while there is no answer (or it
        broke off before its end, not streamed) or a balancer's 502/503/504 (the last such
        answer is returned); none is sent past ``deadline``, and each waits at most until
        it for a byte."""
        for delay in (*RETRY_DELAYS, None):
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryError(f"{self.hub}: {method} {one_line(url)}: no answer in time; "
                                        "is the hub running and reachable?")
                kwargs = {**kwargs, "timeout": min(kwargs.get("timeout", self.timeout), left)}
            try:
                req = self.http.build_request(method, url, headers=headers, **kwargs)
                if origin(req.url) == origin(self.hub.url):  # a Location elsewhere gets none
                    req.headers.update(self._auth_header(scope))
                # reads may be redirected (a registry may serve blobs from a CDN); a write
                # never: its body (a pack's bytes) goes where the hub is, not where it says
                resp = self.http.send(req, stream=True,
                                      follow_redirects=method in ("GET", "HEAD"))
                if not stream and resp.status_code not in RETRY_STATUSES:
                    self._read_body(resp, f"{method} {one_line(url)} answer", deadline=deadline)
            except httpx.TransportError as exc:
                if delay is None or (deadline is not None and time.monotonic() > deadline):
                    raise RegistryError(
                        f"{self.hub}: {method} {one_line(url)} failed: {exc}; is the hub "
                        "running and reachable?"
                    ) from exc
            except (httpx.HTTPError, httpx.InvalidURL) as exc:  # a redirect loop, a bad
                # encoding, an unusable Location: the hub's answer, not the network
                raise RegistryError(f"{self.hub}: {method} {one_line(url, 200)}: the hub's "
                                    f"answer is unusable ({exc})") from exc
            else:
                if resp.status_code not in RETRY_STATUSES or delay is None:
                    return resp
                resp.close()
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _check_destination(self, request: httpx.Request) -> None:
        """Refuse a request a redirect or a token realm sends off the hub's origins to an
        address no registry serves from: link-local (a cloud's metadata service at
        169.254.169.254), multicast, unspecified or reserved, or this host's loopback
        when the hub is not on it (a service on this host, past the sandboxes' egress
        rules: the daemon fetches for its callers). A name is resolved here, each of its
        addresses checked, and the request pinned to the first (``_pinned``): a name that
        resolves, or re-resolves a moment later (DNS rebinding), to such an address
        reaches it no more than a literal one does."""
        if origin(request.url) in self.realm_origins:
            return
        host = request.url.host
        hub_on_loopback = _address_kind(httpx.URL(self.hub.url).host) == "loopback"
        addresses = [host] if _is_literal(host) else self._resolved(host, request.url)
        for address in addresses:
            kind = _address_kind(address)
            if kind == "special" or (kind == "loopback" and not hub_on_loopback):
                shown = one_line(host, 100) + ("" if address == host else f" ({address})")
                raise RegistryError(
                    f"{self.hub}: refusing to follow it to {shown} "
                    f"({'a loopback' if kind == 'loopback' else 'a link-local or reserved'} "
                    "address no registry serves from); is the hub what it should be?")
        if addresses[0] != host:
            _pinned(request, addresses[0])

    def _resolved(self, host: str, url: httpx.URL) -> list[str]:
        """The addresses ``host`` resolves to (each checked by the caller)."""
        port = url.port or DEFAULT_PORTS.get(url.scheme, 0)
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise RegistryError(f"{self.hub}: it sends this client to "
                                f"{one_line(host, 100)}, which does not resolve ({exc}); "
                                "is the hub what it should be?") from exc
        addresses = [str(info[4][0]) for info in found]
        if not addresses:
            raise RegistryError(f"{self.hub}: it sends this client to "
                                f"{one_line(host, 100)}, which resolves to no address")
        return addresses

    def _auth_header(self, scope: str) -> dict[str, str]:
        with self._lock:
            token = self._tokens.get(scope)
        if token:
            return {"Authorization": f"Bearer {token}"}
        if self._basic and self.credential:
            pair = f"{self.credential.username}:{self.credential.secret}".encode()
            return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
        return {}

    def _check_credential_scheme(self) -> None:
        """AuthError when the credential was checked over https and this hub is addressed
        over plain http: sending it would show it to anyone on the path (a reference or
        $FORKD_HUB naming ``http://`` the host the user logged in to over TLS)."""
        if self.credential is None or self.hub.scheme != "http":
            return
        checked_over = self.credential.scheme or default_scheme(self.hub.host)
        if checked_over == "https":
            raise AuthError(
                f"{self.hub}: the credentials stored for it were checked over https; refusing "
                f"to send them over plain http ({self.hub.url}). Address the hub as "
                f"https://{self.hub.host}, or, if it only serves plain http, log in to it "
                f"that way: `forkd login http://{self.hub.host}`")

    def _authenticate(self, challenge: str, scope: str) -> None:
        kind = challenge.split(" ", 1)[0].lower()
        if kind == "basic":
            if not self.credential:
                raise AuthError(f"{self.hub} needs a login: run `forkd login {self.hub}`")
            self._check_credential_scheme()
            self._basic = True
            return
        if kind != "bearer":
            raise AuthError(f"{self.hub}: unsupported authentication challenge "
                            f"{one_line(challenge, 200)!r}")
        params = dict(_CHALLENGE_RE.findall(challenge))
        realm = params.get("realm")
        if not realm:
            raise AuthError(f"{self.hub}: bearer challenge without a realm")
        shown = one_line(realm, 200)  # the hub's words, in messages
        try:
            realm_url = self.http.base_url.join(realm)  # a relative realm is the registry's
            origin(realm_url)
        except httpx.InvalidURL as exc:
            raise AuthError(f"{self.hub}: token realm {shown!r} is not a URL ({exc}); is the "
                            "hub what it should be?") from exc
        if realm_url.scheme not in DEFAULT_PORTS:
            raise AuthError(f"{self.hub}: token realm {shown[:100]!r} is not an http(s) URL")
        query = {"service": params.get("service", "")}
        query["scope"] = params.get("scope") or scope
        auth = None
        if self.credential:
            self._check_credential_scheme()
            if origin(realm_url) not in self.realm_origins:
                raise AuthError(
                    f"{self.hub}: the registry asks for credentials at {shown}, another "
                    f"origin than {self.hub.url}; refusing to send them there. If that token "
                    f"service is the registry's, trust it: {TRUSTED_REALMS_ENV}="
                    f"{realm_url.scheme}://{realm_url.netloc.decode()}"
                )
            auth = httpx.BasicAuth(self.credential.username, self.credential.secret)
        try:
            resp = self.http.send(self.http.build_request("GET", realm_url, params=query),
                                  auth=auth or httpx.USE_CLIENT_DEFAULT, stream=True)
            self.read_answer(resp, f"token endpoint {shown} answer")
        except httpx.HTTPError as exc:
            raise AuthError(f"{self.hub}: token endpoint {shown} unreachable: {exc}") from exc
        if resp.status_code in (401, 403):
            hint = (
                "check the username and password (forkd login)"
                if self.credential
                else f"run `forkd login {self.hub}`"
            )
            raise AuthError(f"{self.hub}: token request for "
                            f"{one_line(query['scope'], 200)} refused; {hint}")
        if resp.status_code != 200:
            raise self._error("GET", shown, resp)
        body = json_answer(resp, f"{self.hub}: token endpoint {shown} answer")
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
            raise AuthError(
                f"{self.hub}: token endpoint {shown} answered "
                f"{'an unusable token' if token else 'without a token'} (a token is at most "
                f"{MAX_TOKEN_CHARS} visible ASCII characters); is the hub what it should be?")
        with self._lock:
            self._tokens[scope] = token

    def _error(self, method: str, url: str, resp: httpx.Response) -> RegistryError:
        detail = ""
        codes: tuple[str, ...] = ()
        details: tuple[str, ...] = ()
        if origin(resp.url) not in self.realm_origins:  # redirected: not the hub's words
            detail = f"(from {one_line(str(resp.url.copy_with(query=None)), 200)})"
        else:
            try:
                errors = jsondoc.loads(resp.content, "error answer").get("errors") or []
                detail = "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors)
                codes = tuple(str(e.get("code")) for e in errors)
                details = tuple(str(e.get("detail") or "") for e in errors)
            except (InvalidInput, AttributeError, TypeError):
                detail = resp.text[:200]
        msg = f"{self.hub}: {method} {one_line(url)} → {resp.status_code} {one_line(detail, 1000)}"
        msg = msg.rstrip()
        status = resp.status_code
        if status in (401, 403):
            return AuthError(
                f"{msg}; log in with `forkd login {self.hub}` or ask for the scope",
                codes,
                details,
                status,
            )
        if status == 404:
            return RegistryNotFound(msg, codes, details, status)
        return RegistryError(msg, codes, details, status)

    # -- API ----------------------------------------------------------------
    @staticmethod
    def pull_scope(repo: str) -> str:
        return f"repository:{repo}:pull"

    @staticmethod
    def push_scope(repo: str) -> str:
        return f"repository:{repo}:pull,push"

    def ping(self) -> None:
        self.request("GET", "/v2/", "registry:catalog:*", ok=(200,))

    def has_blob(self, repo: str, digest: str, scope: str | None = None) -> bool:
        resp = self.request(
            "HEAD", f"/v2/{repo}/blobs/{digest}", scope or self.pull_scope(repo), ok=(200, 404)
        )
        return resp.status_code == 200

    def get_blob(
        self,
        repo: str,
        digest: str,
        size: int | None,
        limit: int,
        sink: Callable[[Iterator[bytes]], None],
        deadline: float | None = None,
        read_timeout: float | None = None,
    ) -> None:
        """Stream a blob into ``sink`` (which verifies it), refusing more than ``limit`` bytes.
        ``sink`` is called once: a stream that breaks (its replica went away) is fetched
        again from the start after ``RETRY_DELAYS`` and goes on where the sink's stream
        stopped (the bytes it has are skipped), so no sink sees a block twice. All of it,
        retries included, ends by ``deadline`` (``time.monotonic()``; default
        ``blob_deadline`` of its size): past it, RegistryError naming the blob and what
        arrived (a hub dripping a byte a minute holds no reader for ever); ``read_timeout``:
        the longest wait for any byte (default the client's timeout)."""
        url = f"/v2/{repo}/blobs/{digest}"
        expected = size if size is not None else limit
        start = time.monotonic()
        end = start + blob_deadline(expected) if deadline is None else deadline

        def answer() -> httpx.Response:
            waits: dict[str, Any] = {} if read_timeout is None else {"timeout": read_timeout}
            resp = self.request("GET", url, self.pull_scope(repo), stream=True, deadline=end,
                                **waits)
            declared = resp.headers.get("content-length")
            if declared is not None and (
                int(declared) > limit or (size is not None and int(declared) != size)
            ):
                resp.close()
                raise IntegrityError(
                    f"{repo}@{digest}: registry sends {declared} bytes, "
                    f"expected {size if size is not None else limit}"
                )
            return resp

        def blocks(resp: httpx.Response) -> Iterator[bytes]:
            got = 0  # bytes the sink has
            for delay in (*RETRY_DELAYS, None):
                skip = got
                try:
                    for block in resp.iter_bytes():
                        if time.monotonic() > end:
                            raise RegistryError(
                                f"{self.hub}: GET {url}: {got} of {expected} bytes after "
                                f"{time.monotonic() - start:.0f} s; the hub sends too slowly "
                                "(or stalls): try again, or another hub")
                        if skip >= len(block):
                            skip -= len(block)
                            continue
                        block, skip = block[skip:], 0
                        got += len(block)
                        if got > limit:
                            raise IntegrityError(f"{repo}@{digest}: registry sends more "
                                                 f"than {limit} bytes; refusing it")
                        yield block
                    return
                except httpx.TransportError as exc:
                    if delay is None or time.monotonic() + delay > end:
                        raise RegistryError(f"{self.hub}: GET {url} broke off: {exc}") from exc
                except httpx.HTTPError as exc:  # e.g. a Content-Encoding its body breaks
                    raise RegistryError(f"{self.hub}: GET {url}: the hub's answer is "
                                        f"unusable ({exc})") from exc
                finally:
                    resp.close()
                time.sleep(delay)
                resp = answer()

        first = answer()
        try:
            sink(blocks(first))
        finally:
            first.close()

    def mount_blob(self, repo: str, digest: str, source: str) -> bool:
        resp = self.request(
            "POST",
            f"/v2/{repo}/blobs/uploads/",
            f"{self.push_scope(repo)} {self.pull_scope(source)}",
            params={"mount": digest, "from": source},
            ok=(201, 202),
        )
        if resp.status_code == 202:
            self._cancel(repo, resp)
        return resp.status_code == 201

    def put_blob(
        self, repo: str, digest: str, size: int, read: Callable[[int, int], bytes]
    ) -> None:
        """Upload a blob: small ones in one monolithic POST (``?digest=``, falling back to
        POST then PUT where a registry answers 202 to it), else in chunks (PATCH with
        Content-Range)."""
        scope = self.push_scope(repo)
        if size <= UPLOAD_CHUNK:
            data = read(0, size)
            resp = self.request(
                "POST",
                f"/v2/{repo}/blobs/uploads/",
                scope,
                ok=(201, 202),
                params={"digest": digest},
                content=data,
                headers={"Content-Type": "application/octet-stream"},
            )
            if resp.status_code == 202:  # the registry opened a session and kept nothing
                self.request(
                    "PUT",
                    _with_digest(_location(self.hub, resp), digest),
                    scope,
                    ok=(201,),
                    content=data,
                    headers={"Content-Type": "application/octet-stream"},
                )
            return
        for restart in range(UPLOAD_RESTARTS + 1):
            try:
                self._put_chunked(repo, digest, size, read, scope)
                return
            except RegistryNotFound as exc:
                if "BLOB_UPLOAD_UNKNOWN" not in exc.codes:
                    raise
                if self.has_blob(repo, digest, scope):  # the closing PUT's answer was lost
                    return
                if restart == UPLOAD_RESTARTS:
                    raise

    def _put_chunked(
        self, repo: str, digest: str, size: int, read: Callable[[int, int], bytes], scope: str
    ) -> None:
        """One upload session: PATCH chunks, going on from the registry's Range when it
        refuses one (416: it has more, or fewer, bytes than this client thought)."""
        resp = self.request(
            "POST", f"/v2/{repo}/blobs/uploads/", scope, ok=(202,), headers={"Content-Length": "0"}
        )
        location = _location(self.hub, resp)
        offset = resyncs = sent = 0  # sent: the furthest byte any PATCH so far carried
        while offset < size:
            data = read(offset, min(UPLOAD_CHUNK, size - offset))
            sent = max(sent, offset + len(data))
            try:
                resp = self.request(
                    "PATCH",
                    location,
                    scope,
                    ok=(202,),
                    content=data,
                    headers={
                        "Content-Type": "application/octet-stream",
                        "Content-Range": f"{offset}-{offset + len(data) - 1}",
                        "Content-Length": str(len(data)),
                    },
                )
            except RegistryError as exc:
                resyncs += 1
                if exc.status != 416 or resyncs > UPLOAD_RESTARTS:
                    raise
                offset, location = self._upload_progress(location, scope, sent)
                continue
            location = resp.headers.get("location", location)
            offset += len(data)
        self.request(
            "PUT",
            _with_digest(location, digest),
            scope,
            ok=(201,),
            headers={"Content-Length": "0"},
        )

    def _upload_progress(self, location: str, scope: str, sent: int) -> tuple[int, str]:
        """Where an upload session stands (``GET`` on it): the next offset, its location.
        ``Range: 0-0`` is read as empty (registries answer it for 0 bytes and for 1; a
        wrong guess is one more 416, and the resyncs are bounded). A registry cannot hold
        more than the ``sent`` bytes this client has sent it: claiming more is an error."""
        resp = self.request("GET", location, scope, ok=(204,))
        match = re.fullmatch(r"0-([0-9]+)", resp.headers.get("range", "").strip())
        end = int(match.group(1)) if match else 0
        offset = end + 1 if end else 0
        if offset > sent:
            raise RegistryError(
                f"{self.hub}: upload {one_line(location)} claims {offset} bytes, but only {sent} "
                "were sent to it; the registry's upload session is corrupt: try the push again"
            )
        return offset, resp.headers.get("location", location)

    def _cancel(self, repo: str, resp: httpx.Response) -> None:
        location = resp.headers.get("location")
        if location:
            self.request("DELETE", location, self.push_scope(repo), ok=(204, 404))

    def get_manifest(self, repo: str, reference: str) -> tuple[bytes, str]:
        """Manifest bytes and their digest, checked against a digest reference when given."""
        resp = self.request(
            "GET",
            f"/v2/{repo}/manifests/{reference}",
            self.pull_scope(repo),
            headers={"Accept": MANIFEST_ACCEPT},
            stream=True,
        )
        data = self.read_answer(resp, f"{repo}:{reference} manifest", MAX_MANIFEST_BYTES)
        digest = dg.of_bytes(data)
        if reference.startswith("sha256:"):
            dg.check(reference, digest, f"{repo}@{reference} manifest")
        return data, digest

    def put_manifest(self, repo: str, reference: str, data: bytes) -> str:
        resp = self.request(
            "PUT",
            f"/v2/{repo}/manifests/{reference}",
            self.push_scope(repo),
            ok=(201,),
            content=data,
            headers={"Content-Type": mt.OCI_MANIFEST},
        )
        # the digest of what was sent, in the hub's algorithm when it names a known one (a
        # manifest PUT by its sha512 is answered with that): its word is checked, not taken
        said = resp.headers.get("docker-content-digest") or ""
        try:
            algorithm = dg.algorithm_of(said) if said else dg.ALGORITHM
        except InvalidInput:
            algorithm = dg.ALGORITHM
        digest = dg.of_bytes(data, algorithm)
        if said and said != digest:
            raise RegistryError(
                f"{self.hub}: PUT manifest {repo}:{one_line(reference, 100)} answered "
                f"digest {one_line(said, 100)!r}, but the manifest sent is {digest}; the "
                "hub did not store what was pushed: check the hub, then push again")
        return digest


def json_answer(resp: httpx.Response, what: str) -> dict[str, Any]:
    """A registry's JSON answer, which must be an object (nesting bounded by forkd.jsondoc)."""
    try:
        doc = jsondoc.loads(resp.content, what)
    except InvalidInput as exc:
        raise RegistryError(f"{exc}; is the address a forkd hub or an OCI registry?") from exc
    if not isinstance(doc, dict):
        raise RegistryError(f"{what} is not a JSON object; is the address a forkd hub?")
    return doc


def _is_literal(host: str) -> bool:
    """Whether a URL's host is an IP address (not a name to resolve)."""
    try:
        addresses.parsed(host)
    except ValueError:
        return host.lower() == "localhost" or host.lower().endswith(".localhost")
    return True


def _pinned(request: httpx.Request, address: str) -> None:
    """Send ``request`` to ``address`` (checked) rather than to its name resolved again:
    its Host header stays the name, and TLS still checks the certificate for the name
    (``sni_hostname``)."""
    name = request.url.host
    request.url = request.url.copy_with(host=address)
    request.extensions = {**request.extensions, "sni_hostname": name}


def _address_kind(host: str) -> str:
    """"loopback", "special" (addresses.kind: a cloud's metadata or host services,
    multicast, unspecified, reserved) or "other" (a name, or any other address) of a URL's
    host."""
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return "loopback"
    try:
        return addresses.kind(host)
    except ValueError:
        return "other"


def _location(hub: Hub, resp: httpx.Response) -> str:
    """The upload session an answer names (its ``Location``); RegistryError without one."""
    location: str = resp.headers.get("location", "")
    if not location:
        raise RegistryError(f"{hub}: {resp.request.method} {resp.request.url} answered "
                            f"{resp.status_code} without a Location; is it an OCI registry?")
    return location


def _with_digest(location: str, digest: str) -> str:
    """An upload location with ``digest=`` added to whatever query it already carries."""
    try:
        url = httpx.URL(location)
    except httpx.InvalidURL as exc:
        raise RegistryError(f"the registry's upload location {one_line(location, 200)!r} "
                            f"is not a URL ({exc})") from exc
    return str(url.copy_merge_params({"digest": digest}))


class RegistryNotFound(RegistryError, NotFound):
    exit_code = 3
