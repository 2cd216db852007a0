"""The leased message a handler receives, with its explicit settles (ack, nak, term, extend)."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Generator

if TYPE_CHECKING:
    from .worker import Worker

# Where the message is in the worker: waiting in the buffer, in its handler, its settle sent,
# or gone from the worker's hands.
BUFFERED, RUNNING, SETTLING, DONE = 0, 1, 2, 3

# Epoch seconds of "YYYY-MM-DDTHH:MM:SS" prefixes already parsed: the messages of one second
# share one, and parsing each timestamp in full would cost more than the rest of a message.
_SECOND_CACHE: dict[str, float] = {}


def parse_rfc3339(text: str) -> float:
    """Epoch seconds of an RFC 3339 time as the gateway writes it (UTC, up to nanoseconds)."""
    if len(text) >= 20 and text[-1] == "Z":
        prefix = text[:19]
        base = _SECOND_CACHE.get(prefix)
        if base is None:
            if len(_SECOND_CACHE) > 4096:
                _SECOND_CACHE.clear()
            base = datetime.fromisoformat(prefix).replace(tzinfo=timezone.utc).timestamp()
            _SECOND_CACHE[prefix] = base
        fraction = text[19:-1]  # ".123456789": float() reads it as it is
        return base + float(fraction) if fraction else base
    # Any other offset: the full parse (Python 3.10 takes neither "Z" nor nanoseconds).
    head, _, tail = text.partition(".")
    digits = "".join(c for c in tail if c.isdigit())
    offset = tail[len(digits):] or "+00:00"
    stamp = datetime.fromisoformat(head + offset.replace("Z", "+00:00")).timestamp()
    return stamp + (float("0." + digits) if digits else 0.0)


class Settlement:
    """What an explicit settle returns. ``await`` it in an async handler to wait for the
    gateway's confirmation; a sync handler's call has already waited. Failures (lease gone,
    already settled) are counted in ``worker.stats`` and logged, never raised."""

    __slots__ = ("_future",)

    def __init__(self, future: asyncio.Future[None] | None) -> None:
        self._future = future

    def __await__(self) -> Generator[Any, None, None]:
        if self._future is not None:
            yield from self._future.__await__()


class Message:
    """One leased message. ``id`` is its lease id; the lease is the worker's to keep alive."""

    __slots__ = (
        "id", "_raw", "_worker", "_data", "state", "deadline", "extend_at", "received_at",
        "key", "user_settled", "size", "started",
    )

    def __init__(self, raw: dict[str, Any], worker: Worker, now: float, lease: float) -> None:
        #: the lease id, which settles the message
        self.id: str = raw["id"]
        self._raw = raw
        self._worker = worker
        self._data: bytes | None = None
        self.state = BUFFERED
        self.received_at = now
        self.deadline = now + lease
        self.extend_at = now + lease / 2
        self.key: str | None = None
        self.user_settled = False
        self.size = len(raw.get("data") or "")
        self.started = False

    # --- what the gateway sent -------------------------------------------------------------
    @property
    def data(self) -> bytes:
        """The payload's exact bytes."""
        if self._data is None:
            text = self._raw.get("data") or ""
            if self._raw.get("encoding") == "utf8":
                self._data = text.encode()
            else:
                self._data = base64.b64decode(text)
        return self._data

    def text(self, encoding: str = "utf-8") -> str:
        if self._raw.get("encoding") == "utf8" and encoding.lower() in ("utf-8", "utf8"):
            return str(self._raw.get("data") or "")
        return self.data.decode(encoding)

    def json(self) -> Any:
        return json.loads(self.data)

    @property
    def subject(self) -> str:
        return str(self._raw["subject"])

    @property
    def headers(self) -> dict[str, list[str]]:
        """NATS headers, name → values (a header may repeat)."""
        headers: dict[str, list[str]] = self._raw.get("headers") or {}
        return headers

    @property
    def stream(self) -> str:
        return str(self._raw["stream"])

    @property
    def consumer(self) -> str:
        return str(self._raw["consumer"])

    @property
    def stream_sequence(self) -> int:
        return int(self._raw["stream_sequence"])

    @property
    def consumer_sequence(self) -> int:
        return int(self._raw["consumer_sequence"])

    @property
    def delivered(self) -> int:
        """Delivery attempt, from 1."""
        return int(self._raw["delivered"])

    @property
    def published_at(self) -> datetime:
        return datetime.fromtimestamp(parse_rfc3339(self._raw["published_at"]), timezone.utc)

    @property
    def lease_expires_at(self) -> datetime:
        """When the current lease ends (UTC), as the worker last learnt it from the gateway."""
        remaining = self.deadline - time.monotonic()
        return datetime.fromtimestamp(time.time() + remaining, timezone.utc)

    @property
    def raw(self) -> dict[str, Any]:
        """The message exactly as the gateway sent it (a fetched message's JSON)."""
        return self._raw

    def __repr__(self) -> str:
        return (f"Message(subject={self.subject!r}, stream_sequence={self.stream_sequence}, "
                f"delivered={self.delivered})")

    # --- explicit settles ------------------------------------------------------------------
    def ack(self) -> Settlement:
        """Ack now; the handler's return then settles nothing more."""
        return self._explicit("ack", None, None)

    def nak(self, delay: float | None = None) -> Settlement:
        """Nak now: redelivered after ``delay`` seconds (``None``: the worker's backoff)."""
        return self._explicit("nak", delay, None)

    def term(self, reason: str | None = None) -> Settlement:
        """Terminate now (dead-lettered with ``reason`` where the consumer dead-letters)."""
        return self._explicit("term", None, reason)

    def extend(self) -> Settlement:
        """Extend the lease now (``in-progress``); the worker also does so by itself."""
        return self._explicit("in_progress", None, None)

    def _explicit(self, op: str, delay: float | None, reason: str | None) -> Settlement:
        worker = self._worker
        loop = worker.loop
        if loop is None:
            raise RuntimeError("the message's worker is not running")
        if threading.get_ident() == worker.loop_thread:
            return Settlement(worker.settle_explicit(self, op, delay, reason))

        async def on_loop() -> None:
            await worker.settle_explicit(self, op, delay, reason)

        asyncio.run_coroutine_threadsafe(on_loop(), loop).result()
        return Settlement(None)
