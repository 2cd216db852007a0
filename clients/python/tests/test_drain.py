"""SIGTERM to a worker process holding 100 leases: it exits 0 within drain_timeout, nothing
stays leased at the gateway, and every message it did not finish can be fetched again at
once (no one waits out ack_wait, 30 s here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import GatewayFactory
from helpers import eventually, publish

DRAIN_TIMEOUT = 4.0


@pytest.mark.parametrize("transport,kind", [("ws", "async"), ("ws", "sync"), ("sse", "async"),
                                            ("fetch", "async")])
async def test_sigterm_drains_within_drain_timeout(gateway_factory: GatewayFactory,
                                                   transport: str, kind: str) -> None:
    gateway = gateway_factory(ack_wait="30s")
    total = 300
    await publish(gateway, [f"{gateway.stream.lower()}.d"] * total)
    process = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("worker_process.py")), gateway.url,
         transport, kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    lines: list[str] = []
    assert process.stdout is not None and process.stderr is not None
    reader = threading.Thread(target=lambda: lines.extend(process.stdout or []), daemon=True)
    reader.start()
    try:
        # Handlers have run (one is done) and the worker holds 100 leases.
        await eventually(lambda: any(line.startswith("done") for line in lines)
                         and gateway.consumer()["leases_in_flight"] == 100, 20,
                         "the worker holds 100 leases")
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(DRAIN_TIMEOUT + 10)
        exited = time.monotonic() - signalled
        reader.join(5)
        err = process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    out = "".join(lines)
    assert process.returncode == 0, err
    assert exited < DRAIN_TIMEOUT + 1.0, (exited, err)
    info = gateway.consumer()
    assert info["leases_in_flight"] == 0, (out[-2000:], err[-4000:])
    done = {int(line.split()[1]) for line in lines if line.startswith("done ")}
    lines = [line.strip() for line in lines]
    stats = json.loads(next(line[6:] for line in lines if line.startswith("stats ")))
    assert stats["acked"] == len(done) and stats["settle_failures"] == {}, stats
    assert done and not any(seq % 10 == 0 for seq in done)

    # Everything not done is back at once: fetchable within 2 s.
    fetched: set[int] = set()
    deadline = time.monotonic() + 2.0
    async with httpx.AsyncClient(base_url=gateway.url) as http:
        while len(fetched) < total - len(done) and time.monotonic() < deadline:
            answer = await http.post("/fetch", json={"batch": 1000, "wait_ms": 200})
            fetched |= {m["stream_sequence"] for m in answer.json()["messages"]}
    assert fetched == set(range(1, total + 1)) - done
