"""A worker process for the SIGTERM test: ``python worker_process.py URL TRANSPORT KIND``.
Every tenth message's handler never ends in time; the others take half a second. Prints
``done <seq>`` as each handler returns and ``stats <json>`` once drained."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time

from ruststream import Message, Worker

url, transport, kind = sys.argv[1:4]


_lock = threading.Lock()


def report(line: str) -> None:
    with _lock:  # sync handlers report from several threads
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


async def handle_async(msg: Message) -> None:
    await asyncio.sleep(120 if msg.stream_sequence % 10 == 0 else 0.5)
    report(f"done {msg.stream_sequence}")


def handle_sync(msg: Message) -> None:
    time.sleep(120 if msg.stream_sequence % 10 == 0 else 0.5)
    report(f"done {msg.stream_sequence}")


worker = Worker(url, transport=transport, max_in_flight=100, concurrency=10, drain_timeout=4.0)
report("ready")
worker.run_forever(handle_async if kind == "async" else handle_sync)
report("stats " + json.dumps(dataclasses.asdict(worker.stats)))
