"""Small helpers of the tests: publishing many messages, waiting for a condition with a
deadline, running a worker in the background."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

from ruststream import Client, Worker


async def publish(url: str, subjects: list[str], payload: bytes = b"x" * 32,
                  parallel: int = 32) -> None:
    async with Client(url) as client:
        for start in range(0, len(subjects), parallel):
            await asyncio.gather(*(client.publish(subject, payload)
                                   for subject in subjects[start:start + parallel]))


async def eventually(condition: Callable[[], bool | Awaitable[bool]], timeout: float,
                     what: str, interval: float = 0.02) -> None:
    """Wait until ``condition()`` holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(interval)


class Running:
    """A worker run as a background task; ``stop()`` drains it and re-raises its failure."""

    def __init__(self, worker: Worker, handler: Callable[..., Any]) -> None:
        self.worker = worker
        self.task = asyncio.get_running_loop().create_task(worker.run(handler))

    async def stop(self) -> None:
        self.worker.stop()
        await asyncio.wait_for(self.task, 60)

    async def __aenter__(self) -> Running:
        return self

    async def __aexit__(self, *_: object) -> None:
        if not self.task.done():
            await self.stop()
        else:
            await self.task
