"""Push delivery as an endpoint's author meets it, checked with the official libraries.

Usage: push_receiver.py BASE TOKEN PORT SECRET

Serves two endpoints on 127.0.0.1:PORT for the gateway at BASE to push to:
  /signed  (format json, signed): every request must verify with the Standard Webhooks
           library (`standardwebhooks`) and the secret SECRET (`whsec_…`);
  /events  (format cloudevents): every request must parse with the CloudEvents SDK
           (`cloudevents`) as a 1.0 event whose id, source and type are the push's.
Publishes three messages through BASE (token TOKEN) and exits 0 once each endpoint has taken
all three, 1 on the first request that fails its check or after 30 s.
"""

import base64
import json
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from cloudevents.v1.http import from_http
from standardwebhooks.webhooks import Webhook

BASE, TOKEN, PORT, SECRET = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
WORDS = ["first", "second", "third"]
verifier = Webhook(SECRET)
taken = {"/signed": set(), "/events": set()}
failures = []
lock = threading.Lock()


class Endpoint(BaseHTTPRequestHandler):
    def log_message(self, *_):
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        headers = {name.lower(): value for name, value in self.headers.items()}
        try:
            if self.path == "/signed":
                message = verifier.verify(body, headers)
                word = base64.b64decode(message["data"]).decode()
                if headers["webhook-id"] != f"ORDERS:{message['stream_sequence']}":
                    raise ValueError(f"webhook-id {headers['webhook-id']} for {message}")
            elif self.path == "/events":
                event = from_http(headers, body)
                word = event.data.decode() if isinstance(event.data, bytes) else str(event.data)
                if event["specversion"] != "1.0" or event["source"] != "/streams/ORDERS":
                    raise ValueError(f"not the push's event: {event}")
                if event["id"] != headers["webhook-id"] or not event["type"].startswith("orders.push."):
                    raise ValueError(f"id or type: {event}")
            else:
                raise ValueError(f"unexpected path {self.path}")
        except Exception as err:  # noqa: BLE001 - any failure is the check failing
            with lock:
                failures.append(f"{self.path}: {type(err).__name__}: {err}")
            self.send_response(400)
            self.end_headers()
            return
        with lock:
            taken[self.path].add(word)
        self.send_response(204)
        self.end_headers()


server = ThreadingHTTPServer(("127.0.0.1", PORT), Endpoint)
threading.Thread(target=server.serve_forever, daemon=True).start()

for word in WORDS:
    request = urllib.request.Request(
        BASE + "/publish",
        data=json.dumps({"subject": f"orders.push.{word}", "data": word}).encode(),
        method="POST",
        headers={"Authorization": "Bearer " + TOKEN},
    )
    status = urllib.request.urlopen(request, timeout=10).status
    if status != 201:
        raise SystemExit(f"publish {word}: expected 201, got {status}")

deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    with lock:
        if failures:
            raise SystemExit("a push failed its check: " + "; ".join(failures))
        if all(words == set(WORDS) for words in taken.values()):
            print("push: signatures verified by standardwebhooks, events parsed by cloudevents")
            sys.exit(0)
    time.sleep(0.1)
raise SystemExit(f"not every push arrived within 30 s: {taken}")
