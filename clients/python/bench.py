"""Benchmark rows: the Worker (no-op handler, ws) against a nats-py pull worker (fetch 100,
``await msg.ack()`` each) and a bare websockets loop acking 100 ids in band, in one run, on
one nats-server and one gateway started here. Needs nats-py (bench-requirements.txt).

    python bench.py [--messages 20000] [--size 256]

Env: RUSTSTREAM_BIN (the gateway), NATS_SERVER_BIN, as for the tests."""

from __future__ import annotations

import argparse
import asyncio
import json
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


async def bare_ws_row(url: str, count: int) -> None:
    done = 0
    async with websockets.connect(url.replace("http", "ws") +
                                  "/streams/BENCH/consumers/bare/ws?max_in_flight=100",
                                  max_size=None, compression=None) as ws:
        ids: list[str] = []
        while done < count:
            event = json.loads(await ws.recv())
            if event["type"] == "message":
                ids.append(event["id"])
                done += 1
                if len(ids) == 100 or done == count:
                    await ws.send(json.dumps({"op": "ack", "ids": ids}))
                    ids = []


async def worker_row(url: str, count: int) -> None:
    worker = Worker(url, stream="BENCH", consumer="worker", max_in_flight=100, concurrency=16)

    async def noop(msg: Message) -> None:
        return None

    async def watch() -> None:
        while worker.stats.acked < count:
            await asyncio.sleep(0.005)
        worker.stop()

    watcher = asyncio.get_running_loop().create_task(watch())
    await worker.run(noop)
    await watcher


async def timed(run: Callable[[], Coroutine[Any, Any, None]]) -> tuple[float, float]:
    cpu, wall = time.process_time(), time.perf_counter()
    await run()
    return time.perf_counter() - wall, time.process_time() - cpu


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--size", type=int, default=256)
    args = parser.parse_args()
    count, payload = args.messages, b"x" * args.size
    server = NatsServer()
    folder = tempfile.TemporaryDirectory()
    consumers = Path(folder.name, "consumers.toml")
    consumers.write_text(
        '[[consumer]]\nstream = "BENCH"\nname = "bare"\nfilter_subject = "bench.ws.>"\n'
        'ack_wait = "30s"\n\n[[consumer]]\nstream = "BENCH"\nname = "worker"\n'
        'filter_subject = "bench.worker.>"\nack_wait = "30s"\n')
    gateway = Gateway(server, "BENCH", "--consumers-file", str(consumers), ack_wait="30s")
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    try:
        rows: list[tuple[str, float, float]] = []
        await fill(js, nc, "bench.natspy.x", count, payload)
        rows.append(("nats-py pull (fetch 100, ack each)",
                     *await timed(lambda: nats_py_row(nc, js, count))))
        await fill(js, nc, "bench.ws.x", count, payload)
        rows.append(("bare websockets loop (ack 100 in band)",
                     *await timed(lambda: bare_ws_row(gateway.url, count))))
        await fill(js, nc, "bench.worker.x", count, payload)
        rows.append(("ruststream Worker (ws, no-op handler)",
                     *await timed(lambda: worker_row(gateway.url, count))))
    finally:
        await nc.close()
        gateway.stop()
        server.stop()
        folder.cleanup()
    base, bare = count / rows[0][1], count / rows[1][1]
    print(f"{count} messages of {args.size} B, one nats-server, one gateway (debug or release "
          "as RUSTSTREAM_BIN is)")
    print(f"{'row':44} {'msg/s':>9} {'× nats-py':>10} {'× bare ws':>10} {'CPU µs/msg':>11}")
    for name, wall, cpu in rows:
        rate = count / wall
        print(f"{name:44} {rate:9.0f} {rate / base:10.2f} {rate / bare:10.2f} "
              f"{cpu / count * 1e6:11.1f}")


if __name__ == "__main__":
    asyncio.run(main())
