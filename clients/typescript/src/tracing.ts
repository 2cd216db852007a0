// Tracing of handlers: when @opentelemetry/api can be imported at run time, each handler call
// runs in a CONSUMER span that continues the message's `traceparent` (the Python package's
// _tracing.py, same name and attributes); otherwise the handler is called as it is, at no cost.
// The API is never a dependency of this package: it is imported by a computed name, which
// bundlers leave alone, and an import that fails (not installed, or a browser without an
// import map for it) simply means no tracing.

import type { Message } from "./message.js";

type OtelApi = typeof import("@opentelemetry/api");
type Context = import("@opentelemetry/api").Context;
type SpanContext = import("@opentelemetry/api").SpanContext;
type Tracer = import("@opentelemetry/api").Tracer;

/** What the worker calls per message. */
export type MessageHandler = (message: Message) => unknown;

const API_MODULE = "@opentelemetry/api";
/** The tracer's name, as the Python package's. */
const TRACER_NAME = "ruststream";

const loaded = new Map<string, Promise<OtelApi | undefined>>();

/** The API module, or undefined where it cannot be imported; imported once per process. */
function loadApi(name: string): Promise<OtelApi | undefined> {
  let api = loaded.get(name);
  if (api === undefined) {
    // A computed name: bundlers (webpack, Vite, esbuild, Rollup) neither resolve nor bundle it.
    api = (import(/* webpackIgnore: true */ /* @vite-ignore */ name) as Promise<OtelApi & { default?: OtelApi }>).then(
      // Node hands a CommonJS build's exports as named exports; some loaders only as `default`.
      (module) => (typeof module.trace?.getTracer === "function" ? module : module.default),
      () => undefined,
    );
    loaded.set(name, api);
  }
  return api;
}

/**
 * The function the worker calls for each message: `handler` itself when the OpenTelemetry API
 * cannot be imported, else one running it in a consumer span. Spans come from the tracer
 * provider registered globally, also one registered after this call; with none, the API's
 * no-op spans (the message's trace context still becomes the handler's active context).
 * `apiModule` is for tests only.
 */
export async function tracedHandler(handler: MessageHandler, apiModule: string = API_MODULE): Promise<MessageHandler> {
  const api = await loadApi(apiModule);
  if (api === undefined) return handler;
  const tracer = api.trace.getTracer(TRACER_NAME);
  return (message) => runInSpan(api, tracer, handler, message);
}

async function runInSpan(api: OtelApi, tracer: Tracer, handler: MessageHandler, message: Message): Promise<unknown> {
  const parent = extractContext(api, message);
  const span = tracer.startSpan(
    `${message.subject} process`,
    {
      kind: api.SpanKind.CONSUMER,
      attributes: {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": message.subject,
        "messaging.consumer.group.name": `${message.stream}/${message.consumer}`,
        "messaging.message.id": `${message.stream}:${message.streamSequence}`,
        "messaging.message.delivery_count": message.delivered,
      },
    },
    parent,
  );
  try {
    return await api.context.with(api.trace.setSpan(parent, span), () => handler(message));
  } catch (err) {
    // Any throw, Nak and Term included, as the Python package (whose Nak and Term are exceptions too).
    if (err instanceof Error) {
      span.recordException(err);
      span.setStatus({ code: api.SpanStatusCode.ERROR, message: `${err.name}: ${err.message}` });
    } else {
      span.recordException(String(err));
      span.setStatus({ code: api.SpanStatusCode.ERROR, message: String(err) });
    }
    throw err;
  } finally {
    span.end();
  }
}

/**
 * The message's trace context: through the globally registered propagator first (the user's
 * choice, e.g. B3), else from the W3C `traceparent`/`tracestate` headers, which the gateway's
 * own spans write. The base is the root context: a message without one starts a trace of its
 * own, never a child of whatever was active when the worker started.
 */
function extractContext(api: OtelApi, message: Message): Context {
  // As the Python package: names lowercased, a header's first value.
  const carrier: Record<string, string> = {};
  for (const [name, values] of Object.entries(message.headers)) {
    const first = values[0];
    if (first !== undefined) carrier[name.toLowerCase()] = first;
  }
  const context = api.propagation.extract(api.ROOT_CONTEXT, carrier);
  if (api.trace.getSpanContext(context) !== undefined) return context;
  const remote = parseTraceparent(api, carrier["traceparent"], carrier["tracestate"]);
  return remote === undefined ? context : api.trace.setSpanContext(context, remote);
}

const TRACEPARENT = /^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$/;

/** A W3C Trace Context `traceparent` (and its `tracestate`), or undefined where it is not valid. */
function parseTraceparent(api: OtelApi, traceparent: string | undefined, tracestate: string | undefined): SpanContext | undefined {
  const match = traceparent === undefined ? null : TRACEPARENT.exec(traceparent.trim());
  if (match === null) return undefined;
  const [, version, traceId, spanId, flags, rest] = match as unknown as [string, string, string, string, string, string | undefined];
  // Version ff is invalid; version 00 has nothing after the flags (later versions may).
  if (version === "ff" || (version === "00" && rest !== undefined)) return undefined;
  const spanContext: SpanContext = { traceId, spanId, traceFlags: parseInt(flags, 16) & api.TraceFlags.SAMPLED, isRemote: true };
  if (!api.isSpanContextValid(spanContext)) return undefined;
  if (tracestate !== undefined && typeof api.createTraceState === "function") spanContext.traceState = api.createTraceState(tracestate);
  return spanContext;
}
