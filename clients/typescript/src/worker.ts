// The worker: takes leases from a transport into a bounded local buffer, runs the handler on
// at most `concurrency` of them (a key's next message only after the previous one settled),
// settles by the handler's outcome, extends leases at half their life up to maxLeaseMs,
// reconnects with backoff, and drains on stop(): nothing new taken, the buffer nak'd, running
// handlers given drainTimeoutMs, what still runs nak'd.

import { AuthError, Nak, Term } from "./errors.js";
import { Api, consumerPath } from "./http.js";
import { keyFunction, type KeyOf } from "./keys.js";
import { Message, type MessageOwner } from "./message.js";
import { backoffDelay, newStats, resolveOptions, type ResolvedOptions, type WorkerOptions, type WorkerStats } from "./options.js";
import { Settler, UNREACHABLE } from "./settler.js";
import { FetchTransport, SseTransport } from "./streams.js";
import { deferred, type Connection, type Feed, type Transport } from "./transport.js";
import { tracedHandler } from "./tracing.js";
import type { SettleResult, WireMessage } from "./wire.js";
import { WsTransport } from "./ws.js";

export type Handler = (message: Message) => unknown | Promise<unknown>;

export interface RunOptions {
  /** Install SIGTERM/SIGINT handlers that call stop() (removed when run() returns). */
  signals?: boolean;
}

/** How often the lease keeper looks at what is held. */
const TICK_MS = 100;
/** A buffered message this close to its expiry is no longer started. */
const EXPIRY_MARGIN_MS = 50;
const RECONNECT_INITIAL_MS = 100;
const RECONNECT_MAX_MS = 10_000;

type State = "buffered" | "running" | "settling";

/** A lease the worker holds, from its arrival until its settle is answered or it expires. */
interface Held {
  message: Message;
  state: State;
  receivedAt: number;
  expiresAt: number;
  /** When the next extension is due: half of what is left of the lease. */
  extendAt: number;
  extending: boolean;
  gaveUp: boolean;
  key: string | undefined;
  /** Its key is marked busy (from its start until its settle is answered). */
  holdsKey: boolean;
  bytes: number;
  settled: Promise<void> | undefined;
  /** The handler's own outcome no longer counts (it was nak'd by the drain). */
  abandoned: boolean;
}

export class Worker implements MessageOwner {
  readonly options: ResolvedOptions;
  /** Counters since the worker was made. */
  readonly stats: WorkerStats = newStats();
  private readonly api: Api;
  private readonly transport: Transport;
  private readonly settler: Settler;
  private readonly held = new Map<string, Held>();
  private buffer: Held[] = [];
  private bufferedBytes = 0;
  private running = 0;
  private readonly busyKeys = new Set<string>();
  private keyOf: KeyOf = keyFunction(undefined);
  private handler: Handler | undefined;
  private connection: Connection | undefined;
  private paused = false;
  private stopping = false;
  /** Draining, and the connection is still closing: arrivals wait in the buffer. */
  private closing = false;
  private fatal: Error | undefined;
  private readonly stopped = deferred<void>();
  private drainStarted: Promise<void> | undefined;
  private ticker: ReturnType<typeof setInterval> | undefined;
  private handlersIdle = deferred<void>();
  private wakeReconnect: (() => void) | undefined;

  constructor(options: WorkerOptions) {
    this.options = resolveOptions(options);
    const { url, token, stream, consumer, maxInFlight, logger } = this.options;
    this.api = new Api(url, token);
    const onError = (text: string): void => logger.warn(`ruststream: ${text}`);
    this.transport =
      this.options.transport === "ws"
        ? new WsTransport(this.api, stream, consumer, maxInFlight, this.options.maxBytes === undefined, onError)
        : this.options.transport === "sse"
          ? new SseTransport(this.api, stream, consumer, maxInFlight)
          : new FetchTransport(this.api, stream, consumer);
    this.settler = new Settler(this.api, () => this.connection, () => this.running === 0);
    this.handlersIdle.resolve();
  }

  /** Take and handle messages until stop() (or a signal, with `signals: true`) has drained; rejects with AuthError on 401/403. */
  async run(handler: Handler, runOptions: RunOptions = {}): Promise<void> {
    if (this.handler !== undefined) throw new Error("run() was already called on this worker");
    this.handler = handler;
    const onSignal = (signal: string): void => {
      this.options.logger.info(`ruststream: ${signal}: draining`);
      void this.stop();
    };
    if (runOptions.signals === true) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    try {
      // In a consumer span per message where OpenTelemetry's API can be imported (tracing.ts).
      this.handler = await tracedHandler(handler);
      await this.readOrderingKey();
      this.ticker = setInterval(() => this.keepLeases(), TICK_MS);
      const loop = this.connectLoop();
      await this.stopped.promise;
      await loop;
      // Leases that arrived while the connection was closing were nak'd as they came: their answers too.
      this.settler.flush();
      await Promise.all([...this.held.values()].map((held) => held.settled));
    } finally {
      if (this.ticker !== undefined) clearInterval(this.ticker);
      if (runOptions.signals === true) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
    }
    if (this.fatal !== undefined) throw this.fatal;
  }

  /** Drain and stop: resolves once every lease held was settled (or given back). */
  stop(): Promise<void> {
    if (this.drainStarted === undefined) {
      this.stopping = true;
      this.drainStarted = this.drain().then(() => this.stopped.resolve());
    }
    return this.drainStarted;
  }

  /** Leases held now: buffered, running and settling. */
  get inFlight(): number {
    return this.held.size;
  }

  /** The consumer's ordering_key spec, where the token may read the consumer (else the Ruststream-Ordering-Key header). */
  private async readOrderingKey(): Promise<void> {
    const { stream, consumer } = this.options;
    const path = stream === undefined || consumer === undefined ? "/consumer" : consumerPath(stream, consumer, "fetch").replace(/\/fetch$/, "");
    try {
      const info = await this.api.get<{ ordering_key?: string | null }>(path);
      this.keyOf = keyFunction(info.ordering_key);
    } catch {
      this.keyOf = keyFunction(undefined);
    }
  }

  // ---- connections ----

  private async connectLoop(): Promise<void> {
    let backoff = RECONNECT_INITIAL_MS;
    let first = true;
    while (!this.stopping) {
      if (!first) {
        this.stats.reconnects++;
        const pause = backoff / 2 + (Math.random() * backoff) / 2;
        backoff = Math.min(backoff * 2, RECONNECT_MAX_MS);
        await new Promise<void>((resolve) => {
          const timer = setTimeout(resolve, pause);
          this.wakeReconnect = () => {
            clearTimeout(timer);
            resolve();
          };
        });
        this.wakeReconnect = undefined;
        if (this.stopping) break;
      }
      first = false;
      try {
        const connection = await this.transport.connect(this.feed);
        if (this.stopping) {
          connection.close();
          break;
        }
        this.connection = connection;
        backoff = RECONNECT_INITIAL_MS;
        if (this.paused) connection.pause();
        await connection.closed;
      } catch (err) {
        if (err instanceof AuthError) {
          this.fail(err);
          break;
        }
        if (!this.stopping) this.options.logger.warn(`ruststream: connection to ${this.options.url} failed: ${describe(err)}; retrying`);
      } finally {
        this.connection = undefined;
      }
    }
  }

  private readonly feed: Feed = {
    deliver: (raw) => this.deliver(raw),
    shutdown: (reason) => {
      this.options.logger.info(`ruststream: the gateway ends this stream (${reason}): giving back the buffer, connecting again`);
      const connection = this.connection;
      this.connection = undefined;
      connection?.close();
      this.nakBuffered();
    },
    room: () => Math.max(0, this.options.maxInFlight - this.held.size),
  };

  private deliver(raw: WireMessage): void {
    this.stats.received++;
    const message = new Message(raw, this);
    const now = Date.now();
    const expiresAt = message.leaseExpiresAt.getTime();
    const held: Held = {
      message,
      state: "buffered",
      receivedAt: now,
      expiresAt,
      extendAt: now + (expiresAt - now) / 2,
      extending: false,
      gaveUp: false,
      key: this.keyOf(message),
      holdsKey: false,
      bytes: raw.data.length,
      settled: undefined,
      abandoned: false,
    };
    this.held.set(message.id, held);
    if (this.stopping && !this.closing) {
      // Arrived after the stream closed (a poll's answer): back at once.
      void this.settleHeld(held, "nak", 0);
      return;
    }
    this.buffer.push(held);
    this.bufferedBytes += held.bytes;
    this.pump();
    this.checkBytes();
  }

  private checkBytes(): void {
    const max = this.options.maxBytes;
    if (max === undefined) return;
    const over = this.bufferedBytes >= max;
    if (over !== this.paused) {
      this.paused = over;
      if (over) this.connection?.pause();
      else this.connection?.resume();
    }
  }

  // ---- handlers ----

  private pump(): void {
    while (this.running < this.options.concurrency && this.buffer.length > 0 && !this.stopping) {
      let index = 0;
      if (this.busyKeys.size > 0) {
        index = this.buffer.findIndex((held) => held.key === undefined || !this.busyKeys.has(held.key));
        if (index < 0) break;
      }
      const [held] = this.buffer.splice(index, 1);
      if (held === undefined) break;
      this.bufferedBytes -= held.bytes;
      if (Date.now() >= held.expiresAt - EXPIRY_MARGIN_MS) {
        this.dropExpired(held);
        continue;
      }
      this.start(held);
    }
    this.checkBytes();
  }

  private start(held: Held): void {
    held.state = "running";
    if (held.key !== undefined) {
      this.busyKeys.add(held.key);
      held.holdsKey = true;
    }
    if (this.running++ === 0) this.handlersIdle = deferred<void>();
    void this.runHandler(held);
  }

  private async runHandler(held: Held): Promise<void> {
    const message = held.message;
    let op: "ack" | "nak" | "term" = "ack";
    let delayMs: number | undefined;
    let reason: string | undefined;
    try {
      await (this.handler as Handler)(message);
    } catch (err) {
      if (err instanceof Nak) {
        op = "nak";
        delayMs = err.delayMs;
      } else if (err instanceof Term) {
        op = "term";
        reason = err.reason;
      } else {
        op = "nak";
        delayMs = backoffDelay(this.options, message.delivered);
        this.options.logger.warn(
          `ruststream: handler failed on ${message.stream}#${message.streamSequence} (delivery ${message.delivered}): ${describe(err)}; nak, redelivered in ${delayMs} ms`,
        );
      }
    }
    if (--this.running === 0) this.handlersIdle.resolve();
    if (!held.abandoned && held.settled === undefined) void this.settleHeld(held, op, delayMs, reason);
    this.pump();
  }

  // ---- settles ----

  /** MessageOwner: an explicit settle from the handler. */
  settle(message: Message, op: "ack" | "nak" | "term", delayMs?: number, reason?: string): Promise<void> {
    const held = this.held.get(message.id);
    if (held === undefined) {
      this.options.logger.warn(`ruststream: ${op} of ${message.stream}#${message.streamSequence} ignored: already settled or expired`);
      return Promise.resolve();
    }
    if (held.settled !== undefined) return held.settled;
    return this.settleHeld(held, op, delayMs, reason);
  }

  private settleHeld(held: Held, op: "ack" | "nak" | "term", delayMs?: number, reason?: string): Promise<void> {
    if (held.settled !== undefined) return held.settled;
    if (held.state === "buffered") this.unbuffer(held);
    held.state = "settling";
    const done = deferred<void>();
    held.settled = done.promise;
    const extra = op === "nak" ? { delay_ms: Math.max(0, Math.round(delayMs ?? 0)) } : op === "term" && reason !== undefined ? { reason } : {};
    this.settler.submit(op, extra, {
      id: held.message.id,
      answered: (result) => {
        const retry = this.settleAnswered(held, op, result);
        if (!retry) {
          this.finish(held);
          done.resolve();
        }
        return retry;
      },
    });
    return done.promise;
  }

  /** True when the settle should be sent again. */
  private settleAnswered(held: Held, op: "ack" | "nak" | "term", result: SettleResult): boolean {
    const { status } = result;
    if (status === 200 || status === 204) {
      const { message } = held;
      this.options.logger.debug(`ruststream: ${op} of ${message.stream}#${message.streamSequence} (delivery ${message.delivered}) confirmed (${status})`);
      if (op === "ack") this.stats.acked++;
      else if (op === "nak") this.stats.naked++;
      else this.stats.termed++;
      return false;
    }
    if (retryable(status) && Date.now() < held.expiresAt && !(this.fatal !== undefined)) return true;
    this.failure(held.message, op, result);
    return false;
  }

  private failure(message: Message, op: string, result: SettleResult): void {
    const { status } = result;
    const key = String(status);
    this.stats.settleFailures[key] = (this.stats.settleFailures[key] ?? 0) + 1;
    const what = `${op} of ${message.stream}#${message.streamSequence} (delivery ${message.delivered})`;
    const { logger } = this.options;
    if (status === 409) logger.info(`ruststream: ${what}: already settled otherwise (409)`);
    else if (status === 410) logger.warn(`ruststream: ${what}: the lease had expired or was superseded (410)`);
    else if (status === 401 || status === 403) this.fail(new AuthError(status, result.detail ?? ""));
    else if (status === UNREACHABLE || retryable(status)) logger.warn(`ruststream: ${what}: the gateway did not confirm it before the lease ended (${result.detail ?? status})`);
    else logger.error(`ruststream: ${what}: ${status} ${result.detail ?? ""}`);
  }

  private finish(held: Held): void {
    if (this.held.get(held.message.id) !== held) return;
    this.held.delete(held.message.id);
    if (held.holdsKey && held.key !== undefined) this.busyKeys.delete(held.key);
    this.connection?.wake();
    this.pump();
  }

  private unbuffer(held: Held): void {
    const index = this.buffer.indexOf(held);
    if (index >= 0) {
      this.buffer.splice(index, 1);
      this.bufferedBytes -= held.bytes;
    }
  }

  private dropExpired(held: Held): void {
    this.stats.expiredInBuffer++;
    this.options.logger.warn(
      `ruststream: ${held.message.stream}#${held.message.streamSequence} expired in the buffer before a handler was free; dropped (the gateway redelivers it)`,
    );
    this.unbuffer(held);
    this.held.delete(held.message.id);
    this.connection?.wake();
  }

  private nakBuffered(): void {
    const buffered = this.buffer;
    this.buffer = [];
    this.bufferedBytes = 0;
    for (const held of buffered) {
      held.state = "settling";
      void this.settleHeld(held, "nak", 0);
    }
    this.checkBytes();
  }

  // ---- leases ----

  /** MessageOwner: an explicit extension. */
  extend(message: Message): Promise<void> {
    const held = this.held.get(message.id);
    if (held === undefined || held.settled !== undefined) return Promise.resolve();
    return this.extendHeld(held);
  }

  private extendHeld(held: Held): Promise<void> {
    held.extending = true;
    const done = deferred<void>();
    this.settler.submit("in_progress", {}, {
      id: held.message.id,
      answered: (result) => {
        if (result.status === 200 && result.lease_expires_at !== undefined) {
          this.stats.extended++;
          const now = Date.now();
          held.expiresAt = Date.parse(result.lease_expires_at);
          held.message.leaseExpiresAt = new Date(held.expiresAt);
          held.extendAt = now + (held.expiresAt - now) / 2;
        } else if (retryable(result.status) && Date.now() < held.expiresAt && held.settled === undefined) {
          return true;
        } else if (held.settled === undefined) {
          this.failure(held.message, "in_progress", result);
          if (held.state === "buffered" && (result.status === 410 || result.status === 404)) this.dropExpired(held);
        }
        held.extending = false;
        done.resolve();
        return false;
      },
    });
    return done.promise;
  }

  /** Extend what is due; drop what expired in the buffer. */
  private keepLeases(): void {
    const now = Date.now();
    for (const held of this.held.values()) {
      if (held.state === "settling" || held.extending) continue;
      if (held.state === "buffered" && now >= held.expiresAt - EXPIRY_MARGIN_MS) {
        this.dropExpired(held);
        continue;
      }
      if (now < held.extendAt || held.gaveUp) continue;
      if (now - held.receivedAt >= this.options.maxLeaseMs) {
        held.gaveUp = true;
        this.options.logger.warn(
          `ruststream: ${held.message.stream}#${held.message.streamSequence} held for maxLeaseMs (${this.options.maxLeaseMs} ms): no longer extended; its lease ends at ${new Date(held.expiresAt).toISOString()}`,
        );
        continue;
      }
      void this.extendHeld(held);
    }
  }

  // ---- drain ----

  private fail(err: Error): void {
    if (this.fatal !== undefined) return;
    this.fatal = err;
    this.options.logger.error(`ruststream: stopping: ${err.message}`);
    void this.stop();
  }

  private async drain(): Promise<void> {
    const connection = this.connection;
    this.connection = undefined;
    this.wakeReconnect?.();
    if (connection !== undefined) {
      // What is already on its way is taken into the buffer until the connection ended, and
      // nak'd with it: a nak before would free credit for more.
      this.closing = true;
      connection.close();
      await Promise.race([connection.closed.catch(() => undefined), new Promise((ok) => setTimeout(ok, 2_000))]);
      this.closing = false;
    }
    this.nakBuffered();
    if (this.running > 0) {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const timeout = new Promise<void>((resolve) => (timer = setTimeout(resolve, this.options.drainTimeoutMs)));
      await Promise.race([this.handlersIdle.promise, timeout]);
      clearTimeout(timer);
    }
    for (const held of [...this.held.values()]) {
      if (held.state === "running" && held.settled === undefined) {
        held.abandoned = true;
        this.options.logger.warn(
          `ruststream: ${held.message.stream}#${held.message.streamSequence} still running after drainTimeoutMs (${this.options.drainTimeoutMs} ms): nak'd`,
        );
        void this.settleHeld(held, "nak", 0);
      }
    }
    this.settler.flush();
    await Promise.all([...this.held.values()].map((held) => held.settled));
  }
}

function retryable(status: number): boolean {
  return status === UNREACHABLE || status === 503 || status === 504 || status === 502;
}

function describe(err: unknown): string {
  if (err instanceof Error) {
    const cause = (err as { cause?: unknown }).cause;
    return cause instanceof Error ? `${err.message} (${cause.message})` : err.message;
  }
  return String(err);
}

