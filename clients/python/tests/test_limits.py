"""The worker's own limits and a handler's own settles, against a real gateway: max_lease ends
the extensions of a handler that runs too long (logged once), max_bytes bounds the payload
waiting in its buffer, and explicit settles settle exactly once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from conftest import GatewayFactory
from helpers import Running, eventually, publish
from servers import Gateway
from ruststream import Message, Worker


async def test_max_lease_stops_extending_and_logs_once(gateway_factory: GatewayFactory,
                                                       transport: str,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    gateway = gateway_factory(ack_wait="1s")
    deliveries: list[int] = []
    second_delivery = asyncio.Event()

    async def outlives_max_lease(msg: Message) -> None:
        deliveries.append(msg.delivered)
        if msg.delivered == 1:
            # Still running when the lease it is no longer given ends: the message is
            # delivered again, and this first handler's ack finds its lease gone.
            await asyncio.wait_for(second_delivery.wait(), 20)
        else:
            second_delivery.set()

    caplog.set_level(logging.INFO, logger="ruststream")
    await publish(gateway, [f"{gateway.stream.lower()}.long"])
    worker = Worker(gateway.url, transport=transport, max_lease=1.2, concurrency=2,
                    max_in_flight=10)
    async with Running(worker, outlives_max_lease):
        await eventually(lambda: worker.stats.acked == 1 and sum(
            worker.stats.settle_failures.values()) == 1, 20,
            "the redelivery acked, the first handler's ack refused")
    assert deliveries == [1, 2]
    assert worker.stats.extended >= 1  # extended while under max_lease
    assert worker.stats.lease_given_up == 1
    given_up = [r for r in caplog.records if "max_lease" in r.getMessage()]
    assert len(given_up) == 1, [r.getMessage() for r in given_up]
    assert set(worker.stats.settle_failures) <= {409, 410}, worker.stats.settle_failures


class BufferWatch(Worker):
    """A worker that records the most payload its buffer ever held."""

    most_buffered = 0

    def accept(self, raw: dict[str, Any]) -> None:
        super().accept(raw)
        self.most_buffered = max(self.most_buffered, self.buffered_bytes)


async def test_max_bytes_bounds_the_buffered_payload(gateway: Gateway, transport: str) -> None:
    size, max_bytes, total = 1000, 3000, 20
    gate = asyncio.Event()
    handled: set[int] = set()

    async def handle(msg: Message) -> None:
        await gate.wait()
        handled.add(msg.stream_sequence)

    await publish(gateway, [f"{gateway.stream.lower()}.big"] * total, payload=b"b" * size)
    worker = BufferWatch(gateway.url, transport=transport, concurrency=1, max_in_flight=total,
                         max_bytes=max_bytes)
    async with Running(worker, handle):
        # One handler runs, the buffer is full; ws and sse have been sent all the rest.
        await eventually(lambda: worker.buffered_bytes >= max_bytes, 10, "the buffer full")
        if transport != "fetch":
            await eventually(lambda: gateway.consumer()["leases_in_flight"] == total, 10,
                             "every message leased to the worker")
        gate.set()
        await eventually(lambda: len(handled) == total, 20, "every message handled")
    assert max_bytes <= worker.most_buffered < max_bytes + size
    assert worker.stats.acked == total and worker.stats.expired_in_buffer == 0


async def test_explicit_settles_settle_once(gateway: Gateway, transport: str) -> None:
    """ack / nak / term / extend from the handler; its return then settles nothing more."""
    seen: list[tuple[int, int]] = []

    async def handle(msg: Message) -> None:
        seen.append((msg.stream_sequence, msg.delivered))
        if msg.stream_sequence == 1:
            await msg.extend()
            await msg.ack()
        elif msg.stream_sequence == 2 and msg.delivered == 1:
            await msg.nak(0)
            raise RuntimeError("after an explicit nak: settles nothing more")
        elif msg.stream_sequence == 2:
            await msg.ack()
        else:
            await msg.term("explicitly")

    await publish(gateway, [f"{gateway.stream.lower()}.e"] * 3)
    worker = Worker(gateway.url, transport=transport)
    async with Running(worker, handle):
        await eventually(lambda: worker.stats.acked == 2 and worker.stats.termed == 1, 10,
                         "two acked, one termed")
        await eventually(lambda: gateway.consumer()["num_ack_pending"] == 0, 5,
                         "nothing pending")
    assert sorted(seen) == [(1, 1), (2, 1), (2, 2), (3, 1)]
    assert worker.stats.naked == 1 and worker.stats.extended == 1
    assert worker.stats.handler_errors == 1 and worker.stats.settle_failures == {}
