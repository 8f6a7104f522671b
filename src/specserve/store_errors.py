"""Domain exceptions of the session/commit store (specserve.store)."""

from specserve.errors import InvalidRequest, SpecserveError


class SessionNotFound(SpecserveError, LookupError):
    """No such session, or it expired (gRPC NOT_FOUND)."""


class RequestIdConflict(InvalidRequest):
    """A request_id was reused for a different prompt: a retry must resend the same request."""
