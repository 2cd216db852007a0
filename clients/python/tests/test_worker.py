"""The worker against a real gateway and nats-server, for each transport: lease extension,
bounds, backoff, term, ordering per key, a gateway killed under it."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from conftest import GatewayFactory
from helpers import Running, eventually, publish
from servers import Gateway
from ruststream import Message, Term, Worker


async def settled_at_gateway(gateway: Gateway) -> bool:
    info = gateway.consumer()
    return bool(info["num_pending"] == 0 and info["num_ack_pending"] == 0
                and info["leases_in_flight"] == 0)


async def test_handler_slower_than_the_lease_is_extended(gateway: Gateway,
                                                         transport: str) -> None:
    calls: list[int] = []

    async def slow(msg: Message) -> None:
        calls.append(msg.delivered)
        await asyncio.sleep(6.0)  # 3 × ack_wait (2 s)

    await publish(gateway, [f"{gateway.stream.lower()}.slow"])
    worker = Worker(gateway.url, transport=transport, concurrency=2, max_in_flight=10)
    async with Running(worker, slow):
        await eventually(lambda: worker.stats.acked == 1, 15, "the slow message acked")
        await eventually(lambda: settled_at_gateway(gateway), 5, "nothing pending")
    assert calls == [1]
    assert worker.stats.acked == 1 and worker.stats.received == 1
    assert worker.stats.extended >= 2
    assert gateway.consumer()["num_redelivered"] == 0


async def test_bounded_concurrency_and_leases(gateway: Gateway, transport: str) -> None:
    total, concurrency, max_in_flight = 1000, 8, 40
    running = 0
    most_running = 0
    seen: set[int] = set()

    async def handle(msg: Message) -> None:
        nonlocal running, most_running
        running += 1
        most_running = max(most_running, running)
        await asyncio.sleep(random.uniform(0, 0.004))
        seen.add(msg.stream_sequence)
        running -= 1

    most_leases = 0
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        async def watch() -> None:
            nonlocal most_leases
            while True:
                info = (await http.get("/consumer")).json()
                most_leases = max(most_leases, info["leases_in_flight"])
                await asyncio.sleep(0.01)

        watcher = asyncio.get_running_loop().create_task(watch())
        await publish(gateway, [f"{gateway.stream.lower()}.n"] * total)
        worker = Worker(gateway.url, transport=transport, concurrency=concurrency,
                        max_in_flight=max_in_flight)
        async with Running(worker, handle):
            await eventually(lambda: len(seen) == total, 60, "every message handled")
            await eventually(lambda: worker.stats.acked == total, 10, "every message acked")
        watcher.cancel()
    assert most_running == concurrency  # reached, never exceeded
    assert 0 < most_leases <= max_in_flight
    assert worker.stats.settle_failures == {}


async def test_exceptions_nak_with_growing_backoff(gateway: Gateway, transport: str) -> None:
    starts: list[float] = []
    ends: list[float] = []

    async def flaky(msg: Message) -> None:
        starts.append(time.monotonic())
        assert msg.delivered == len(starts)
        if msg.delivered <= 3:
            ends.append(time.monotonic())
            raise RuntimeError(f"attempt {msg.delivered} fails")

    await publish(gateway, [f"{gateway.stream.lower()}.flaky"])
    worker = Worker(gateway.url, transport=transport, backoff_initial=0.2, backoff_max=10)
    async with Running(worker, flaky):
        await eventually(lambda: worker.stats.acked == 1, 20, "acked at the 4th delivery")
    assert len(starts) == 4 and worker.stats.naked == 3 and worker.stats.handler_errors == 3
    gaps = [starts[k + 1] - ends[k] for k in range(3)]
    # delay = 0.2 × 2^(delivered−1), jittered to [½, 1]×: at least 0.1, 0.2, 0.4 s.
    for k, gap in enumerate(gaps):
        assert gap >= 0.1 * 2 ** k, gaps


async def test_term_dead_letters_with_its_reason(gateway_factory: GatewayFactory,
                                                 transport: str) -> None:
    dead = gateway_factory(stream=f"DLQ{random.randrange(10**6)}")  # creates the DLQ stream
    gateway = gateway_factory("--dead-letter-subject", f"{dead.stream.lower()}.letters")

    async def poison(msg: Message) -> None:
        raise Term(f"bad payload {msg.stream_sequence}")

    await publish(gateway, [f"{gateway.stream.lower()}.poison"])
    worker = Worker(gateway.url, transport=transport)
    letters: list[dict[str, Any]] = []

    async def dead_lettered() -> bool:
        async with httpx.AsyncClient(base_url=gateway.url) as http:
            answer = (await http.get("/dead-letters", params={"reason": "terminated"})).json()
        letters[:] = answer.get("dead_letters") or answer.get("items") or []
        return bool(letters)

    async with Running(worker, poison):
        await eventually(lambda: worker.stats.termed == 1, 10, "termed")
        await eventually(dead_lettered, 15, "the message dead-lettered")
    assert "bad payload 1" in str(letters[0])
    assert worker.stats.naked == 0 and worker.stats.acked == 0


async def test_ordering_per_key(gateway_factory: GatewayFactory, transport: str) -> None:
    gateway = gateway_factory("--ordering-key", "subject:2")
    keys = [f"k{n}" for n in range(12)]
    subjects = [f"{gateway.stream.lower()}.{random.choice(keys)}.x" for _ in range(240)]
    active: set[str] = set()
    order: dict[str, list[int]] = {}
    overlaps: list[str] = []

    started: list[tuple[str, int, int]] = []  # (key, stream sequence, delivered)

    async def handle(msg: Message) -> None:
        key = msg.subject.split(".")[1]
        started.append((key, msg.stream_sequence, msg.delivered))
        if key in active:
            overlaps.append(key)
        active.add(key)
        await asyncio.sleep(random.uniform(0, 0.01))
        order.setdefault(key, []).append(msg.stream_sequence)
        active.discard(key)

    await publish(gateway, subjects)
    worker = Worker(gateway.url, transport=transport, concurrency=16)
    async with Running(worker, handle):
        await eventually(lambda: worker.stats.acked == len(subjects), 60, "every message acked")
    assert overlaps == []
    for key, sequences in order.items():
        # What a failure needs to say where the order was lost: at the gateway (a delivery
        # out of order, or a redelivery), or in the worker.
        assert sequences == sorted(sequences), (
            f"{key} handled out of stream order: {sequences}; its handlers started as "
            f"(sequence, delivered): {[(s, d) for k, s, d in started if k == key]}; "
            f"worker stats: {worker.stats}; gateway log: {gateway.tail()}")
    assert sum(len(s) for s in order.values()) == len(subjects)


async def test_gateway_killed_and_restarted_under_the_worker(gateway: Gateway,
                                                             transport: str) -> None:
    handled: set[int] = set()

    async def handle(msg: Message) -> None:
        await asyncio.sleep(0.005)
        handled.add(msg.stream_sequence)

    subject = f"{gateway.stream.lower()}.k"
    await publish(gateway, [subject] * 300)
    worker = Worker(gateway.url, transport=transport, concurrency=4, max_in_flight=50)
    async with Running(worker, handle):
        await eventually(lambda: len(handled) >= 50, 20, "50 handled before the kill")
        gateway.kill()
        await asyncio.sleep(0.3)  # a worker facing no gateway for a moment
        gateway.start()
        await publish(gateway, [subject] * 100)
        await eventually(lambda: len(handled) == 400, 60,
                         "every message handled after the restart")
        await eventually(lambda: settled_at_gateway(gateway), 15, "nothing pending")
    assert handled == set(range(1, 401))  # lost 0
    # A stream's connection is broken by the kill, so it reconnects. Polls have no connection
    # to lose: when none was under way at the kill (the worker full, waiting for room), the
    # next one simply reaches the restarted gateway.
    if transport != "fetch":
        assert worker.stats.reconnects >= 1
