"""verify_push against signatures computed as Standard Webhooks says, and against a real push
from the gateway to a local receiver answering with Ruststream-Settle."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.server
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import GatewayFactory
from helpers import eventually, publish_through_gateway
from ruststream import push
from servers import free_port

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()
OTHER = "whsec_" + base64.b64encode(b"o" * 32).decode()


def signed(secret: str, body: bytes, stamp: int, webhook_id: str = "ORDERS:1") -> dict[str, str]:
    key = base64.b64decode(secret[6:])
    mac = hmac.new(key, f"{webhook_id}.{stamp}.".encode() + body, hashlib.sha256).digest()
    return {"webhook-id": webhook_id, "webhook-timestamp": str(stamp),
            "webhook-signature": "v1," + base64.b64encode(mac).decode(),
            "content-type": "application/json"}


MESSAGE = {"id": "lease-1", "subject": "orders.1", "data": "aGk=", "encoding": "base64",
           "headers": {}, "stream": "ORDERS", "consumer": "hooks", "stream_sequence": 1,
           "delivered": 1}


def test_verify_accepts_any_current_secret_and_reads_the_message() -> None:
    body = json.dumps(MESSAGE).encode()
    headers = signed(SECRET, body, int(time.time()))
    [message] = push.verify_push([OTHER, SECRET], headers, body)
    assert (message.id, message.data, message.stream_sequence) == ("lease-1", b"hi", 1)
    batch = json.dumps({"messages": [MESSAGE, {**MESSAGE, "id": "lease-2"}]}).encode()
    asgi_headers = [(k.encode(), v.encode()) for k, v in signed(SECRET, batch,
                                                                 int(time.time())).items()]
    assert [m.id for m in push.verify_push(SECRET, asgi_headers, batch)] == ["lease-1", "lease-2"]


@pytest.mark.parametrize("change", ["body", "secret", "old", "future", "missing"])
def test_verify_refuses(change: str) -> None:
    body = json.dumps(MESSAGE).encode()
    stamp = int(time.time()) + {"old": -301, "future": 301}.get(change, 0)
    headers = signed(OTHER if change == "secret" else SECRET, body, stamp)
    if change == "missing":
        del headers["webhook-signature"]
    with pytest.raises(push.PushVerificationError):
        push.verify_push(SECRET, headers, body + (b" " if change == "body" else b""))


def test_answers() -> None:
    assert (push.ack(), push.later(), push.nak(), push.nak(2.5)) == \
        ("ack", "later", "nak", "nak; delay=2500")
    assert push.term("bad\nthing \u00e9") == "term; reason=bad thing  "
    with pytest.raises(ValueError):
        push.nak(-1)


async def test_a_real_push_verified_and_settled(gateway_factory: GatewayFactory) -> None:
    received: list[Any] = []
    errors: list[str] = []

    class Hook(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = self.rfile.read(int(self.headers["Content-Length"]))
            try:
                [message] = push.verify_push(SECRET, dict(self.headers.items()), body)
            except push.PushVerificationError as error:
                errors.append(str(error))
                self.send_response(401)
                self.end_headers()
                return
            received.append(message)
            self.send_response(200)
            answer = push.term("poison") if message.subject.endswith(".bad") else push.ack()
            self.send_header(push.SETTLE_HEADER, answer)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Hook)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    folder = tempfile.TemporaryDirectory()
    try:
        Path(folder.name, "secret").write_text(SECRET + "\n")
        stream = f"P{os.getpid()}{int(time.time() * 1000) % 100000}"
        Path(folder.name, "consumers.toml").write_text(
            f'[[consumer]]\nstream = "{stream}"\nname = "hooks"\n\n[consumer.push]\n'
            f'url = "http://127.0.0.1:{port}/hook"\nsigning_secret_file = "secret"\n')
        gateway = gateway_factory("--consumers-file", str(Path(folder.name, "consumers.toml")),
                                  stream=stream)
        await publish_through_gateway(gateway.url,
                                      [f"{stream.lower()}.good", f"{stream.lower()}.bad"])
        await eventually(lambda: len(received) >= 2, 20, "both pushed")

        def settled() -> bool:
            import httpx

            info = httpx.get(f"{gateway.url}/streams/{stream}/consumers/hooks").json()
            return bool(info["num_pending"] == 0 and info["num_ack_pending"] == 0)

        await eventually(settled, 10, "both settled at the server")
    finally:
        server.shutdown()
        server.server_close()
        folder.cleanup()
    assert errors == []
    assert sorted(m.subject.rsplit(".", 1)[1] for m in received[:2]) == ["bad", "good"]
    assert all(m.id for m in received)
    assert len(received) == 2  # acked and termed: neither pushed again
