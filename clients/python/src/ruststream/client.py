"""The producer side: ``Client(url, token).publish(...)`` over the gateway's ``POST /publish``."""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Mapping, Sequence

import httpx

from ._gateway import detail_of, raise_for_auth
from .errors import GatewayError


@dataclass(frozen=True)
class PublishAck:
    """Where the stream stored the message; ``duplicate`` when ``msg_id`` was seen already
    within the stream's duplicate window (nothing stored again)."""

    stream: str
    sequence: int
    duplicate: bool


class Client:
    """An HTTP client of the gateway for publishing. Use ``async with Client(...) as c`` or
    call ``aclose()``."""

    def __init__(self, url: str, token: str | None = None, *, timeout: float = 30.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers,
                                       timeout=timeout)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def publish(self, subject: str, data: bytes | str = b"", *,
                      headers: Mapping[str, str | Sequence[str]] | None = None,
                      msg_id: str | None = None,
                      ordering_key: str | None = None) -> PublishAck:
        """Publish once the stream stored it. ``msg_id`` becomes ``Nats-Msg-Id`` (the stream
        stores a retry of it once); ``ordering_key`` becomes ``Ruststream-Ordering-Key``.
        Raises GatewayError (AuthError on 401/403) when refused; a 503 is retried up to
        three times, as the gateway's ``Retry-After`` asks (safe with a ``msg_id``)."""
        body: dict[str, Any] = {"subject": subject}
        if isinstance(data, str):
            body["data"], body["encoding"] = data, "utf8"
        else:
            body["data"], body["encoding"] = base64.b64encode(data).decode(), "base64"
        merged: dict[str, list[str]] = {}
        for name, value in (headers or {}).items():
            merged[name] = [value] if isinstance(value, str) else list(value)
        if msg_id is not None:
            merged["Nats-Msg-Id"] = [msg_id]
        if merged:
            body["headers"] = merged
        if ordering_key is not None:
            body["ordering_key"] = ordering_key
        for attempt in range(4):
            response = await self._http.post("/publish", json=body)
            if response.status_code == 503 and attempt < 3 and msg_id is not None:
                await asyncio.sleep(float(response.headers.get("Retry-After") or 1))
                continue
            break
        raise_for_auth(response)
        if response.status_code != 201:
            raise GatewayError(response.status_code, detail_of(response))
        answer = response.json()
        return PublishAck(str(answer["stream"]), int(answer["sequence"]),
                          bool(answer.get("duplicate")))
