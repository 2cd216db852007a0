"""HTTP calls to the gateway that every transport shares: consumer info, batch settles,
lease extensions, and the routes of a consumer (the default one or a named one)."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

from .errors import AuthError, GatewayError

# A batch settle takes at most this many ids (the gateway's limit).
MAX_IDS = 1000


class Gateway:
    """One gateway base URL, its token, and the consumer the worker reads."""

    def __init__(self, url: str, token: str | None, stream: str | None,
                 consumer: str | None, timeout: float = 30.0) -> None:
        if (stream is None) != (consumer is None):
            raise ValueError("give both stream and consumer, or neither (the default consumer)")
        self.url = url.rstrip("/")
        self.token = token
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.prefix = (f"/streams/{quote(stream, safe='')}/consumers/{quote(consumer, safe='')}"
                       if stream is not None and consumer is not None else "")
        self.http = httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout,
                                      limits=httpx.Limits(max_connections=32))

    async def close(self) -> None:
        await self.http.aclose()

    def ws_url(self, query: str) -> str:
        base = "ws" + self.url[4:] if self.url.startswith("http") else self.url
        return f"{base}{self.prefix}/ws?{query}"

    def route(self, name: str) -> str:
        """`fetch`, `events`, `ws` of the consumer."""
        return f"{self.prefix}/{name}"

    async def consumer_info(self) -> dict[str, Any]:
        path = self.prefix or "/consumer"
        response = await self.http.get(path)
        raise_for_auth(response)
        if response.status_code != 200:
            raise GatewayError(response.status_code, detail_of(response))
        info: dict[str, Any] = response.json()
        return info

    async def settle_batch(self, op: str, ids: list[str], delay_ms: int | None,
                           reason: str | None) -> list[dict[str, Any]]:
        """``POST /messages/{op}`` for ≤ 1000 ids; each id's result in request order. A failed
        request (no answer, 5xx) gives every id that status (0: no answer)."""
        body: dict[str, Any] = {"ids": ids}
        if delay_ms is not None:
            body["delay_ms"] = delay_ms
        if reason is not None:
            body["reason"] = reason
        try:
            response = await self.http.post(f"/messages/{op}", json=body)
        except httpx.HTTPError:
            return [{"id": i, "status": 0} for i in ids]
        raise_for_auth(response)
        if response.status_code != 200:
            return [{"id": i, "status": response.status_code} for i in ids]
        results: list[dict[str, Any]] = response.json()["results"]
        return results

    async def extend(self, lease_id: str) -> dict[str, Any]:
        """``POST /messages/{id}/in-progress``: ``{"id", "status", "lease_expires_at"?}``."""
        try:
            response = await self.http.post(f"/messages/{quote(lease_id, safe='')}/in-progress")
        except httpx.HTTPError:
            return {"id": lease_id, "status": 0}
        raise_for_auth(response)
        result: dict[str, Any] = {"id": lease_id, "status": response.status_code}
        if response.status_code == 200:
            result["lease_expires_at"] = response.json().get("lease_expires_at")
        return result


def detail_of(response: httpx.Response) -> str:
    try:
        body = response.json()
        return str(body.get("detail") or body.get("title") or response.text)
    except ValueError:
        return response.text[:200]


def raise_for_auth(response: httpx.Response) -> None:
    if response.status_code in (401, 403):
        raise AuthError(response.status_code, detail_of(response))
