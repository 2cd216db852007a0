// The producer and push-receiver helpers: Client.publish against the real gateway; verifyPush
// on hand-made Standard Webhooks signatures (rotation, tolerance, tampering) and on the real
// gateway's pushes to a node:http receiver that answers with PushAnswer values.

import assert from "node:assert/strict";
import { createHmac, randomBytes } from "node:crypto";
import { createServer, type IncomingMessage } from "node:http";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { test } from "node:test";

import * as main from "../src/index.js";
import { Client } from "../src/index.js";
import { PushAnswer, PushVerificationError, SETTLE_HEADER, verifyPush, type PushedMessage } from "../src/push.js";
import { Fixture, waitFor } from "./fixture.js";

const secret = (): string => `whsec_${randomBytes(32).toString("base64")}`;

function sign(secrets: string[], id: string, timestamp: number, body: string): Record<string, string> {
  const signatures = secrets.map((s) => {
    const key = Buffer.from(s.slice("whsec_".length), "base64");
    return `v1,${createHmac("sha256", key).update(`${id}.${timestamp}.${body}`).digest("base64")}`;
  });
  return { "webhook-id": id, "webhook-timestamp": String(timestamp), "webhook-signature": signatures.join(" "), "content-type": "application/json" };
}

const body = JSON.stringify({
  id: "lease-1", subject: "orders.1", data: "aGk=", encoding: "base64", headers: {}, stream: "ORDERS", consumer: "hooks",
  stream_sequence: 7, consumer_sequence: 7, delivered: 2, pending: 0, published_at: "2026-12-01T00:00:00Z", lease_expires_at: "2026-12-01T00:00:30Z",
});

test("verifyPush accepts a signature of any of several secrets and returns the message with its lease id", () => {
  const [old, current] = [secret(), secret()];
  const now = Date.now();
  const headers = sign([current], "ORDERS:7", Math.floor(now / 1000), body);
  const [message] = verifyPush([old, current], headers, body, now);
  assert.equal(message?.id, "lease-1");
  assert.equal(message?.text(), "hi");
  assert.equal(message?.streamSequence, 7);
  assert.equal(message?.delivered, 2);
  // A Headers object works as well as a plain record.
  assert.equal(verifyPush(current, new Headers(headers), new TextEncoder().encode(body), now).length, 1);
});

test("the package's main entry exports the push helpers too", () => {
  const current = secret();
  const now = Date.now();
  const headers = sign([current], "ORDERS:7", Math.floor(now / 1000), body);
  assert.equal(main.verifyPush(current, headers, body, now)[0]?.id, "lease-1");
  assert.throws(() => main.verifyPush(secret(), headers, body, now), main.PushVerificationError);
  assert.equal(main.PushAnswer.nak(250), "nak; delay=250");
  assert.equal(main.SETTLE_HEADER, SETTLE_HEADER);
});

test("verifyPush refuses a wrong secret, a tampered body, a stale or future timestamp, missing headers", () => {
  const key = secret();
  const now = Date.now();
  const seconds = Math.floor(now / 1000);
  assert.throws(() => verifyPush(secret(), sign([key], "ORDERS:7", seconds, body), body, now), PushVerificationError);
  assert.throws(() => verifyPush(key, sign([key], "ORDERS:7", seconds, body), body.replace("hooks", "hookz"), now), PushVerificationError);
  assert.throws(() => verifyPush(key, sign([key], "ORDERS:7", seconds - 301, body), body, now), PushVerificationError);
  assert.throws(() => verifyPush(key, sign([key], "ORDERS:7", seconds + 301, body), body, now), PushVerificationError);
  assert.equal(verifyPush(key, sign([key], "ORDERS:7", seconds - 299, body), body, now).length, 1);
  assert.throws(() => verifyPush(key, { "content-type": "application/json" }, body, now), PushVerificationError);
});

test("PushAnswer values are the Ruststream-Settle syntax of docs/push.md", () => {
  assert.equal(SETTLE_HEADER, "Ruststream-Settle");
  assert.equal(PushAnswer.ack, "ack");
  assert.equal(PushAnswer.later, "later");
  assert.equal(PushAnswer.nak(), "nak");
  assert.equal(PushAnswer.nak(1500), "nak; delay=1500");
  assert.throws(() => PushAnswer.nak(1.5), RangeError);
  assert.throws(() => PushAnswer.nak(-1), RangeError);
  assert.equal(PushAnswer.term(), "term");
  assert.equal(PushAnswer.term("bad\norder"), "term; reason=bad order");
});

test("Client.publish stores headers, a msgId once, an ordering key; the gateway's pushes verify and follow the answers", async () => {
  const key = secret();
  const received: PushedMessage[] = [];
  const server = createServer((request: IncomingMessage, response) => {
    const chunks: Buffer[] = [];
    request.on("data", (chunk: Buffer) => chunks.push(chunk));
    request.on("end", () => {
      const [message] = verifyPush([secret(), key], request.headers, Buffer.concat(chunks));
      if (message === undefined) throw new Error("no message");
      received.push(message);
      // The first delivery is nak'd with a delay, the second acked.
      response.setHeader(SETTLE_HEADER, message.delivered === 1 ? PushAnswer.nak(200) : PushAnswer.ack);
      response.writeHead(200).end();
    });
  });
  await new Promise<void>((ok) => server.listen(0, "127.0.0.1", ok));
  const address = server.address();
  const port = typeof address === "object" && address !== null ? address.port : 0;
  const gateway = await Fixture.start({
    consumers: (dir) => {
      writeFileSync(join(dir, "push-secret"), `${key}\n`);
      return `[[consumer]]\nstream = "ORDERS"\nname = "hooks"\nfilter_subject = "orders.push.>"\n\n[consumer.push]\nurl = "http://127.0.0.1:${port}/hook"\nsigning_secret_file = "push-secret"\n`;
    },
  });
  try {
    const client = new Client({ url: gateway.url });
    const first = await client.publish("orders.plain", "plain", { headers: { "X-Tenant": "acme" }, msgId: "m-1", orderingKey: "c-42" });
    const again = await client.publish("orders.plain", "plain", { msgId: "m-1" });
    assert.equal(again.sequence, first.sequence);
    assert.equal(again.duplicate, true);
    const [fetched] = await gateway.fetch(1, 2_000);
    assert.deepEqual(fetched?.headers["X-Tenant"], ["acme"]);
    assert.deepEqual(fetched?.headers["Ruststream-Ordering-Key"], ["c-42"]);
    const bytes = await client.publish("orders.push.1", new Uint8Array([0, 1, 255]));
    await waitFor("the push nak'd then acked", () => received.length === 2, 20_000);
    assert.deepEqual([...(received[1]?.data ?? [])], [0, 1, 255]);
    assert.equal(received[0]?.streamSequence, bytes.sequence);
    assert.deepEqual(received.map((message) => message.delivered), [1, 2]);
    assert.notEqual(received[0]?.id, received[1]?.id);
  } finally {
    await gateway.stop();
    server.close();
  }
});
