"""Small helpers of the tests: publishing many messages (straight to nats-server, or through
the gateway's POST /publish), waiting for a condition with a deadline, running a worker in
the background."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Awaitable, Callable, Sequence

from servers import Gateway
from ruststream import Client, Worker


async def publish(gateway: Gateway, subjects: list[str],
                  payload: bytes | Sequence[bytes] = b"x" * 32) -> None:
    """Publish one message per subject, in order, to the gateway's nats-server, and return
    once JetStream acked each (stored). Over one NATS connection, pipelined: a thousand take
    milliseconds, not the seconds one POST /publish each takes through a debug gateway.
    ``payload``: one for all, or one per subject."""
    payloads = [payload] * len(subjects) if isinstance(payload, bytes) else list(payload)
    assert len(payloads) == len(subjects)
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.nats_port)
    try:
        await asyncio.wait_for(reader.readline(), 10)  # INFO
        inbox = "_INBOX.tests"
        frames = [b'CONNECT {"verbose":false,"pedantic":false}\r\n',
                  f"SUB {inbox}.* 1\r\n".encode()]
        for n, (subject, body) in enumerate(zip(subjects, payloads)):
            frames.append(f"PUB {subject} {inbox}.{n} {len(body)}\r\n".encode()
                          + body + b"\r\n")
        writer.write(b"".join(frames))
        await writer.drain()
        acked = 0
        while acked < len(subjects):
            line = await asyncio.wait_for(reader.readline(), 30)
            if line.startswith(b"MSG "):
                body = json.loads((await reader.readexactly(int(line.split()[-1]) + 2))[:-2])
                if "error" in body:
                    raise AssertionError(f"JetStream refused a publish: {body}")
                acked += 1
            elif line.startswith(b"PING"):
                writer.write(b"PONG\r\n")
            elif line.startswith(b"-ERR") or not line:
                raise AssertionError(f"nats-server: {line!r}")
    finally:
        writer.close()


async def publish_through_gateway(url: str, subjects: list[str],
                                  payload: bytes = b"x" * 32) -> None:
    """One ``Client.publish`` (POST /publish) per subject."""
    async with Client(url) as client:
        for subject in subjects:
            await client.publish(subject, payload)


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
