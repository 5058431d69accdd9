"""Typed errors of the sharding service, shared by the server (which maps them to HTTP replies) and the client
(which maps replies back to them), in the spirit of torchelastic's ``RendezvousError`` family.

Every rejected request changes nothing in the service state: `decide` validates the whole request before it
produces any change, so an error can be raised at any point of validation.
"""

from __future__ import annotations

__all__ = [
    "AntDTError",
    "BadRequestError",
    "FencedError",
    "NotFoundError",
    "PayloadTooLargeError",
    "RefusedError",
    "ServiceError",
    "ServiceUnavailableError",
    "StaleIncarnationError",
    "UnauthorizedError",
    "UnknownWorkerError",
    "error_from_payload",
]


class AntDTError(RuntimeError):
    """Base class of every error raised by `antdt_callbacks`."""


class ServiceError(AntDTError):
    """A request the service rejected. ``code`` is a stable machine-readable name; ``status`` the HTTP status."""

    code = "service_error"
    status = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def to_payload(self) -> dict:
        return {"error": self.code, "message": self.message}


class BadRequestError(ServiceError):
    """The request is malformed: not JSON, a missing or mistyped field, an out-of-range value, an unknown op."""

    code = "bad_request"
    status = 400


class UnauthorizedError(ServiceError):
    """The shared token is missing or wrong."""

    code = "unauthorized"
    status = 401


class UnknownWorkerError(ServiceError):
    """The rank is outside the job's world size, or it has not registered yet."""

    code = "unknown_worker"
    status = 403


class NotFoundError(ServiceError):
    """The named object (snapshot, route) does not exist."""

    code = "not_found"
    status = 404


class StaleIncarnationError(ServiceError):
    """The request comes from an older incarnation of a worker than the one registered (a zombie after a restart)."""

    code = "stale_incarnation"
    status = 409


class FencedError(ServiceError):
    """The lease named by the request is no longer held by the caller (it expired, was revoked by a restore, or was
    re-leased). The caller must drop the shard: whatever it consumed from it after the last accepted ack is not
    recorded, and in synchronous training the job has to roll back to its last checkpoint."""

    code = "fenced"
    status = 409


class RefusedError(ServiceError):
    """A well-formed request the job's rules forbid: evicting below ``min_nodes``, a blacklisted node joining or
    re-forming the job. The message says which rule and why; nothing was changed."""

    code = "refused"
    status = 409


class PayloadTooLargeError(ServiceError):
    """The request body is larger than the service accepts."""

    code = "payload_too_large"
    status = 413


class ServiceUnavailableError(AntDTError):
    """The client could not reach the service within its retry budget."""


_BY_CODE = {cls.code: cls for cls in (BadRequestError, UnauthorizedError, UnknownWorkerError, NotFoundError,
                                      StaleIncarnationError, FencedError, PayloadTooLargeError, RefusedError,
                                      ServiceError)}


def error_from_payload(payload: dict) -> ServiceError:
    """Rebuild the typed error from a service reply ``{"error": code, "message": text}``."""
    cls = _BY_CODE.get(str(payload.get("error")), ServiceError)
    return cls(str(payload.get("message", "no message")))
