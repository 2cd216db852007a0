// Tracing of handlers (src/tracing.ts): without a tracer provider nothing changes; with one (an
// in-memory exporter) each handler call runs in a CONSUMER span continuing the message's
// traceparent, with the Python package's name and attributes, ERROR when the handler throws.
// The last test goes through the real gateway: messages published straight to JetStream with
// their headers, taken by a Worker.

import assert from "node:assert/strict";
import { test } from "node:test";

import { jetstream } from "@nats-io/jetstream";
import { connect, headers as natsHeaders } from "@nats-io/transport-node";
import { context, SpanKind, SpanStatusCode, trace, type SpanContext } from "@opentelemetry/api";
import { AsyncLocalStorageContextManager } from "@opentelemetry/context-async-hooks";
import { BasicTracerProvider, InMemorySpanExporter, SimpleSpanProcessor, type ReadableSpan } from "@opentelemetry/sdk-trace-base";

import { Term, Worker } from "../src/index.js";
import { Message } from "../src/message.js";
import { tracedHandler } from "../src/tracing.js";
import type { WireMessage } from "../src/wire.js";
import { Fixture, waitFor } from "./fixture.js";
import { recordingLogger } from "./suite.js";

const TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736";
const SPAN_ID = "00f067aa0ba902b7";
const SAMPLED = `00-${TRACE_ID}-${SPAN_ID}-01`;

function message(headers: Record<string, string[]>, subject = "orders.unit"): Message {
  const raw: WireMessage = {
    id: "x", subject, data: "", encoding: "base64", headers, stream: "ORDERS", consumer: "billing", stream_sequence: 7,
    consumer_sequence: 7, delivered: 3, pending: 0, published_at: "2026-12-01T00:00:00Z", lease_expires_at: "2026-12-01T00:00:30Z",
  };
  return new Message(raw, { settle: () => Promise.resolve(), extend: () => Promise.resolve() });
}

// Registered by the first test that needs it: the test before runs without a provider.
let exporter: InMemorySpanExporter | undefined;
function registeredExporter(): InMemorySpanExporter {
  if (exporter === undefined) {
    exporter = new InMemorySpanExporter();
    trace.setGlobalTracerProvider(new BasicTracerProvider({ spanProcessors: [new SimpleSpanProcessor(exporter)] }));
    context.setGlobalContextManager(new AsyncLocalStorageContextManager().enable());
  }
  return exporter;
}

/** Run `message` through a traced handler; the one span it made, and what the handler saw as active. */
async function oneSpan(msg: Message, body: () => unknown = () => undefined): Promise<{ span: ReadableSpan; active: SpanContext | undefined; error: unknown }> {
  const spans = registeredExporter();
  spans.reset();
  let active: SpanContext | undefined;
  const traced = await tracedHandler(() => {
    active = trace.getActiveSpan()?.spanContext();
    return body();
  });
  let error: unknown;
  try {
    await traced(msg);
  } catch (err) {
    error = err;
  }
  const finished = spans.getFinishedSpans();
  assert.equal(finished.length, 1);
  return { span: finished[0] as ReadableSpan, active, error };
}

test("tracing: without the API the handler is called as it is; without a provider it runs unchanged", async () => {
  const handler = (msg: Message): string => msg.subject;
  assert.equal(await tracedHandler(handler, "@opentelemetry/api-not-installed"), handler);

  // The API is installed here, but no tracer provider (nor context manager) is registered.
  let calls = 0;
  const traced = await tracedHandler(async (msg) => {
    calls++;
    if (msg.subject === "orders.fail") throw new Term("no");
    return `handled ${msg.subject}`;
  });
  assert.equal(await traced(message({ traceparent: [SAMPLED] })), "handled orders.unit");
  assert.equal(await traced(message({})), "handled orders.unit");
  const thrown = await Promise.resolve(traced(message({ traceparent: [SAMPLED] }, "orders.fail"))).catch((err: unknown) => err);
  assert.ok(thrown instanceof Term);
  assert.equal(thrown.reason, "no");
  assert.equal(calls, 3);
});

test("tracing: a consumer span, child of the message's traceparent, with the Python package's name and attributes", async () => {
  const { span, active, error } = await oneSpan(message({ TraceParent: [SAMPLED], tracestate: ["vendor=x,other=y"] }), () => "ok");
  assert.equal(error, undefined);
  assert.equal(span.name, "orders.unit process");
  assert.equal(span.kind, SpanKind.CONSUMER);
  assert.equal(span.spanContext().traceId, TRACE_ID);
  assert.equal(span.parentSpanContext?.spanId, SPAN_ID);
  assert.equal(span.parentSpanContext?.isRemote, true);
  assert.equal(span.parentSpanContext?.traceState?.get("vendor"), "x");
  assert.deepEqual(span.attributes, {
    "messaging.system": "nats",
    "messaging.operation.type": "process",
    "messaging.destination.name": "orders.unit",
    "messaging.consumer.group.name": "ORDERS/billing",
    "messaging.message.id": "ORDERS:7",
    "messaging.message.delivery_count": 3,
  });
  assert.equal(span.status.code, SpanStatusCode.UNSET);
  assert.equal(active?.spanId, span.spanContext().spanId);
});

test("tracing: a throwing handler (synchronously or not, an Error or not) gives an ERROR span with the exception, and the same throw", async () => {
  const boom = new Error("boom");
  const sync = await oneSpan(message({ traceparent: [SAMPLED] }), () => {
    throw boom;
  });
  assert.equal(sync.error, boom);
  assert.deepEqual(sync.span.status, { code: SpanStatusCode.ERROR, message: "Error: boom" });
  const [event] = sync.span.events;
  assert.equal(event?.name, "exception");
  assert.equal(event?.attributes?.["exception.type"], "Error");
  assert.equal(event?.attributes?.["exception.message"], "boom");

  const term = await oneSpan(message({}), () => Promise.reject(new Term("bad order")));
  assert.ok(term.error instanceof Term);
  assert.deepEqual(term.span.status, { code: SpanStatusCode.ERROR, message: "Term: term: bad order" });

  const odd = await oneSpan(message({}), () => Promise.reject("not an Error"));
  assert.equal(odd.error, "not an Error");
  assert.deepEqual(odd.span.status, { code: SpanStatusCode.ERROR, message: "not an Error" });
});

test("tracing: an invalid traceparent starts a trace of its own; a later version's extra fields are accepted", async () => {
  const invalid = [
    `00-${TRACE_ID}-${SPAN_ID}-01-extra`, // version 00 ends at the flags
    `ff-${TRACE_ID}-${SPAN_ID}-01`,
    `00-${"0".repeat(32)}-${SPAN_ID}-01`,
    `00-${TRACE_ID}-${"0".repeat(16)}-01`,
    `00-${TRACE_ID.toUpperCase()}-${SPAN_ID}-01`,
    "garbage",
  ];
  for (const traceparent of invalid) {
    const { span } = await oneSpan(message({ traceparent: [traceparent] }));
    assert.equal(span.parentSpanContext, undefined, traceparent);
    assert.notEqual(span.spanContext().traceId, TRACE_ID, traceparent);
  }
  const { span } = await oneSpan(message({ traceparent: [`01-${TRACE_ID}-${SPAN_ID}-01-later`] }));
  assert.equal(span.parentSpanContext?.spanId, SPAN_ID);
});

test("tracing through the gateway: published traceparents continued, one span per delivery, ERROR on throws", async () => {
  const spans = registeredExporter();
  spans.reset();
  const gateway = await Fixture.start({ ackWait: "5s" });
  try {
    const failTrace = "0af7651916cd43dd8448eb211c80319c";
    const failSpan = "b7ad6b7169203331";
    const nc = await connect({ servers: gateway.natsUrl });
    const sequences = new Map<string, number>();
    try {
      const js = jetstream(nc);
      const publish = async (subject: string, traceparent?: string): Promise<void> => {
        const h = natsHeaders();
        if (traceparent !== undefined) {
          h.set("traceparent", traceparent);
          h.set("tracestate", "vendor=x");
        }
        sequences.set(subject, (await js.publish(subject, subject, { headers: h })).seq);
      };
      await publish("orders.traced.ok", SAMPLED);
      await publish("orders.traced.fail", `00-${failTrace}-${failSpan}-01`);
      await publish("orders.traced.plain");
    } finally {
      await nc.close();
    }

    const worker = new Worker({ url: gateway.url, logger: recordingLogger(), backoffInitialMs: 50, backoffMaxMs: 50 });
    const active = new Map<string, SpanContext | undefined>();
    const run = worker.run((msg) => {
      active.set(`${msg.subject}#${msg.delivered}`, trace.getActiveSpan()?.spanContext());
      if (msg.subject === "orders.traced.fail") {
        if (msg.delivered === 1) throw new Error("boom");
        throw new Term("gave up");
      }
    });
    await waitFor("two acks and a term", () => worker.stats.acked === 2 && worker.stats.termed === 1, 20_000);
    await worker.stop();
    await run;

    const finished = spans.getFinishedSpans();
    assert.equal(finished.length, 4);
    const byDelivery = new Map(
      finished.map((span) => [`${String(span.attributes["messaging.destination.name"])}#${String(span.attributes["messaging.message.delivery_count"])}`, span]),
    );
    const ok = byDelivery.get("orders.traced.ok#1");
    assert.ok(ok !== undefined, [...byDelivery.keys()].join(", "));
    assert.equal(ok.name, "orders.traced.ok process");
    assert.equal(ok.kind, SpanKind.CONSUMER);
    assert.equal(ok.spanContext().traceId, TRACE_ID);
    assert.equal(ok.parentSpanContext?.spanId, SPAN_ID);
    assert.equal(ok.parentSpanContext?.traceState?.serialize(), "vendor=x");
    assert.deepEqual(ok.attributes, {
      "messaging.system": "nats",
      "messaging.operation.type": "process",
      "messaging.destination.name": "orders.traced.ok",
      "messaging.consumer.group.name": "ORDERS/billing",
      "messaging.message.id": `ORDERS:${sequences.get("orders.traced.ok")}`,
      "messaging.message.delivery_count": 1,
    });
    assert.equal(ok.status.code, SpanStatusCode.UNSET);
    assert.deepEqual(active.get("orders.traced.ok#1"), ok.spanContext());

    const failed = [byDelivery.get("orders.traced.fail#1"), byDelivery.get("orders.traced.fail#2")];
    for (const span of failed) {
      assert.ok(span !== undefined);
      assert.equal(span.kind, SpanKind.CONSUMER);
      assert.equal(span.spanContext().traceId, failTrace);
      assert.equal(span.parentSpanContext?.spanId, failSpan);
      assert.equal(span.attributes["messaging.message.id"], `ORDERS:${sequences.get("orders.traced.fail")}`);
      assert.equal(span.status.code, SpanStatusCode.ERROR);
      assert.equal(span.events[0]?.name, "exception");
    }
    assert.equal(failed[0]?.status.message, "Error: boom");
    assert.equal(failed[1]?.status.message, "Term: term: gave up");
    assert.notEqual(failed[0]?.spanContext().spanId, failed[1]?.spanContext().spanId);
    assert.deepEqual(active.get("orders.traced.fail#2"), failed[1]?.spanContext());

    // No traceparent: a trace of its own.
    const plain = byDelivery.get("orders.traced.plain#1");
    assert.ok(plain !== undefined);
    assert.equal(plain.parentSpanContext, undefined);
    assert.ok(![TRACE_ID, failTrace].includes(plain.spanContext().traceId));
    assert.equal(plain.status.code, SpanStatusCode.UNSET);
  } finally {
    await gateway.stop();
  }
});
