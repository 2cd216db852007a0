// transports "sse" (leases over `GET /events` within the credit maxInFlight, read with fetch()
// so that Authorization can be sent and reading can pause) and "fetch" (long polls of
// `POST /fetch` for what room there is). Both settle over HTTP: they have no sendInBand.

import { AuthError, HttpError } from "./errors.js";
import { Api, consumerPath, problemDetail } from "./http.js";
import { deferred, type Connection, type Deferred, type Feed, type Transport } from "./transport.js";
import type { WireMessage } from "./wire.js";

export class SseTransport implements Transport {
  constructor(
    private readonly api: Api,
    private readonly stream: string | undefined,
    private readonly consumer: string | undefined,
    private readonly maxInFlight: number,
  ) {}

  async connect(feed: Feed): Promise<Connection> {
    const abort = new AbortController();
    const url = `${this.api.base}${consumerPath(this.stream, this.consumer, "events")}?max_in_flight=${this.maxInFlight}&encoding=base64`;
    const headers = this.api.headers({ accept: "text/event-stream" });
    delete headers["content-type"];
    const response = await fetch(url, { headers, signal: abort.signal });
    if (response.status === 401 || response.status === 403) throw new AuthError(response.status, await problemDetail(response));
    if (!response.ok || response.body === null) throw new HttpError(response.status, await problemDetail(response));
    const connection = new SseConnection(abort);
    connection.read(response.body, feed);
    return connection;
  }
}

class SseConnection implements Connection {
  private readonly end = deferred<void>();
  readonly closed = this.end.promise;
  private resumed: Deferred<void> | undefined;

  constructor(private readonly abort: AbortController) {}

  read(body: ReadableStream<Uint8Array>, feed: Feed): void {
    void this.loop(body, feed).finally(() => this.end.resolve());
  }

  private async loop(body: ReadableStream<Uint8Array>, feed: Feed): Promise<void> {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let text = "";
    let event = "message";
    let data: string[] = [];
    try {
      for (;;) {
        if (this.resumed !== undefined) await this.resumed.promise;
        const { value, done } = await reader.read();
        if (done) return;
        this.heard();
        text += decoder.decode(value, { stream: true });
        let newline: number;
        while ((newline = text.indexOf("\n")) >= 0) {
          let line = text.slice(0, newline);
          text = text.slice(newline + 1);
          if (line.endsWith("\r")) line = line.slice(0, -1);
          if (line === "") {
            if (data.length > 0) {
              const payload = data.join("\n");
              if (event === "message") feed.deliver(JSON.parse(payload) as WireMessage);
              else if (event === "shutdown") feed.shutdown((JSON.parse(payload) as { reason?: string }).reason ?? "shutdown");
            }
            event = "message";
            data = [];
          } else if (line.startsWith("data:")) {
            data.push(line.slice(line.startsWith("data: ") ? 6 : 5));
          } else if (line.startsWith("event:")) {
            event = line.slice(6).trim();
          }
          // `id:` (the lease id, also in the data) and `: keep-alive` comments need nothing.
        }
      }
    } catch {
      // Aborted by close(), or the connection broke: the worker reconnects.
    } finally {
      reader.releaseLock();
    }
  }

  pause(): void {
    if (this.resumed === undefined) this.resumed = deferred<void>();
  }

  resume(): void {
    this.resumed?.resolve();
    this.resumed = undefined;
  }

  wake(): void {
    // The gateway frees credit itself when a lease ends.
  }

  /**
   * The gateway counts a lease from the moment it wrote the event, so what is already on its
   * way is read before the response ends (the worker holds it and naks it after the close):
   * the stream ends after QUIET_MS without data, at most CLOSE_MAX_MS after close().
   */
  close(): void {
    if (this.closing) return;
    this.closing = true;
    this.resume();
    this.heard();
    setTimeout(() => this.abort.abort(), CLOSE_MAX_MS);
  }

  private closing = false;
  private quiet: ReturnType<typeof setTimeout> | undefined;

  /** Data came: while closing, the quiet period starts again. */
  private heard(): void {
    if (!this.closing) return;
    if (this.quiet !== undefined) clearTimeout(this.quiet);
    this.quiet = setTimeout(() => this.abort.abort(), QUIET_MS);
  }
}

const QUIET_MS = 100;
const CLOSE_MAX_MS = 1_000;

/** How long one poll waits at the gateway for a first message. */
const POLL_WAIT_MS = 5_000;

export class FetchTransport implements Transport {
  constructor(
    private readonly api: Api,
    private readonly stream: string | undefined,
    private readonly consumer: string | undefined,
  ) {}

  async connect(feed: Feed): Promise<Connection> {
    const path = consumerPath(this.stream, this.consumer, "fetch");
    const connection = new PollConnection();
    // The first poll proves the gateway answers (and the token is good) before the worker counts it connected.
    const first = await connection.poll(this.api, path, feed, 0);
    connection.start(this.api, path, feed, first);
    return connection;
  }
}

class PollConnection implements Connection {
  private readonly end = deferred<void>();
  readonly closed = this.end.promise;
  private readonly abort = new AbortController();
  private paused = false;
  private open = true;
  private waiting: Deferred<void> | undefined;

  async poll(api: Api, path: string, feed: Feed, waitMs: number): Promise<WireMessage[]> {
    const batch = Math.min(1000, Math.max(1, feed.room()));
    return api.fetch(path, batch, waitMs, this.abort.signal);
  }

  start(api: Api, path: string, feed: Feed, first: WireMessage[]): void {
    for (const message of first) feed.deliver(message);
    void this.loop(api, path, feed).then(
      () => this.end.resolve(),
      (err: unknown) => (err instanceof AuthError ? this.end.reject(err) : this.end.resolve()),
    );
  }

  private async loop(api: Api, path: string, feed: Feed): Promise<void> {
    while (this.open) {
      if (this.paused || feed.room() === 0) {
        this.waiting = deferred<void>();
        await this.waiting.promise;
        continue;
      }
      let messages: WireMessage[];
      try {
        messages = await this.poll(api, path, feed, POLL_WAIT_MS);
      } catch (err) {
        if (!this.open) return;
        if (err instanceof HttpError && err.status === 429) {
          // max_ack_pending is full: wait for the earliest slot.
          await new Promise((resolve) => setTimeout(resolve, err.retryAfterMs ?? 1000));
          continue;
        }
        throw err;
      }
      if (!this.open) {
        // Closed while the poll was under way: the worker gives these back.
        for (const message of messages) feed.deliver(message);
        return;
      }
      for (const message of messages) feed.deliver(message);
    }
  }

  pause(): void {
    this.paused = true;
  }

  resume(): void {
    this.paused = false;
    this.wake();
  }

  wake(): void {
    this.waiting?.resolve();
    this.waiting = undefined;
  }

  close(): void {
    this.open = false;
    this.abort.abort();
    this.wake();
  }
}

