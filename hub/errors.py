"""OCI Distribution error codes and the one place they become HTTP responses.

Every failure of a ``/v2/`` route raises ``RegistryError`` with a code from the
spec's table; ``registry_error_handler`` renders the JSON body
``{"errors": [{"code", "message", "detail"}]}`` with the code's status.
"""

from __future__ import annotations

from enum import Enum

from litestar import Request, Response
from litestar.datastructures import State
from litestar.exceptions import ValidationException
from sqlalchemy.exc import DBAPIError

from forkd.bodies import explained
from forkd.errors import Conflict, InvalidInput
from forkd.hub.db import transient


class Code(Enum):
    """The spec's error codes with their default HTTP status and message."""

    BLOB_UNKNOWN = (404, "blob unknown to registry")
    BLOB_UPLOAD_INVALID = (400, "blob upload invalid")
    BLOB_UPLOAD_UNKNOWN = (404, "blob upload unknown to registry")
    DIGEST_INVALID = (400, "provided digest did not match uploaded content")
    MANIFEST_BLOB_UNKNOWN = (400, "manifest references a manifest or blob unknown to registry")
    MANIFEST_INVALID = (400, "manifest invalid")
    MANIFEST_UNKNOWN = (404, "manifest unknown to registry")
    NAME_INVALID = (400, "invalid repository name")
    NAME_UNKNOWN = (404, "repository name not known to registry")
    SIZE_INVALID = (400, "provided length did not match content length")
    UNAUTHORIZED = (401, "authentication required")
    DENIED = (403, "requested access to the resource is denied")
    UNSUPPORTED = (415, "the operation is unsupported")
    TOOMANYREQUESTS = (429, "too many requests")
    # Not in the spec's table: the answer Docker's registry gives when it cannot serve
    # now; clients retry a 503.
    UNAVAILABLE = (503, "service unavailable")
    UNKNOWN = (500, "unknown error")  # Docker's registry's, for its own faults

    @property
    def status(self) -> int:
        return self.value[0]

    @property
    def message(self) -> str:
        return self.value[1]


class RegistryError(Exception):
    """A failure of a registry request, rendered as the spec's error body."""

    def __init__(
        self,
        code: Code,
        detail: str = "",
        *,
        status: int | None = None,
        headers: dict[str, str] | None = None,
        message: str | None = None,
    ) -> None:
        super().__init__(f"{code.name}: {detail}" if detail else code.name)
        self.code = code
        self.detail = detail
        self.status = status or code.status
        self.headers = headers or {}
        self.message = message or code.message  # the body's "message" (default: the code's)


def _registry(request: Request[object, object, State]) -> bool:
    """Whether ``request`` is the registry's (``/v2`` and under): its errors take the
    spec's body."""
    path = request.url.path
    return path == "/v2" or path.startswith("/v2/")


def registry_error_handler(_: Request[object, object, State], exc: Exception) -> Response[object]:
    assert isinstance(exc, RegistryError)
    body = {"errors": [{"code": exc.code.name, "message": exc.message, "detail": exc.detail}]}
    return Response(body, status_code=exc.status, headers=exc.headers)


def invalid_input_handler(
    request: Request[object, object, State], exc: Exception
) -> Response[object]:
    """``InvalidInput`` that no route turned into its own answer (e.g. a value the database
    refused, hub/db.py ``check_storable``) is the client's error, 400, never a 500: in the
    registry's error body on ``/v2/``, Litestar's elsewhere."""
    assert isinstance(exc, InvalidInput)
    if _registry(request):
        return registry_error_handler(
            request, RegistryError(Code.UNSUPPORTED, str(exc), status=400)
        )
    return Response({"status_code": 400, "detail": str(exc)}, status_code=400)


def validation_error_handler(
    request: Request[object, object, State], exc: Exception
) -> Response[object]:
    """A body or parameter that does not match its route's type: 400 saying which field
    and why, never the request's URL (Litestar's own detail repeats the query string)."""
    assert isinstance(exc, ValidationException)
    return invalid_input_handler(request, InvalidInput(explained(exc)))


def conflict_handler(request: Request[object, object, State], exc: Exception) -> Response[object]:
    """``Conflict`` that no route turned into its own answer (e.g. a concurrent request
    created the same name first, hub/db.py ``ConcurrentChange``): 409, never a 500; in the
    registry's error body on ``/v2/``, Litestar's elsewhere."""
    assert isinstance(exc, Conflict)
    if _registry(request):
        return registry_error_handler(request, RegistryError(Code.DENIED, str(exc), status=409))
    return Response({"status_code": 409, "detail": str(exc)}, status_code=409)


RETRY_AFTER_S = 1  # Retry-After of a request whose transaction the database ended


def database_error_handler(
    request: Request[object, object, State], exc: Exception
) -> Response[object]:
    """A database error no route turned into its own answer. One the database raised only
    because of another request (``db.transient``: a deadlock PostgreSQL broke between
    two requests, a serialization failure, SQLite still locked after its wait) is 503
    with ``Retry-After``: nothing was written and the same request may be sent again;
    before, it was a 500 that told the client nothing. Any other is the hub's fault: 500,
    naming nothing of the statement or its values (logged with its traceback)."""
    assert isinstance(exc, DBAPIError)
    if not transient(exc):
        detail = "internal error of the hub's database; its operator has the log"
        if _registry(request):
            return registry_error_handler(
                request, RegistryError(Code.UNKNOWN, detail, message=detail)
            )
        return Response({"status_code": 500, "detail": detail}, status_code=500)
    detail = (
        "the database ended this request's transaction to let a concurrent one go on "
        "(nothing was changed): send the request again"
    )
    headers = {"Retry-After": str(RETRY_AFTER_S)}
    if _registry(request):
        return registry_error_handler(
            request, RegistryError(Code.UNAVAILABLE, detail, headers=headers, message=detail)
        )
    return Response({"status_code": 503, "detail": detail}, status_code=503, headers=headers)
