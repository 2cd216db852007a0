"""Fixtures: one nats-server for the session, a gateway per test on a stream of its own."""

from __future__ import annotations

import itertools
from typing import Callable, Iterator

import pytest

from servers import Gateway, NatsServer

_streams = itertools.count(1)


@pytest.fixture(scope="session")
def nats() -> Iterator[NatsServer]:
    server = NatsServer()
    try:
        yield server
    finally:
        server.stop()


GatewayFactory = Callable[..., Gateway]


@pytest.fixture
def gateway_factory(nats: NatsServer) -> Iterator[GatewayFactory]:
    started: list[Gateway] = []

    def start(*args: str, ack_wait: str = "2s", stream: str | None = None) -> Gateway:
        gateway = Gateway(nats, stream or f"T{next(_streams)}", *args, ack_wait=ack_wait)
        started.append(gateway)
        return gateway

    try:
        yield start
    finally:
        for gateway in started:
            gateway.stop()


@pytest.fixture
def gateway(gateway_factory: GatewayFactory) -> Gateway:
    return gateway_factory()


@pytest.fixture(params=["ws", "sse", "fetch"])
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    return name
