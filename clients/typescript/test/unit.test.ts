// Unit tests of the pure parts: options and their defaults, the retry backoff, ordering keys,
// and the settler's coalescing where there is no setImmediate (a browser).

import assert from "node:assert/strict";
import { test } from "node:test";

import { keyFunction } from "../src/keys.js";
import { Message } from "../src/message.js";
import { backoffDelay, resolveOptions } from "../src/options.js";
import { Settler } from "../src/settler.js";
import type { Api } from "../src/http.js";
import type { Connection } from "../src/transport.js";
import type { WireMessage } from "../src/wire.js";

test("options: the contract's defaults, and refusals", () => {
  const options = resolveOptions({ url: "http://localhost:8080" });
  assert.equal(options.transport, "ws");
  assert.equal(options.maxInFlight, 100);
  assert.equal(options.concurrency, 16);
  assert.equal(options.maxBytes, undefined);
  assert.equal(options.maxLeaseMs, 3_600_000);
  assert.equal(options.drainTimeoutMs, 30_000);
  assert.equal(options.backoffInitialMs, 1_000);
  assert.equal(options.backoffMaxMs, 60_000);
  assert.equal(options.stream, undefined);
  assert.throws(() => resolveOptions({ url: "http://x", stream: "ORDERS" }), TypeError);
  assert.throws(() => resolveOptions({ url: "http://x", maxInFlight: 1001 }), RangeError);
  assert.throws(() => resolveOptions({ url: "http://x", concurrency: 0 }), RangeError);
  assert.throws(() => resolveOptions({ url: "http://x", transport: "grpc" as "ws" }), RangeError);
});

test("backoff: min(initial x 2^(delivered-1), max), jittered down by at most a quarter", () => {
  const options = { backoffInitialMs: 1_000, backoffMaxMs: 60_000 };
  for (let i = 0; i < 200; i++) {
    for (const [delivered, full] of [[1, 1_000], [2, 2_000], [3, 4_000], [7, 60_000], [30, 60_000]] as const) {
      const delay = backoffDelay(options, delivered);
      assert.ok(delay >= 0.75 * full && delay <= full, `delivered ${delivered}: ${delay}`);
    }
  }
});

function message(subject: string, headers: Record<string, string[]>): Message {
  const raw: WireMessage = {
    id: "x", subject, data: "", encoding: "base64", headers, stream: "S", consumer: "C", stream_sequence: 1,
    consumer_sequence: 1, delivered: 1, pending: 0, published_at: "2026-12-01T00:00:00Z", lease_expires_at: "2026-12-01T00:00:30Z",
  };
  return new Message(raw, { settle: () => Promise.resolve(), extend: () => Promise.resolve() });
}

test("ordering keys: subject token, named header, the default header; too long counts as none", () => {
  assert.equal(keyFunction("subject:2")(message("orders.c-7.created", {})), "c-7");
  assert.equal(keyFunction("subject:9")(message("orders.c-7", {})), undefined);
  assert.equal(keyFunction("header:Customer")(message("o", { customer: ["c-9"] })), "c-9");
  assert.equal(keyFunction("header")(message("o", { "Ruststream-Ordering-Key": ["k"] })), "k");
  assert.equal(keyFunction(undefined)(message("o", { "Ruststream-Ordering-Key": ["k"] })), "k");
  assert.equal(keyFunction(undefined)(message("o", {})), undefined);
  assert.equal(keyFunction("header")(message("o", { "Ruststream-Ordering-Key": ["k".repeat(1025)] })), undefined);
});

test("settler without setImmediate, as in a browser: settles of one turn go out together in the next task", async () => {
  const saved = Object.getOwnPropertyDescriptor(globalThis, "setImmediate");
  delete (globalThis as { setImmediate?: unknown }).setImmediate;
  try {
    const sent: string[][] = [];
    const connection = {
      sendInBand: (_op: string, ids: string[], _extra: unknown, answer: { answered(results: { id: string; status: number }[]): void }) => {
        sent.push(ids);
        answer.answered(ids.map((id) => ({ id, status: 204 })));
        return true;
      },
    } as unknown as Connection;
    const api = { settle: () => Promise.reject(new Error("not over HTTP: the connection carries it")) } as unknown as Api;
    const settler = new Settler(api, () => connection, () => true);
    const answered: string[] = [];
    const item = (id: string) => ({ id, answered: () => (answered.push(id), false) });
    // Idle (no handler running): flushed after this turn, both in one operation.
    settler.submit("ack", {}, item("a"));
    settler.submit("ack", {}, item("b"));
    assert.deepEqual(sent, []);
    await new Promise((resolve) => setTimeout(resolve, 0));
    assert.deepEqual(sent, [["a", "b"]]);
    assert.deepEqual(answered, ["a", "b"]);
    // A flush at once cancels the one scheduled: nothing is sent twice.
    settler.submit("ack", {}, item("c"));
    settler.flush();
    await new Promise((resolve) => setTimeout(resolve, 10));
    assert.deepEqual(sent, [["a", "b"], ["c"]]);
  } finally {
    if (saved !== undefined) Object.defineProperty(globalThis, "setImmediate", saved);
  }
});
