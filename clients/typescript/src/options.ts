// The worker's options with their defaults, its counters, and the logger it writes through.

export type TransportName = "ws" | "sse" | "fetch";

/** Anything with console's four methods; the default is console with `debug` silenced. */
export interface Logger {
  debug(message: string, ...rest: unknown[]): void;
  info(message: string, ...rest: unknown[]): void;
  warn(message: string, ...rest: unknown[]): void;
  error(message: string, ...rest: unknown[]): void;
}

export interface WorkerOptions {
  /** The gateway's base URL, e.g. http://localhost:8080. */
  url: string;
  /** With `consumer`: a named consumer; both absent: the gateway's default consumer. */
  stream?: string;
  consumer?: string;
  /** Bearer token: Authorization in Node, a stream ticket for a browser's WebSocket. */
  token?: string | null;
  /** "ws" (default), "sse" or "fetch". */
  transport?: TransportName;
  /** Most leases held at once (buffered, running and settling): 100. */
  maxInFlight?: number;
  /** Most handlers running at once: 16. */
  concurrency?: number;
  /** Most payload bytes buffered and not started: unbounded by default. */
  maxBytes?: number | null;
  /** How long a message's lease is extended while its handler runs: 3 600 000 (60 min). */
  maxLeaseMs?: number;
  /** How long stop() lets running handlers finish: 30 000. */
  drainTimeoutMs?: number;
  /** The first retry delay after a handler's exception: 1 000 (doubling per delivery). */
  backoffInitialMs?: number;
  /** The longest such delay: 60 000. */
  backoffMaxMs?: number;
  /** Where the worker logs: console by default, without its debug lines (one per confirmed settle; pass `console` to see them). */
  logger?: Logger;
}

export interface ResolvedOptions {
  url: string;
  stream: string | undefined;
  consumer: string | undefined;
  token: string | undefined;
  transport: TransportName;
  maxInFlight: number;
  concurrency: number;
  maxBytes: number | undefined;
  maxLeaseMs: number;
  drainTimeoutMs: number;
  backoffInitialMs: number;
  backoffMaxMs: number;
  logger: Logger;
}

/** console, but without the debug line per confirmed settle: a busy worker would print one per message. */
const DEFAULT_LOGGER: Logger = {
  debug: () => undefined,
  info: (message, ...rest) => console.info(message, ...rest),
  warn: (message, ...rest) => console.warn(message, ...rest),
  error: (message, ...rest) => console.error(message, ...rest),
};

function positive(name: string, value: number, max = Number.MAX_SAFE_INTEGER): number {
  if (!Number.isFinite(value) || value <= 0 || value > max) {
    throw new RangeError(`${name} must be a number in 1..${max}, got ${value}`);
  }
  return value;
}

export function resolveOptions(options: WorkerOptions): ResolvedOptions {
  if (typeof options.url !== "string" || options.url === "") throw new TypeError("url is required");
  const transport = options.transport ?? "ws";
  if (transport !== "ws" && transport !== "sse" && transport !== "fetch") {
    throw new RangeError(`transport must be "ws", "sse" or "fetch", got ${String(transport)}`);
  }
  if ((options.stream === undefined) !== (options.consumer === undefined)) {
    throw new TypeError("give both stream and consumer, or neither (the gateway's default consumer)");
  }
  return {
    url: options.url,
    stream: options.stream,
    consumer: options.consumer,
    token: options.token ?? undefined,
    transport,
    maxInFlight: Math.floor(positive("maxInFlight", options.maxInFlight ?? 100, 1000)),
    concurrency: Math.floor(positive("concurrency", options.concurrency ?? 16)),
    maxBytes: options.maxBytes == null ? undefined : positive("maxBytes", options.maxBytes),
    maxLeaseMs: positive("maxLeaseMs", options.maxLeaseMs ?? 3_600_000),
    drainTimeoutMs: positive("drainTimeoutMs", options.drainTimeoutMs ?? 30_000),
    backoffInitialMs: positive("backoffInitialMs", options.backoffInitialMs ?? 1_000),
    backoffMaxMs: positive("backoffMaxMs", options.backoffMaxMs ?? 60_000),
    logger: options.logger ?? DEFAULT_LOGGER,
  };
}

/** What the worker counted since it was made. */
export interface WorkerStats {
  /** Leases received. */
  received: number;
  acked: number;
  naked: number;
  termed: number;
  /** Lease extensions the gateway confirmed. */
  extended: number;
  /** Buffered messages whose lease ran out before a handler could start them (dropped, never handed out). */
  expiredInBuffer: number;
  /** Settles that failed, by HTTP status ("0": never reached the gateway while the lease lived). */
  settleFailures: Record<string, number>;
  /** Connections opened again after one ended. */
  reconnects: number;
}

export function newStats(): WorkerStats {
  return { received: 0, acked: 0, naked: 0, termed: 0, extended: 0, expiredInBuffer: 0, settleFailures: {}, reconnects: 0 };
}

/** The nak delay after a handler's exception: min(initial × 2^(delivered−1), max), jittered down by up to a quarter (so delays still grow per delivery). */
export function backoffDelay(options: Pick<ResolvedOptions, "backoffInitialMs" | "backoffMaxMs">, delivered: number): number {
  const full = Math.min(options.backoffInitialMs * 2 ** Math.max(0, delivered - 1), options.backoffMaxMs);
  return Math.round(full * (0.75 + 0.25 * Math.random()));
}
