"""Benchmark rows: the Worker (no-op handler, ws) against a nats-py pull worker (fetch 100,
``await msg.ack()`` each) and a bare websockets loop acking 100 ids in band — a frame per
lease, as the issue measured it, and with ``frames=batch`` as the Worker reads them — in
one run, on one nats-server and one gateway started here; then the Worker with a 10 ms handler and
concurrency 64 against its bound (concurrency / handler time). Each row prints the CPU per
message of this process, of the gateway and of nats-server (read from /proc). Needs nats-py
(bench-requirements.txt); with aiohttp installed too, a row of the issue's own baseline, the
same bare loop over aiohttp.

    python bench.py [--messages 20000] [--size 256] [--profile FILE]

``--profile`` writes cProfiles of the Worker rows to FILE.noop and FILE.slow (their rates
are then not comparable).

Env: RUSTSTREAM_BIN (the gateway), NATS_SERVER_BIN, as for the tests."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib.util
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

import nats
import websockets
from nats.js.api import ConsumerConfig

sys.path.insert(0, str(Path(__file__).with_name("tests")))
from servers import Gateway, NatsServer  # noqa: E402

from ruststream import Message, Worker  # noqa: E402

SLOW_MS, SLOW_CONCURRENCY = 10, 64


async def fill(js: Any, nc: Any, subject: str, count: int, payload: bytes) -> None:
    for start in range(0, count, 1000):
        acks = [js.publish(subject, payload) for _ in range(min(1000, count - start))]
        await asyncio.gather(*acks)


async def nats_py_row(nc: Any, js: Any, count: int) -> None:
    sub = await js.pull_subscribe("bench.natspy.>", durable="natspy",
                                  config=ConsumerConfig(ack_wait=30, max_ack_pending=1024))
    done = 0
    while done < count:
        try:
            batch = await sub.fetch(100, timeout=5)
        except nats.errors.TimeoutError:
            continue
        for msg in batch:
            await msg.ack()
            done += 1


def leases_of(event: dict[str, Any]) -> list[dict[str, Any]]:
    """The leases a frame holds: one (`message`), a batch (`messages`), or none."""
    kind = event["type"]
    if kind == "messages":
        messages: list[dict[str, Any]] = event["messages"]
        return messages
    return [event] if kind == "message" else []


async def bare_ws_row(url: str, count: int, consumer: str, frames: str) -> None:
    done = 0
    async with websockets.connect(url.replace("http", "ws") +
                                  f"/streams/BENCH/consumers/{consumer}/ws?max_in_flight=100"
                                  f"&frames={frames}", max_size=None, compression=None) as ws:
        ids: list[str] = []
        while done < count:
            for lease in leases_of(json.loads(await ws.recv())):
                ids.append(lease["id"])
                done += 1
                if len(ids) == 100 or done == count:
                    await ws.send(json.dumps({"op": "ack", "ids": ids}))
                    ids = []


async def bare_aiohttp_row(url: str, count: int, consumer: str, frames: str) -> None:
    """The issue's own baseline: the same loop over aiohttp, whose WebSocket reader is C."""
    import aiohttp

    done = 0
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url.replace("http", "ws") + "/streams/BENCH/consumers/"
                                      f"{consumer}/ws?max_in_flight=100&frames={frames}",
                                      compress=0) as ws:
            ids: list[str] = []
            while done < count:
                for lease in leases_of(json.loads((await ws.receive()).data)):
                    ids.append(lease["id"])
                    done += 1
                    if len(ids) == 100 or done == count:
                        await ws.send_str(json.dumps({"op": "ack", "ids": ids}))
                        ids = []


async def worker_row(url: str, count: int, consumer: str = "worker", concurrency: int = 16,
                     handler_seconds: float = 0.0) -> None:
    worker = Worker(url, stream="BENCH", consumer=consumer, max_in_flight=100,
                    concurrency=concurrency)

    async def noop(msg: Message) -> None:
        return None

    async def slow(msg: Message) -> None:
        await asyncio.sleep(handler_seconds)

    async def watch() -> None:
        while worker.stats.acked < count:
            await asyncio.sleep(0.005)
        worker.stop()

    watcher = asyncio.get_running_loop().create_task(watch())
    await worker.run(slow if handler_seconds else noop)
    await watcher


# The other processes of a row, whose CPU is read from /proc (Linux): the gateway and
# nats-server. Set by main().
OTHERS: dict[str, int] = {}


def process_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), or NaN where /proc is not there."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def timed(run: Callable[[], Coroutine[Any, Any, None]],
                profile: str | None = None) -> tuple[float, float, float, float]:
    """Wall time, this process's CPU, the gateway's and nats-server's CPU, in seconds."""
    profiler = cProfile.Profile() if profile else None
    others = {name: process_seconds(pid) for name, pid in OTHERS.items()}
    cpu, wall = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    await run()
    if profiler is not None:
        profiler.disable()
    elapsed = time.perf_counter() - wall, time.process_time() - cpu
    used = {name: process_seconds(pid) - others[name] for name, pid in OTHERS.items()}
    if profiler is not None and profile:
        profiler.dump_stats(profile)
    return (*elapsed, used.get("gateway", float("nan")), used.get("nats-server", float("nan")))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--size", type=int, default=256)
    parser.add_argument("--profile")
    args = parser.parse_args()
    count, payload = args.messages, b"x" * args.size
    server = NatsServer()
    folder = tempfile.TemporaryDirectory()
    consumers = Path(folder.name, "consumers.toml")
    names = {"bare": "ws", "barebatch": "wsbatch", "worker": "worker", "slow": "slow",
             "bareaio": "aio", "bareaiobatch": "aiobatch"}
    consumers.write_text("".join(
        f'[[consumer]]\nstream = "BENCH"\nname = "{name}"\nfilter_subject = "bench.{sub}.>"\n'
        'ack_wait = "30s"\n\n' for name, sub in names.items()))
    gateway = Gateway(server, "BENCH", "--consumers-file", str(consumers), ack_wait="30s")
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    try:
        assert gateway.process is not None
        OTHERS.update({"gateway": gateway.process.pid, "nats-server": server.process.pid})
        rows: list[tuple[str, float, float, float, float]] = []
        await fill(js, nc, "bench.natspy.x", count, payload)
        rows.append(("nats-py pull (fetch 100, ack each)",
                     *await timed(lambda: nats_py_row(nc, js, count))))
        # The bare loops, as the issue measured them (a frame per lease), then with the
        # framing the Worker uses (frames=batch).
        for frames, suffix, label in (("single", "", "a frame each"),
                                      ("batch", "batch", "frames=batch")):
            await fill(js, nc, f"bench.ws{suffix}.x", count, payload)
            rows.append((f"bare websockets loop, {label}",
                         *await timed(lambda: bare_ws_row(gateway.url, count, "bare" + suffix,
                                                          frames))))
            if importlib.util.find_spec("aiohttp") is not None:
                await fill(js, nc, f"bench.aio{suffix}.x", count, payload)
                rows.append((f"bare aiohttp loop, {label}",
                             *await timed(lambda: bare_aiohttp_row(
                                 gateway.url, count, "bareaio" + suffix, frames))))
        await fill(js, nc, "bench.worker.x", count, payload)
        rows.append(("ruststream Worker (ws, no-op handler)",
                     *await timed(lambda: worker_row(gateway.url, count),
                                 args.profile and args.profile + ".noop")))
        await fill(js, nc, "bench.slow.x", count, payload)
        rows.append((f"Worker, {SLOW_MS} ms handler, concurrency {SLOW_CONCURRENCY}",
                     *await timed(lambda: worker_row(gateway.url, count, "slow",
                                                     SLOW_CONCURRENCY, SLOW_MS / 1000),
                                  args.profile and args.profile + ".slow")))
    finally:
        await nc.close()
        gateway.stop()
        server.stop()
        folder.cleanup()
    rates = {name: count / wall for name, wall, *_ in rows}
    base = rates[rows[0][0]]
    bare = rates["bare websockets loop, a frame each"]
    bare_batch = rates["bare websockets loop, frames=batch"]
    print(f"{count} messages of {args.size} B, one nats-server, one gateway (debug or release "
          "as RUSTSTREAM_BIN is)")
    bound = SLOW_CONCURRENCY / (SLOW_MS / 1000)
    print(f"{'row':44} {'msg/s':>9} {'× nats-py':>10} {'× bare ws':>10} {'× bare batch':>13} "
          f"{'× bound':>8} {'CPU µs/msg':>11} {'gateway':>8} {'nats-server':>12}")
    for name, wall, cpu, gateway_cpu, server_cpu in rows:
        rate = rates[name]
        of_bound = f"{rate / bound:8.2f}" if name.startswith("Worker,") else f"{'':8}"
        print(f"{name:44} {rate:9.0f} {rate / base:10.2f} {rate / bare:10.2f} "
              f"{rate / bare_batch:13.2f} {of_bound} {cpu / count * 1e6:11.1f} "
              f"{gateway_cpu / count * 1e6:8.1f} {server_cpu / count * 1e6:12.1f}")
    print(f"bound of the {SLOW_MS} ms row: concurrency / handler time = {bound:.0f} msg/s")


if __name__ == "__main__":
    asyncio.run(main())
