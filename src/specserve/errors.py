"""Domain exceptions. Services map them to gRPC status codes in one place."""


class SpecserveError(Exception):
    """Base class for every error specserve raises on purpose."""


class InvalidRequest(SpecserveError, ValueError):
    """The caller sent something that can never succeed (gRPC INVALID_ARGUMENT)."""


class IncompatiblePair(SpecserveError, ValueError):
    """A draft/target pair that cannot be used together (different vocabularies)."""


class NeedsFullPrefix(SpecserveError):
    """A worker's cached tokens disagree with the request: resend the committed prefix
    (gRPC FAILED_PRECONDITION)."""


class Unavailable(SpecserveError):
    """A dependency (target, Redis) could not be reached in time (gRPC UNAVAILABLE)."""


class ResourceExhausted(SpecserveError):
    """No room now (gRPC RESOURCE_EXHAUSTED): retry later, or with less load."""


class KVBudgetExhausted(ResourceExhausted):
    """Every KV slot of a worker is held by a running session: free one or retry later."""


class SessionLost(SpecserveError):
    """Another router took the session over, or it expired (gRPC ABORTED): Resume it."""


class ServedTokensChanged(SpecserveError):
    """A client was served tokens that the store lost (a Redis failover without replica
    acknowledgement, ADR 0023) and that were then generated differently (gRPC DATA_LOSS)."""


class SessionClosed(SpecserveError):
    """The session has ended (finished, cancelled or failed): nothing more to drive (gRPC
    FAILED_PRECONDITION)."""


class SessionNotFound(SpecserveError, LookupError):
    """No such session, or it expired (gRPC NOT_FOUND)."""


class AdapterNotFound(SessionNotFound):
    """No LoRA adapter of that name is loaded (gRPC NOT_FOUND; HTTP 404 `model_not_found`; ADR 0029)."""


class RequestIdConflict(InvalidRequest):
    """A request_id was reused for a different prompt: a retry must resend the same request."""


class Internal(SpecserveError):
    """The session failed inside a worker (gRPC INTERNAL); its committed tokens are kept."""
