"""What the gateway tells the worker, against a real gateway: its own `shutdown` (SIGTERM to
the gateway) drains that stream and the worker reconnects; 401 and 403 stop the worker with
a clear error, while a worker's usual token (fetch and settle, no admin) just works."""

from __future__ import annotations

import asyncio
import signal

import pytest

from conftest import GatewayFactory
from helpers import Running, eventually
from servers import Gateway
from ruststream import AuthError, Client, Message, Worker


@pytest.mark.parametrize("transport", ["ws", "sse"])
async def test_gateway_shutdown_drains_the_stream_and_reconnects(
        gateway_factory: GatewayFactory, transport: str) -> None:
    gateway = gateway_factory(ack_wait="30s")  # a nak'd message is back at once, or not soon
    total = 10
    gate = asyncio.Event()
    handled: list[tuple[int, int]] = []

    async def handle(msg: Message) -> None:
        if msg.stream_sequence == 1:
            await gate.wait()
        handled.append((msg.stream_sequence, msg.delivered))

    async with Client(gateway.url) as client:
        for _ in range(total):
            await client.publish(f"{gateway.stream.lower()}.s", b"s")
    worker = Worker(gateway.url, transport=transport, concurrency=1, max_in_flight=total)
    async with Running(worker, handle):
        await eventually(lambda: worker.stats.received == total, 10,
                         "one message running, the rest buffered")
        process = gateway.process
        assert process is not None
        process.send_signal(signal.SIGTERM)
        # The stream's drain: its buffered messages given back at once.
        await eventually(lambda: worker.stats.naked == total - 1, 5, "the buffer nak'd")
        gate.set()
        await eventually(lambda: worker.stats.acked == 1, 5, "the running one acked")
        await eventually(lambda: process.poll() is not None, 15, "the gateway exited")
        gateway.start()
        await eventually(lambda: worker.stats.acked == total, 15, "the rest handled after")
        await eventually(lambda: gateway.consumer()["num_ack_pending"] == 0, 5,
                         "nothing pending")
    assert sorted(handled) == [(1, 1)] + [(seq, 2) for seq in range(2, total + 1)]
    assert worker.stats.reconnects >= 1
    assert worker.stats.settle_failures == {}


def authorized(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory("--auth-tokens", "work fetch,settle;fetcher fetch;settler settle;"
                           "pub publish;ops admin")


async def test_refused_tokens_stop_the_worker_with_a_clear_error(
        gateway_factory: GatewayFactory, transport: str) -> None:
    gateway = authorized(gateway_factory)

    async def ack(msg: Message) -> None:
        return None

    async def publish_one() -> None:
        async with Client(gateway.url, "pub") as client:
            await client.publish(f"{gateway.stream.lower()}.a", b"a")

    # A worker's own token needs no admin scope (its consumer's settings are then unknown).
    await publish_one()
    worker = Worker(gateway.url, token="work", transport=transport)
    async with Running(worker, ack):
        await eventually(lambda: worker.stats.acked == 1, 10, "acked with a worker's token")
    assert worker.stats.settle_failures == {}

    await publish_one()  # for the token that may fetch it but not settle it
    cases = [("unknown", 401, "401"), ("settler", 403, "403"), ("fetcher", 403, "`settle`")]
    for token, status, words in cases:
        worker = Worker(gateway.url, token=token, transport=transport)
        with pytest.raises(AuthError, match=words) as raised:
            await asyncio.wait_for(worker.run(ack), 20)
        assert raised.value.status == status, token
