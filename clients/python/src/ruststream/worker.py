"""The worker: takes leases from the gateway, runs a handler on each with bounded
concurrency, keeps the leases alive, settles each by how its handler ended, keeps ordering
per key, and drains cleanly on stop()/SIGTERM."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
import math
import random
import signal
import sys
import threading
import time
from collections import deque
from functools import partial
from typing import Any, Awaitable, Callable, Coroutine, Generator, Union

from . import _tracing
from ._gateway import Gateway
from ._pool import DaemonPool
from ._settler import Settler
from ._transports import TRANSPORTS, Transport
from .errors import AuthError, GatewayError, Nak, Term
from .message import BUFFERED, DONE, RUNNING, SETTLING, Message, parse_rfc3339
from .stats import WorkerStats

Handler = Callable[[Message], Union[Awaitable[Any], Any]]


def _drive(coro: Coroutine[Any, Any, Any], waited: Any) -> Generator[Any, Any, Any]:
    """Steps ``coro`` as a task does, from the point where its first step (run by the worker
    outside any task) stopped waiting on ``waited``."""
    while True:
        try:
            value = yield waited
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as error:  # a cancellation, thrown in as a task would
            try:
                waited = coro.throw(error)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                waited = coro.send(value)
            except StopIteration as stop:
                return stop.value


class _Resume:
    __slots__ = ("coro", "waited")

    def __init__(self, coro: Coroutine[Any, Any, Any], waited: Any) -> None:
        self.coro, self.waited = coro, waited

    def __await__(self) -> Generator[Any, Any, Any]:
        return _drive(self.coro, self.waited)


async def _resumed(coro: Coroutine[Any, Any, Any], waited: Any) -> Any:
    return await _Resume(coro, waited)


class Worker:
    """Consumes a gateway's consumer with a handler. See the package README for the
    guarantees; durations are in seconds."""

    def __init__(self, url: str, *, stream: str | None = None, consumer: str | None = None,
                 token: str | None = None, transport: str = "ws", max_in_flight: int = 100,
                 concurrency: int = 16, max_bytes: int | None = None,
                 max_lease: float = 3600.0, drain_timeout: float = 30.0,
                 backoff_initial: float = 1.0, backoff_max: float = 60.0,
                 logger: logging.Logger | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, not {transport!r}")
        if not 1 <= max_in_flight <= 1000:
            raise ValueError("max_in_flight must be 1..1000 (the gateway's credit range)")
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if max_bytes is not None and max_bytes < 1:
            raise ValueError("max_bytes must be >= 1 or None")
        if (stream is None) != (consumer is None):
            raise ValueError("give both stream and consumer, or neither (the default consumer)")
        self.url, self.stream, self.consumer, self.token = url, stream, consumer, token
        self.transport_name = transport
        self.max_in_flight, self.concurrency, self.max_bytes = max_in_flight, concurrency, max_bytes
        self.max_lease, self.drain_timeout = max_lease, drain_timeout
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.log = logger or logging.getLogger("ruststream")
        self.stats = WorkerStats()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread: int | None = None
        self.stopping = False
        self.abandoned = False
        self.buffered_bytes = 0
        self.bytes_full = False

    # --- running ---------------------------------------------------------------------------
    def run_forever(self, handler: Handler) -> None:
        """Run until SIGTERM/SIGINT (or stop()), drain, and return."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            installed = []
            for sig in (signal.SIGTERM, signal.SIGINT):
                try:
                    loop.add_signal_handler(sig, self.stop)
                    installed.append(sig)
                except (NotImplementedError, RuntimeError):  # not the main thread, Windows
                    pass
            try:
                await self.run(handler)
            finally:
                for sig in installed:
                    loop.remove_signal_handler(sig)

        asyncio.run(main())

    async def run(self, handler: Handler) -> None:
        """Consume until stopped, then drain; raises AuthError on 401/403."""
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self._handler = handler
        call = getattr(handler, "__call__", None)
        self._sync = not (inspect.iscoroutinefunction(handler)
                          or inspect.iscoroutinefunction(call))
        self._pool = DaemonPool(self.concurrency) if self._sync else None
        self._stop_event = asyncio.Event()
        self._room = asyncio.Event()
        self._bytes_room = asyncio.Event()
        self._idle = asyncio.Event()
        self._error: BaseException | None = None
        self.held: dict[str, Message] = {}
        self.buffer: deque[Message] = deque()
        self.running = 0
        self.busy_keys: set[str] = set()
        self.tasks: dict[int, asyncio.Future[Any]] = {}
        self._flush_soon = False
        self._dispatching = False
        self.gateway = Gateway(self.url, self.token, self.stream, self.consumer)
        self.settler = Settler(self)
        try:
            if await self._read_consumer():
                self.transport: Transport = TRANSPORTS[self.transport_name](self)
                receiving = self.loop.create_task(self.transport.run())
                receiving.add_done_callback(self._transport_ended)
                ticking = self.loop.create_task(self._extend_leases())
                await self._stop_event.wait()
                await self._drain(receiving)
                ticking.cancel()
        finally:
            await self.gateway.close()
            if self._pool is not None:
                self._pool.shutdown()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """Start the drain (from any thread); run() returns once it is done."""
        loop = self.loop
        if loop is None:
            return
        if threading.get_ident() != self.loop_thread:
            loop.call_soon_threadsafe(self.stop)
            return
        self._stop_event.set()

    def fail(self, error: BaseException) -> None:
        if self._error is None:
            self.log.error("ruststream: stopping the worker: %s", error)
            self._error = error
        self.stop()

    def _transport_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(task.exception())  # type: ignore[arg-type]

    async def _read_consumer(self) -> bool:
        """The consumer's ack_wait and ordering key; waits for a gateway not up yet."""
        self.ack_wait: float | None = None
        self.ordering: tuple[str, str] | None = None
        delay = 0.1
        while not self._stop_event.is_set():
            try:
                info = await self.gateway.consumer_info()
                break
            except AuthError as error:
                if error.status == 401:
                    self._error = error
                    return False
                # 403: reading a consumer takes the `admin` scope, which a worker's token
                # (fetch, settle) has no need of. Leases then come with their own expiry, and
                # the gateway still leases a key's messages one at a time.
                self.log.info("ruststream: the token may not read the consumer (%s); going on "
                              "with each lease's own expiry and no ordering key of its own",
                              error.detail)
                info = {}
                break
            except (GatewayError, OSError, Exception) as error:  # noqa: B014 (httpx errors)
                self.log.warning("ruststream: cannot read the consumer at %s (%s); retrying",
                                 self.url, error)
                try:
                    await asyncio.wait_for(self._stop_event.wait(), delay * random.uniform(0.5, 1))
                except asyncio.TimeoutError:
                    pass
                delay = min(delay * 2, 10.0)
        else:
            return False
        config = info.get("config") or {}
        ack_wait = config.get("ack_wait_ms") or config.get("ack_wait")
        if isinstance(ack_wait, (int, float)) and ack_wait > 0:
            self.ack_wait = ack_wait / 1000 if "ack_wait_ms" in config else float(ack_wait)
        spec = info.get("ordering_key")
        if isinstance(spec, str) and spec:
            kind, _, arg = spec.partition(":")
            self.ordering = (kind, arg or "Ruststream-Ordering-Key")
        self._tick = min(1.0, max(0.05, (self.ack_wait or 4.0) / 8))
        return True

    # --- leases coming in ------------------------------------------------------------------
    def _lease_seconds(self, expires_at: Any, now_wall: float) -> float:
        remaining = parse_rfc3339(expires_at) - now_wall if isinstance(expires_at, str) else 0.0
        if self.ack_wait is not None and not 0 < remaining <= self.ack_wait + 1:
            # A clock apart from the gateway's: trust the consumer's ack_wait instead.
            remaining = self.ack_wait * 0.9
        return max(remaining, 0.0)

    def accept(self, raw: dict[str, Any]) -> None:
        now = time.monotonic()
        msg = Message(raw, self, now, self._lease_seconds(raw.get("lease_expires_at"), time.time()))
        self.stats.received += 1
        self.held[msg.id] = msg
        if self.ordering is not None:
            msg.key = self._key_of(raw)
        if self.stopping:
            msg.state = SETTLING
            self.settler.add("nak", msg, 0, None)
            return
        if (not self.buffer and self.running < self.concurrency and not self._dispatching
                and now < msg.deadline and (msg.key is None or msg.key not in self.busy_keys)):
            self._start(msg)  # nothing waits before it and a slot is free: no buffer
            return
        self.buffer.append(msg)
        self.buffered_bytes += msg.size
        if self.max_bytes is not None and self.buffered_bytes >= self.max_bytes:
            self.bytes_full = True
            self._bytes_room.clear()
        if self.running < self.concurrency:
            self._dispatch()

    def _key_of(self, raw: dict[str, Any]) -> str | None:
        assert self.ordering is not None
        kind, arg = self.ordering
        if kind == "subject":
            tokens = str(raw.get("subject", "")).split(".")
            n = int(arg) if arg.isdigit() else 0
            return tokens[n - 1] if 0 < n <= len(tokens) else None
        wanted = arg.lower()
        for name, values in (raw.get("headers") or {}).items():
            if name.lower() == wanted and values:
                return str(values[0])
        return None

    async def wait_credit(self, reserved: Callable[[], int] = lambda: 0) -> int | None:
        """Leases a new connection or poll may take (``max_in_flight`` less those held and
        those ``reserved`` for polls under way); None once the worker drains."""
        while not self.stopping:
            credit = self.max_in_flight - len(self.held) - reserved()
            if credit > 0:
                return credit
            self._room.clear()
            waiter = asyncio.ensure_future(self._room.wait())
            stopper = asyncio.ensure_future(self._stop_event.wait())
            await asyncio.wait({waiter, stopper}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            stopper.cancel()
        return None

    def credit_freed(self) -> None:
        self._room.set()
        if self.max_bytes is not None:
            self._bytes_room.set()

    async def room_for_bytes(self) -> None:
        while self.bytes_full and not self.stopping:
            stopper = asyncio.ensure_future(self._stop_event.wait())
            room = asyncio.ensure_future(self._bytes_room.wait())
            await asyncio.wait({stopper, room}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            room.cancel()

    async def bytes_freed(self) -> None:
        """Until a buffered message started or a poll ended (``max_bytes`` only), or the
        worker drains."""
        self._bytes_room.clear()
        stopper = asyncio.ensure_future(self._stop_event.wait())
        room = asyncio.ensure_future(self._bytes_room.wait())
        await asyncio.wait({stopper, room}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        room.cancel()

    def on_gateway_shutdown(self, reason: str) -> None:
        """The gateway ends the stream: give the buffer back at once for others to take."""
        self.log.info("ruststream: the gateway ends the stream (%s); reconnecting", reason)
        self._nak_buffered()

    # --- running handlers ------------------------------------------------------------------
    def _dispatch(self) -> None:
        if self.stopping or self._dispatching:
            return  # the loop below, further up the stack, starts what is startable
        self._dispatching = True
        try:
            buffer = self.buffer
            while self.running < self.concurrency and buffer:
                if self.ordering is not None:
                    msg = self._next_in_key_order()
                    if msg is None:
                        break
                else:
                    msg = buffer.popleft()
                if msg.state != BUFFERED:
                    continue  # dropped (lease gone) while waiting
                self.buffered_bytes -= msg.size
                if time.monotonic() >= msg.deadline:
                    self._expired(msg)
                    continue
                self._start(msg)
        finally:
            self._dispatching = False
        if self.max_bytes is not None and self.buffered_bytes < self.max_bytes:
            self.bytes_full = False
            self._bytes_room.set()

    def _next_in_key_order(self) -> Message | None:
        """The first buffered message whose key is free and has no earlier message waiting."""
        blocked = set(self.busy_keys)
        for index, msg in enumerate(self.buffer):
            key = msg.key
            if key is None or key not in blocked:
                del self.buffer[index]
                return msg
            blocked.add(key)
        return None

    def _start(self, msg: Message) -> None:
        msg.state = RUNNING
        msg.started = True
        self.running += 1
        if msg.key is not None:
            self.busy_keys.add(msg.key)
        loop = self.loop
        assert loop is not None
        if self._sync:
            future = loop.run_in_executor(self._pool, _tracing.wrap_sync(self._handler, msg), msg)
            self.tasks[id(msg)] = future
            future.add_done_callback(partial(self._future_done, msg))
            return
        if sys.version_info >= (3, 11):
            # The handler's first step runs here and now, as a task started eagerly would
            # (3.12's eager_start): a handler that ends without waiting costs no task and no
            # loop turn. One that waits goes on in a task, from where it stopped, in its own
            # context (a task's context must be given at its creation: 3.11).
            context = contextvars.copy_context()
            try:
                coro = _tracing.wrap_async(self._handler, msg)
                waited = context.run(coro.send, None)
            except StopIteration:
                self._finished(msg, None)
                return
            except (Exception, asyncio.CancelledError) as error:
                self._finished(msg, error)
                return
            task = loop.create_task(_resumed(coro, waited), context=context)
        else:
            task = loop.create_task(_tracing.wrap_async(self._handler, msg))
        self.tasks[id(msg)] = task
        task.add_done_callback(partial(self._future_done, msg))

    def _future_done(self, msg: Message, future: asyncio.Future[Any]) -> None:
        self.tasks.pop(id(msg), None)
        if future.cancelled():
            self._finished(msg, None, cancelled=True)
        else:
            self._finished(msg, future.exception())

    def _finished(self, msg: Message, error: BaseException | None,
                  cancelled: bool = False) -> None:
        self.running -= 1
        if not msg.user_settled:
            msg.state = SETTLING
            if cancelled:
                pass  # nak'd by the drain already
            elif error is None:
                self.settler.add("ack", msg, None, None)
            elif isinstance(error, Nak):
                delay = self.backoff(msg) if error.delay is None else error.delay
                self.settler.add("nak", msg, int(delay * 1000), None)
            elif isinstance(error, Term):
                self.settler.add("term", msg, None, error.reason)
            else:
                self.stats.handler_errors += 1
                delay = self.backoff(msg)
                self.log.warning("ruststream: handler failed on %s/%s seq %s (delivery %s); "
                                 "nak, redelivery in %.2fs", msg.stream, msg.consumer,
                                 msg.stream_sequence, msg.delivered, delay, exc_info=error)
                self.settler.add("nak", msg, int(delay * 1000), None)
        elif error is not None and not isinstance(error, (Nak, Term)):
            # Settled by the handler already: nothing more is sent, but the failure is not lost.
            self.stats.handler_errors += 1
            self.log.warning("ruststream: handler failed on %s/%s seq %s after settling it",
                             msg.stream, msg.consumer, msg.stream_sequence, exc_info=error)
        if self.buffer:
            self._dispatch()
        if self.running == 0:
            self._idle.set()
        if not self.buffer and not self._flush_soon:
            # Nothing waits to start: more comes only as settles free the gateway's credit, so
            # what is pending goes at the end of this loop turn (with what other handlers
            # ending in it settle), not after the coalescing window.
            self._flush_soon = True
            assert self.loop is not None
            self.loop.call_soon(self._flush_idle)

    def _flush_idle(self) -> None:
        self._flush_soon = False
        self.settler.flush()

    def backoff(self, msg: Message) -> float:
        """min(backoff_initial × 2^(delivered−1), backoff_max), jittered to [½, 1]×."""
        exponent = min(max(msg.delivered - 1, 0), 62)
        delay = min(self.backoff_initial * math.pow(2, exponent), self.backoff_max)
        return delay * random.uniform(0.5, 1.0)

    def settle_explicit(self, msg: Message, op: str, delay: float | None,
                        reason: str | None) -> asyncio.Future[None]:
        """Register an explicit settle (on the loop thread); the future ends with its answer."""
        assert self.loop is not None
        future: asyncio.Future[None] = self.loop.create_future()
        if op == "in_progress":
            if msg.state in (BUFFERED, RUNNING):
                self.settler.add(op, msg, None, None, future)
                self.settler.flush()
            else:
                future.set_result(None)
            return future
        if msg.user_settled or msg.state in (SETTLING, DONE):
            self.log.debug("ruststream: %s of an already settled message ignored", op)
            future.set_result(None)
            return future
        msg.user_settled = True
        msg.state = SETTLING
        delay_ms = None
        if op == "nak":
            delay_ms = int((self.backoff(msg) if delay is None else delay) * 1000)
        self.settler.add(op, msg, delay_ms, reason, future)
        return future

    # --- settles coming back ---------------------------------------------------------------
    def on_settled(self, op: str, msg: Message, status: int, result: dict[str, Any]) -> None:
        if status in (401, 403):
            self.fail(AuthError(status, f"{op} refused: the token lacks the `settle` scope"
                                if status == 403 else f"{op} refused: unauthenticated"))
        if op == "in_progress":
            if status == 200:
                self.stats.extended += 1
                now = time.monotonic()
                lease = self._lease_seconds(result.get("lease_expires_at"), time.time())
                msg.deadline = now + lease
                msg.extend_at = now + lease / 2
                return
            self.stats.failure(status)
            if status in (404, 410) and msg.state == BUFFERED:
                self._expired(msg)
            elif status not in (409,):
                self.log.warning("ruststream: extending seq %s answered %s",
                                 msg.stream_sequence, status)
            return
        if status in (200, 204):
            # One line per confirmed settle (an audit trail: which delivery ended how).
            self.log.debug("ruststream: %s of %s/%s seq %s (delivery %s) answered %s", op,
                           msg.stream, msg.consumer, msg.stream_sequence, msg.delivered, status)
            if op == "ack":
                self.stats.acked += 1
            elif op == "nak":
                self.stats.naked += 1
            else:
                self.stats.termed += 1
        else:
            self.stats.failure(status)
            self.log.warning("ruststream: %s of seq %s answered %s (%s)", op,
                             msg.stream_sequence, status, result.get("detail") or "")
        self._release(msg)

    def _release(self, msg: Message) -> None:
        msg.state = DONE
        if self.held.pop(msg.id, None) is not None:
            self._room.set()
        if msg.key is not None and msg.started:
            self.busy_keys.discard(msg.key)
        if not self.held:
            self._idle.set()
        if self.buffer:
            self._dispatch()

    def _expired(self, msg: Message) -> None:
        """A buffered message whose lease ended: never handed to the handler."""
        self.stats.expired_in_buffer += 1
        self.log.info("ruststream: seq %s expired in the buffer; dropped (it is redelivered)",
                      msg.stream_sequence)
        msg.state = DONE
        if self.held.pop(msg.id, None) is not None:
            self._room.set()

    def _nak_buffered(self) -> None:
        while self.buffer:
            msg = self.buffer.popleft()
            if msg.state == BUFFERED:
                self.buffered_bytes -= msg.size
                msg.state = SETTLING
                self.settler.add("nak", msg, 0, None)
        self.settler.flush()

    # --- keeping leases alive --------------------------------------------------------------
    async def _extend_leases(self) -> None:
        while True:
            await asyncio.sleep(self._tick)
            now = time.monotonic()
            sent = False
            for msg in list(self.held.values()):
                if now < msg.extend_at or msg.state not in (BUFFERED, RUNNING) \
                        or msg.user_settled:
                    continue
                if msg.state == BUFFERED and now >= msg.deadline:
                    self.buffer.remove(msg)
                    self.buffered_bytes -= msg.size
                    self._expired(msg)
                elif now - msg.received_at >= self.max_lease:
                    msg.extend_at = math.inf
                    self.stats.lease_given_up += 1
                    self.log.warning("ruststream: seq %s held for max_lease (%ss): no longer "
                                     "extended; it is redelivered when its lease ends",
                                     msg.stream_sequence, self.max_lease)
                else:
                    msg.extend_at = now + max(self._tick, (msg.deadline - now) / 2)
                    self.settler.add("in_progress", msg, None, None)
                    sent = True
            if sent:
                self.settler.flush()

    # --- draining --------------------------------------------------------------------------
    async def _drain(self, receiving: asyncio.Task[None]) -> None:
        started = time.monotonic()
        # Keep a little of drain_timeout for the last settles, so run() returns within it.
        handlers_until = started + max(self.drain_timeout - min(2.0, self.drain_timeout / 4), 0)
        self.stopping = True
        self.transport.withdraw()
        self._nak_buffered()
        try:
            await asyncio.wait_for(asyncio.shield(receiving), max(handlers_until - started, 0.1))
        except (asyncio.TimeoutError, Exception):  # noqa: B014 — its failure is reported
            pass
        self._nak_buffered()
        while self.running and time.monotonic() < handlers_until:
            self._idle.clear()
            try:
                await asyncio.wait_for(self._idle.wait(), handlers_until - time.monotonic())
            except asyncio.TimeoutError:
                break
        for msg in list(self.held.values()):
            if msg.state == RUNNING and not msg.user_settled:
                msg.user_settled = True
                msg.state = SETTLING
                self.log.warning("ruststream: seq %s still running at drain_timeout; nak",
                                 msg.stream_sequence)
                self.settler.add("nak", msg, 0, None)
                task = self.tasks.get(id(msg))
                if task is not None:
                    task.cancel()
        remaining = self.drain_timeout - (time.monotonic() - started)
        await self.settler.wait_idle(max(remaining, 1.0))
        self.abandoned = True
        if not receiving.done():
            receiving.cancel()
