"""The three ways a worker takes leases from the gateway — a WebSocket with in-band settles,
Server-Sent Events with credit, long-polled fetches — each reconnecting with jittered backoff
(0.1 s doubling to 10 s) and withdrawing its credit at once when the worker drains."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from typing import TYPE_CHECKING, Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.protocol import State

from ._gateway import raise_for_auth
from .errors import AuthError

if TYPE_CHECKING:
    from .worker import Worker

BACKOFF_FIRST, BACKOFF_MAX = 0.1, 10.0
# How long an in-band settle waits for its `settled` frame before going over HTTP instead
# (the gateway answers within its --settle-timeout, 5 s by default).
IN_BAND_ANSWER_SECONDS = 15.0
# An SSE stream is read after a drain began until nothing came for SSE_QUIET seconds (at
# most SSE_QUIET_MAX in all).
SSE_QUIET, SSE_QUIET_MAX = 0.25, 1.5
# The longest a fetch waits at the gateway while nothing comes (a fetch of a consumer ordered
# per key is answered as soon as a settle frees a key's next message, as any other).
FETCH_WAIT_MS = 2000.0


class Backoff:
    """Jittered exponential delays between connection attempts."""

    def __init__(self) -> None:
        self.delay = BACKOFF_FIRST

    def next(self) -> float:
        delay = self.delay * random.uniform(0.5, 1.0)
        self.delay = min(self.delay * 2, BACKOFF_MAX)
        return delay

    def reset(self) -> None:
        self.delay = BACKOFF_FIRST


class Transport:
    """What the worker needs of a transport."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.withdrawn = asyncio.Event()
        self.backoff = Backoff()
        self.connected_once = False

    async def run(self) -> None:
        raise NotImplementedError

    def withdraw(self) -> None:
        """Take no new messages from now on."""
        self.withdrawn.set()

    async def settle_in_band(self, op: str, ids: list[str], delay_ms: int | None,
                             reason: str | None) -> list[dict[str, Any]] | None:
        """The results of a settle sent in band, or None: send it over HTTP."""
        return None

    def connected(self) -> None:
        if self.connected_once:
            self.worker.stats.reconnects += 1
        self.connected_once = True

    async def pause(self) -> bool:
        """Wait out the backoff; False when the worker stops meanwhile."""
        delay = self.backoff.next()
        try:
            await asyncio.wait_for(self.withdrawn.wait(), delay)
            return False
        except asyncio.TimeoutError:
            return True


class WsTransport(Transport):
    """``GET /ws``: leases and settles on one WebSocket, credit = ``max_in_flight`` less the
    leases still held from an earlier connection."""

    def __init__(self, worker: Worker) -> None:
        super().__init__(worker)
        self.sockets: list[ClientConnection] = []
        self.refs = itertools.count(1)
        self.waiters: dict[int, tuple[ClientConnection, asyncio.Future[Any]]] = {}
        self.readers: set[asyncio.Task[None]] = set()

    async def run(self) -> None:
        worker = self.worker
        gateway = worker.gateway
        while not self.withdrawn.is_set():
            credit = await worker.wait_credit()
            if credit is None:
                break
            # frames=batch: the leases ready together come in one frame, parsed once (a
            # frame each cost more than the whole handling of a no-op handler). With
            # max_bytes, a frame a lease: the socket is paused between two, so no more than
            # the bound (and one message) is ever read ahead.
            frames = "single" if worker.max_bytes is not None else "batch"
            try:
                ws = await websockets.connect(
                    gateway.ws_url(f"max_in_flight={credit}&encoding=utf8&frames={frames}"),
                    additional_headers=gateway.headers, max_size=None, compression=None,
                    open_timeout=10, close_timeout=5, ping_interval=20, ping_timeout=40,
                    # Frames read ahead of the worker: the credit bounds them anyway, and a
                    # queue that pauses the socket every 16 frames costs loop turns; with
                    # max_bytes, the library's default keeps what waits unread small.
                    max_queue=16 if worker.max_bytes is not None else credit + 16)
            except InvalidStatus as error:
                status = error.response.status_code
                if status in (401, 403):
                    raise AuthError(status, error.response.body.decode(errors="replace")
                                    if error.response.body else "refused") from None
                worker.log.warning("ruststream: /ws answered %s; connecting again", status)
                if not await self.pause():
                    break
                continue
            except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as error:
                worker.log.warning("ruststream: cannot reach %s (%s); connecting again",
                                   gateway.url, error)
                if not await self.pause():
                    break
                continue
            self.connected()
            self.sockets.append(ws)
            shutdown = asyncio.Event()
            reader = asyncio.get_running_loop().create_task(self._read(ws, shutdown))
            self.readers.add(reader)
            reader.add_done_callback(self.readers.discard)
            waits = {reader, asyncio.ensure_future(shutdown.wait()),
                     asyncio.ensure_future(self.withdrawn.wait())}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waits - {reader}:
                waiter.cancel()
            if self.withdrawn.is_set():
                # Closing: frames the gateway wrote before it saw the close are still read
                # (and nak'd), so no lease written to this socket is left unknown.
                await ws.close()
                await reader
                break
            if shutdown.is_set():
                # The gateway stops: this socket still takes settles until it closes; the
                # next connection (elsewhere, behind a balancer) starts at once.
                self.backoff.reset()
                await asyncio.sleep(self.backoff.next())
                continue
            if not await self.pause():
                break
        for reader in list(self.readers):
            await reader

    async def _read(self, ws: ClientConnection, shutdown: asyncio.Event) -> None:
        worker = self.worker
        accept = worker.accept
        loads = json.loads
        recv = ws.recv
        try:
            while True:
                event = loads(await recv())
                kind = event.get("type")
                if kind == "messages":
                    for message in event.get("messages") or ():
                        accept(message)
                    if worker.bytes_full:
                        await worker.room_for_bytes()
                elif kind == "message":  # a frame a lease: the framing asked for under max_bytes
                    accept(event)
                    if worker.bytes_full:
                        await worker.room_for_bytes()
                elif kind == "settled":
                    entry = self.waiters.pop(event.get("ref", -1), None)
                    if entry is not None and not entry[1].done():
                        entry[1].set_result(event.get("results") or [])
                elif kind == "shutdown":
                    self.backoff.reset()
                    shutdown.set()
                    worker.on_gateway_shutdown(str(event.get("reason")))
                elif kind == "error":
                    worker.log.warning("ruststream: the gateway refused a frame: %s", event)
        except ConnectionClosed:
            pass
        except Exception:  # a frame we cannot read must not end the worker silently
            worker.log.exception("ruststream: reading the WebSocket failed")
        finally:
            if ws in self.sockets:
                self.sockets.remove(ws)
            for ref, (socket, future) in list(self.waiters.items()):
                if socket is ws:
                    del self.waiters[ref]
                    if not future.done():
                        future.set_result(None)
            if ws.state is not State.CLOSED:
                await ws.close()

    async def settle_in_band(self, op: str, ids: list[str], delay_ms: int | None,
                             reason: str | None) -> list[dict[str, Any]] | None:
        ws = next((s for s in reversed(self.sockets) if s.state is State.OPEN), None)
        if ws is None:
            return None
        ref = next(self.refs)
        frame: dict[str, Any] = {"op": op, "ids": ids, "ref": ref}
        if delay_ms is not None:
            frame["delay_ms"] = delay_ms
        if reason is not None:
            frame["reason"] = reason
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.waiters[ref] = (ws, future)
        try:
            await ws.send(json.dumps(frame))
            results: list[dict[str, Any]] | None = await asyncio.wait_for(
                future, IN_BAND_ANSWER_SECONDS)
            return results
        except (ConnectionClosed, asyncio.TimeoutError):
            return None
        finally:
            self.waiters.pop(ref, None)


class SseTransport(Transport):
    """``GET /events``: leases as Server-Sent Events with credit; settles over HTTP."""

    last_event = 0.0

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.worker.settler.release()

    async def _run(self) -> None:
        while not self.withdrawn.is_set():
            credit = await self.worker.wait_credit()
            if credit is None:
                break
            self.last_event = time.monotonic()
            stream = asyncio.get_running_loop().create_task(self._stream(credit))
            withdrawn = asyncio.ensure_future(self.withdrawn.wait())
            await asyncio.wait({stream, withdrawn}, return_when=asyncio.FIRST_COMPLETED)
            withdrawn.cancel()
            if not stream.done():
                await self._read_to_quiet(stream)
            try:
                shutdown = await stream
            except asyncio.CancelledError:
                break
            if self.withdrawn.is_set():
                break
            if shutdown:
                self.backoff.reset()
            if not await self.pause():
                break

    async def _read_to_quiet(self, stream: asyncio.Task[bool]) -> None:
        """SSE has no closing handshake: events the gateway wrote before it sees us leave
        are read (and nak'd) until the stream is quiet, settles held meanwhile so that no
        credit is freed for more; only then is the connection closed."""
        started = time.monotonic()
        while not stream.done():
            now = time.monotonic()
            if now - self.last_event > SSE_QUIET or now - started > SSE_QUIET_MAX:
                stream.cancel()
                break
            await asyncio.sleep(0.02)

    def withdraw(self) -> None:
        self.worker.settler.hold()  # before the drain's first nak (see _read_to_quiet)
        super().withdraw()

    async def _stream(self, credit: int) -> bool:
        """One stream, until it ends; True when the gateway said it shuts down."""
        worker = self.worker
        gateway = worker.gateway
        try:
            async with gateway.http.stream(
                    "GET", gateway.route("events"),
                    params={"max_in_flight": credit, "encoding": "utf8"},
                    timeout=httpx.Timeout(10.0, read=60.0)) as response:
                if response.status_code in (401, 403):
                    await response.aread()  # the problem's detail, for the error
                    raise_for_auth(response)
                if response.status_code != 200:
                    worker.log.warning("ruststream: /events answered %s; connecting again",
                                       response.status_code)
                    return False
                self.connected()
                event, data = "message", []
                async for line in response.aiter_lines():
                    self.last_event = time.monotonic()
                    if line:
                        if line.startswith("data:"):
                            data.append(line[5:].lstrip(" "))
                        elif line.startswith("event:"):
                            event = line[6:].strip()
                        continue
                    if data and event == "message":
                        worker.accept(json.loads("\n".join(data)))
                        if worker.bytes_full:
                            await worker.room_for_bytes()
                    elif event == "shutdown":
                        worker.on_gateway_shutdown("\n".join(data))
                        return True
                    event, data = "message", []
        except httpx.HTTPError as error:
            worker.log.warning("ruststream: event stream from %s lost (%s); connecting again",
                               gateway.url, error)
        return False


class FetchTransport(Transport):
    """``POST /fetch`` long polls for what credit allows, a few at once (one poll returns as
    soon as anything is leased: alone it would serve a consumer ordered per key one message
    at a time); settles over HTTP. A poll under way when the worker drains is let finish
    (its messages are nak'd), never abandoned: what it leased would be stranded."""

    POLLERS = 4

    async def run(self) -> None:
        worker = self.worker
        self.reserved = 0
        self.reserved_bytes = 0
        self.wait_ms = int(min(FETCH_WAIT_MS, max(100.0, worker.drain_timeout * 250)))
        count = max(1, min(self.POLLERS, worker.max_in_flight // 10))
        self.share = -(-worker.max_in_flight // count)
        await asyncio.gather(*(self._poll() for _ in range(count)))

    async def _poll(self) -> None:
        worker = self.worker
        gateway = worker.gateway
        while not self.withdrawn.is_set():
            credit = await worker.wait_credit(lambda: self.reserved)
            if credit is None:
                break
            batch = min(credit, self.share, 1000)
            body: dict[str, Any] = {"batch": batch, "wait_ms": self.wait_ms, "encoding": "utf8"}
            budget = 0
            if worker.max_bytes is not None:
                # The polls under way share max_bytes: each asks for what the buffer and the
                # others leave, so that together they never bring in more.
                budget = await self._byte_budget(worker.max_bytes)
                if budget <= 0:
                    break
                body["max_bytes"] = budget
            self.reserved += batch
            self.reserved_bytes += budget
            try:
                response = await gateway.http.post(gateway.route("fetch"), json=body,
                                                   timeout=self.wait_ms / 1000 + 15)
            except httpx.HTTPError as error:
                worker.log.warning("ruststream: fetch from %s failed (%s); again",
                                   gateway.url, error)
                if not await self.pause():
                    break
                continue
            finally:
                self.reserved -= batch
                self.reserved_bytes -= budget
                worker.credit_freed()
            raise_for_auth(response)
            if response.status_code == 200:
                if not self.connected_once or self.backoff.delay > BACKOFF_FIRST:
                    self.connected()
                self.backoff.reset()
                for raw in response.json()["messages"]:
                    worker.accept(raw)
                if worker.bytes_full:
                    await worker.room_for_bytes()
                continue
            if response.status_code == 429:
                retry_after = float(response.headers.get("Retry-After") or 1)
                try:
                    await asyncio.wait_for(self.withdrawn.wait(), min(retry_after, 5.0))
                except asyncio.TimeoutError:
                    pass
                continue
            worker.log.warning("ruststream: fetch answered %s; again", response.status_code)
            if not await self.pause():
                break

    async def _byte_budget(self, max_bytes: int) -> int:
        """Payload bytes the next poll may bring in; 0 once the worker drains."""
        worker = self.worker
        while not self.withdrawn.is_set():
            room = max_bytes - worker.buffered_bytes - self.reserved_bytes
            if room > 0:
                return room
            await worker.bytes_freed()
        return 0


TRANSPORTS: dict[str, type[Transport]] = {
    "ws": WsTransport, "sse": SseTransport, "fetch": FetchTransport,
}
