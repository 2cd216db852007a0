"""Settles and lease extensions on their way to the gateway: those of concurrent handlers
coalesced into operations of many ids (within 5 ms, or at once when the worker is idle),
sent in band on an open WebSocket or else as HTTP batch POSTs, and retried on 503/504 or no
answer while the lease lives."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from ._gateway import MAX_IDS
from .errors import AuthError

if TYPE_CHECKING:
    from .message import Message
    from .worker import Worker

# How long settles wait to be sent together (the issue allows 5 ms; a shorter wait gives the
# gateway its credit back sooner where handlers end one by one, at a few more operations).
COALESCE_SECONDS = 0.002
# Statuses retried while the lease lives: unavailable, no confirmation in time, no answer.
RETRIED = frozenset((0, 503, 504))

Item = tuple["Message", "asyncio.Future[None] | None"]
GroupKey = tuple[str, "int | None", "str | None"]


class Settler:
    """Coalesces, sends and retries the worker's settles; counts their outcomes through the
    worker (``Worker.on_settled``)."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._groups: dict[GroupKey, list[Item]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._held = False

    def hold(self) -> None:
        """Send nothing until release(): while a stream without a closing handshake (SSE)
        is read to its end, no settle frees credit for the gateway to write more."""
        self._held = True

    def release(self) -> None:
        self._held = False
        self.flush()

    def add(self, op: str, msg: Message, delay_ms: int | None, reason: str | None,
            waiter: asyncio.Future[None] | None = None) -> None:
        key = (op, delay_ms, reason)
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = []
        group.append((msg, waiter))
        if self._held:
            return
        if len(group) >= MAX_IDS:
            self._send(key)
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(COALESCE_SECONDS, self.flush)

    def flush(self) -> None:
        """Send everything pending now."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._held:
            return
        for key in list(self._groups):
            self._send(key)

    async def wait_idle(self, timeout: float) -> None:
        """Until every settle sent has its final answer (or ``timeout`` passed)."""
        self.flush()
        deadline = time.monotonic() + timeout
        while self._tasks and time.monotonic() < deadline:
            await asyncio.wait(set(self._tasks), timeout=deadline - time.monotonic())
            self.flush()

    def _send(self, key: GroupKey) -> None:
        items = self._groups.pop(key, None)
        if not items:
            return
        task = asyncio.get_running_loop().create_task(self._deliver(key, items))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, key: GroupKey, items: list[Item]) -> None:
        op, delay_ms, reason = key
        worker = self._worker
        attempt = 0
        try:
            while items:
                ids = [msg.id for msg, _ in items]
                results = await worker.transport.settle_in_band(op, ids, delay_ms, reason)
                if results is None:
                    results = await self._over_http(op, ids, delay_ms, reason)
                by_id: dict[str, dict[str, Any]] | None = None
                retry: list[Item] = []
                now = time.monotonic()
                for index, (msg, waiter) in enumerate(items):
                    # Results come in the order of the ids; look one up only where they do not.
                    result = results[index] if index < len(results) else {}
                    if result.get("id") != msg.id:
                        if by_id is None:
                            by_id = {str(r.get("id")): r for r in results}
                        result = by_id.get(msg.id) or {"id": msg.id, "status": 0}
                    status = int(result.get("status") or 0)
                    if status in RETRIED and now < msg.deadline and not worker.abandoned:
                        retry.append((msg, waiter))
                        continue
                    worker.on_settled(op, msg, status, result)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(None)
                items = retry
                if items:
                    attempt += 1
                    await asyncio.sleep(min(0.05 * 2 ** attempt, 1.0))
        except AuthError as error:
            worker.fail(error)
        finally:
            for _, waiter in items:
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)

    async def _over_http(self, op: str, ids: list[str], delay_ms: int | None,
                         reason: str | None) -> list[dict[str, Any]]:
        gateway = self._worker.gateway
        if op == "in_progress":
            return list(await asyncio.gather(*(gateway.extend(i) for i in ids)))
        return await gateway.settle_batch(op, ids, delay_ms, reason)
