"""HTTP errors as OpenAI-style JSON bodies, and which status each kvmemory error becomes.

Every error response is `{"error": {"message", "type", "code", "param"}}` (what the `openai` client
parses into its exception's message), with a status that says whose fault it is: 400 bad input, 401
no or unknown key, 403 a scope the key may not use, 404 no such entry or model, 409 a profile the
server does not run, 413 a body past the limit, 422 a solution the verifier refused, 429 the queue is
full, 503 shutting down, 500 the server's own fault (logged with its traceback, message kept short).
"""

from __future__ import annotations

from kvmemory.errors import (BundleError, InvalidInput, IntegrityError, KVMemoryError, NotOnGrid, ProfileMismatch, StoreReadOnly,
                             UnknownEntry, VerificationFailed)


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error type."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def from_kvmemory(exc: KVMemoryError) -> ApiError:
    """The HTTP error a library error becomes (its message says what to do)."""
    name = type(exc).__name__
    msg = f"{name}: {exc}"
    status = getattr(exc, "http_status", None)  # an error class that names its own status
    if isinstance(status, int):
        return ApiError(status, msg, "permission_error" if status == 403 else "invalid_request_error", code=name)
    if isinstance(exc, UnknownEntry):
        return ApiError(404, msg, "not_found_error", code="unknown_entry")
    if isinstance(exc, VerificationFailed):
        return ApiError(422, msg, "verification_error", code="verification_failed")
    if isinstance(exc, ProfileMismatch):
        return ApiError(409, msg, "profile_mismatch", code="profile_mismatch")
    if isinstance(exc, StoreReadOnly):
        return ApiError(409, msg, "store_read_only", code="store_read_only")
    if isinstance(exc, BundleError):  # an uploaded bundle that does not check: the client's file
        return ApiError(400, msg, "invalid_request_error", code="bad_bundle")
    if isinstance(exc, (InvalidInput, NotOnGrid)):
        return ApiError(400, msg, "invalid_request_error", code=name)
    if isinstance(exc, IntegrityError):
        return ApiError(500, msg, "integrity_error", code=name)
    return ApiError(500, msg, "server_error", code=name)
