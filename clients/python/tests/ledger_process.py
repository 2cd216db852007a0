"""A worker process for the ledger test (test_ledger.py), killed -9 and started again there:
``python ledger_process.py URL TRANSPORT LEDGER LOG``.

Its handler reads the message's id from the payload, does a little work (a digest, a
millisecond's await, as a handler calling another service does) and, as it returns, appends
``done <id> <stream seq> <delivery> <payload bytes>`` to LEDGER with one write(2): the line
is the kernel's the moment the handler ends, so a kill -9 right after loses none. The library
logs at DEBUG to LOG, one line per settle the gateway confirmed; ``stats <json>`` goes to
stdout once drained (SIGTERM)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import sys

from ruststream import Message, Worker

url, transport, ledger_path, log_path = sys.argv[1:5]

ledger = os.open(ledger_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

log_file = logging.FileHandler(log_path)  # flushed after each record
log_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
logger = logging.getLogger("ruststream")
logger.setLevel(logging.DEBUG)
logger.addHandler(log_file)


async def handle(msg: Message) -> None:
    data = msg.data
    message_id = data.split(b" ", 1)[0].decode()
    hashlib.sha256(data).digest()
    await asyncio.sleep(0.001)
    os.write(ledger, f"done {message_id} {msg.stream_sequence} {msg.delivered} "
                     f"{len(data)}\n".encode())


worker = Worker(url, transport=transport, drain_timeout=5.0)
worker.run_forever(handle)
print("stats " + json.dumps(dataclasses.asdict(worker.stats)), flush=True)
