"""Exceptions a handler raises to settle its message, and those the worker raises to its caller."""

from __future__ import annotations


class Nak(Exception):
    """Raise from a handler to nak its message: redelivered after ``delay`` seconds.

    ``delay=None`` uses the worker's backoff (as any other exception does, but without an
    error logged); ``Nak(0)`` asks for the message again at once.
    """

    def __init__(self, delay: float | None = None) -> None:
        super().__init__(f"nak (delay {delay}s)" if delay is not None else "nak")
        if delay is not None and delay < 0:
            raise ValueError("Nak delay must be >= 0 seconds")
        self.delay = delay


class Term(Exception):
    """Raise from a handler to terminate its message: never redelivered, dead-lettered with
    ``reason`` where the consumer dead-letters."""

    def __init__(self, reason: str | None = None) -> None:
        super().__init__(reason or "term")
        self.reason = reason


class GatewayError(Exception):
    """The gateway answered a request with an error the worker cannot work around."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"gateway answered {status}: {detail}")
        self.status = status
        self.detail = detail


class AuthError(GatewayError):
    """401 or 403: the token is missing, unknown, or lacks a scope. Stops the worker."""
