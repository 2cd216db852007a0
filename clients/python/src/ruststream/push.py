"""Push receivers: verify a push's Standard Webhooks signature and read its message(s), and
answer with a ``Ruststream-Settle`` header value (``ack``, ``later``, ``nak``, ``term``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence, Union

#: The answer header the gateway reads (docs/push.md).
SETTLE_HEADER = "Ruststream-Settle"
#: Signatures older or newer than this (seconds) are refused, as Standard Webhooks says.
TOLERANCE_SECONDS = 300
_MAX_DELAY_MS = 604_800_000

Headers = Union[Mapping[str, str], Iterable[tuple[Union[bytes, str], Union[bytes, str]]]]


class PushVerificationError(ValueError):
    """The push is not signed by any of the secrets, too old, or malformed."""


@dataclass(frozen=True)
class PushedMessage:
    """One pushed message; ``id`` is its lease id (settle it through the usual routes when
    answering ``later``)."""

    id: str
    subject: str
    data: bytes
    headers: dict[str, list[str]]
    stream: str
    stream_sequence: int
    delivered: int
    raw: dict[str, Any] = field(repr=False)

    def text(self) -> str:
        return self.data.decode()

    def json(self) -> Any:
        return json.loads(self.data)


def _lower(headers: Headers) -> dict[str, str]:
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for name, value in items:
        key = (name.decode("latin-1") if isinstance(name, bytes) else name).lower()
        out[key] = value.decode("latin-1") if isinstance(value, bytes) else value
    return out


def _keys(secrets: str | Sequence[str]) -> list[bytes]:
    keys = []
    for secret in [secrets] if isinstance(secrets, str) else secrets:
        secret = secret.strip()
        keys.append(base64.b64decode(secret[6:] if secret.startswith("whsec_") else secret))
    if not keys:
        raise ValueError("no secret given")
    return keys


def verify_push(secrets: str | Sequence[str], headers: Headers, body: bytes,
                *, now: float | None = None) -> list[PushedMessage]:
    """Check the push's ``webhook-signature`` against every secret (rotation: any may match;
    constant-time comparisons) and its ``webhook-timestamp`` (± 5 min), then return its
    message(s): one for a single push, each of a batch, in order. Raises
    PushVerificationError."""
    lowered = _lower(headers)
    webhook_id = lowered.get("webhook-id")
    timestamp = lowered.get("webhook-timestamp")
    signatures = lowered.get("webhook-signature")
    if not webhook_id or not timestamp or not signatures:
        raise PushVerificationError("webhook-id, webhook-timestamp or webhook-signature missing")
    try:
        sent = int(timestamp)
    except ValueError:
        raise PushVerificationError("webhook-timestamp is not a number") from None
    if abs((time.time() if now is None else now) - sent) > TOLERANCE_SECONDS:
        raise PushVerificationError("webhook-timestamp outside the 5 min tolerance")
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    expected = [base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest())
                for key in _keys(secrets)]
    matched = False
    for entry in signatures.split(" "):
        version, _, value = entry.partition(",")
        if version != "v1":
            continue
        for candidate in expected:
            matched |= hmac.compare_digest(candidate, value.encode())
    if not matched:
        raise PushVerificationError("no signature matches")
    return _messages(lowered, body)


def _messages(headers: dict[str, str], body: bytes) -> list[PushedMessage]:
    if headers.get("content-type", "").startswith("application/json") and body[:1] == b"{":
        document = json.loads(body)
        raws = document["messages"] if "messages" in document else [document]
        return [_from_json(raw) for raw in raws]
    # binary or CloudEvents: the body is the payload; the rest is in headers.
    return [PushedMessage(
        id=headers.get("ruststream-lease-id", ""), subject=headers.get("ruststream-subject", ""),
        data=body, headers={}, stream=headers.get("ruststream-stream", ""),
        stream_sequence=int(headers.get("ruststream-stream-sequence") or 0),
        delivered=int(headers.get("ruststream-delivered") or 0), raw={})]


def _from_json(raw: dict[str, Any]) -> PushedMessage:
    text = raw.get("data") or ""
    data = text.encode() if raw.get("encoding") == "utf8" else base64.b64decode(text)
    return PushedMessage(id=raw["id"], subject=raw["subject"], data=data,
                         headers=raw.get("headers") or {}, stream=raw["stream"],
                         stream_sequence=int(raw["stream_sequence"]),
                         delivered=int(raw["delivered"]), raw=raw)


# --- answers: values of the Ruststream-Settle header ----------------------------------------
def ack() -> str:
    return "ack"


def later() -> str:
    """Leave it leased: settle it by its lease id before ``lease_expires_at``."""
    return "later"


def nak(delay: float | None = None) -> str:
    """Redelivered after ``delay`` seconds (whole milliseconds, at most a week)."""
    if delay is None:
        return "nak"
    ms = int(round(delay * 1000))
    if not 0 <= ms <= _MAX_DELAY_MS:
        raise ValueError("nak delay must be 0 to 604800 seconds")
    return f"nak; delay={ms}"


def term(reason: str | None = None) -> str:
    """Terminate (dead-lettered with ``reason``); the reason is made printable ASCII, as an
    HTTP header must be, and cut to 1 024 characters."""
    if not reason:
        return "term"
    clean = "".join(c if " " <= c <= "~" and c != '"' else " " for c in reason)[:1024]
    return f"term; reason={clean}"
