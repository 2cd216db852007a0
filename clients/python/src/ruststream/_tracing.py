"""A consumer span around each handler, continuing the message's ``traceparent``, when an
OpenTelemetry SDK is installed; otherwise the handler is called as it is, at no cost."""

from __future__ import annotations

import importlib
import importlib.util
from types import CoroutineType
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Coroutine

if TYPE_CHECKING:
    from .message import Message


def _load() -> tuple[Any, Any] | None:
    if importlib.util.find_spec("opentelemetry") is None \
            or importlib.util.find_spec("opentelemetry.sdk") is None:
        return None
    trace = importlib.import_module("opentelemetry.trace")
    propagate = importlib.import_module("opentelemetry.propagate")
    return trace, propagate


_OTEL = _load()


def _span(msg: Message) -> Any:
    assert _OTEL is not None
    trace, propagate = _OTEL
    carrier = {name.lower(): values[0] for name, values in msg.headers.items() if values}
    context = propagate.extract(carrier)
    tracer = trace.get_tracer("ruststream")
    return tracer.start_as_current_span(
        f"{msg.subject} process", context=context, kind=trace.SpanKind.CONSUMER,
        attributes={
            "messaging.system": "nats",
            "messaging.operation.type": "process",
            "messaging.destination.name": msg.subject,
            "messaging.consumer.group.name": f"{msg.stream}/{msg.consumer}",
            "messaging.message.id": f"{msg.stream}:{msg.stream_sequence}",
            "messaging.message.delivery_count": msg.delivered,
        })


def wrap_async(handler: Callable[[Message], Awaitable[Any]],
               msg: Message) -> Coroutine[Any, Any, Any]:
    """The coroutine to run for ``msg``: the handler's own when it returns one (no layer in
    between, the usual case), else one awaiting what it returned."""
    if _OTEL is None:
        awaitable = handler(msg)
        if isinstance(awaitable, CoroutineType):
            return awaitable
        return _plain(awaitable)
    return _traced(handler, msg)


async def _plain(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


async def _traced(handler: Callable[[Message], Awaitable[Any]], msg: Message) -> Any:
    with _span(msg):
        return await handler(msg)


def wrap_sync(handler: Callable[[Message], Any], msg: Message) -> Callable[[Message], Any]:
    """The function a pool thread calls with ``msg``."""
    if _OTEL is None:
        return handler

    def traced(message: Message) -> Any:
        with _span(message):
            return handler(message)

    return traced
