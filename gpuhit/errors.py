"""One flat error hierarchy for the whole project.

Every error a user can cause or meet derives from :class:`GpuhitError`, so the CLI and the HTTP
boundary map them in one place (CLI: message + exit code 2; HTTP: ``http_status`` + JSON body).
``assert`` is kept for internal invariants only.
"""

from __future__ import annotations


class GpuhitError(Exception):
    """Base of every error gpuhit raises on purpose."""

    http_status = 500
    code = "internal_error"


class ConfigError(GpuhitError):
    """Bad configuration: unknown policy or profile, invalid parameter, bad flag combination."""

    http_status = 400
    code = "invalid_config"


class TraceFormatError(GpuhitError):
    """A trace file or record that cannot be read; carries ``path`` and ``line`` when known."""

    http_status = 400
    code = "invalid_trace"

    def __init__(self, reason: str, path: str | None = None, line: int | None = None):
        self.reason = reason
        self.path = path
        self.line = line
        where = f"{path}:{line}: " if path is not None and line is not None else (f"{path}: " if path else "")
        super().__init__(f"{where}{reason}")


class BadRequestError(GpuhitError):
    """A client request the gateway or an engine refuses (malformed body, wrong types, too long)."""

    http_status = 400
    code = "invalid_request_error"


class PayloadTooLargeError(BadRequestError):
    http_status = 413
    code = "payload_too_large"


class NotFoundError(GpuhitError):
    """Unknown model, route or resource."""

    http_status = 404
    code = "not_found"


class UnauthorizedError(GpuhitError):
    http_status = 401
    code = "unauthorized"


class EngineError(GpuhitError):
    """An engine failed: unreachable, died mid-stream, answered garbage."""

    http_status = 502
    code = "upstream_error"


class NoInstanceError(GpuhitError):
    """No healthy instance can take the request."""

    http_status = 503
    code = "no_healthy_instance"


class CapacityError(GpuhitError):
    """A request can never fit (longer than max_model_len, more blocks than the pool has)."""

    http_status = 400
    code = "context_length_exceeded"


class TransferError(GpuhitError):
    """A KV transfer failed (Mooncake, in-process, NVSHMEM)."""

    http_status = 502
    code = "kv_transfer_failed"


class UnavailableError(GpuhitError):
    """An optional capability whose dependency or hardware is missing (no GPU, no torch, no mooncake)."""

    http_status = 501
    code = "unavailable"


class DeadlockError(GpuhitError):
    """The virtual-time loop has nothing runnable and no timer: the simulation can never progress."""
