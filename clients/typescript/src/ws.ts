// transport "ws": leases over `GET /ws` within the credit maxInFlight, settles in band as
// operations of many ids (`{"op", "ids", "ref"}`) answered by `settled` frames. Node uses the
// `ws` package (Node 20 has no global WebSocket, and only it can send Authorization); a
// browser uses its own WebSocket with a stream ticket.

import { AuthError, HttpError } from "./errors.js";
import { Api, consumerPath } from "./http.js";
import { deferred, isNode, type Connection, type Feed, type InBandAnswer, type Transport } from "./transport.js";
import type { SettleExtra, SettleOp, SettleResult, WireMessage } from "./wire.js";

interface Frame {
  type: string;
  /** The leases of a `messages` frame (`frames=batch`). */
  messages?: WireMessage[];
  ref?: number;
  results?: SettleResult[];
  reason?: string;
  status?: number;
  detail?: string;
}

/** The few members both the `ws` package's socket and a browser WebSocket have. */
interface Socket {
  send(data: string): void;
  close(code?: number, reason?: string): void;
  readonly readyState: number;
}

export class WsTransport implements Transport {
  constructor(
    private readonly api: Api,
    private readonly stream: string | undefined,
    private readonly consumer: string | undefined,
    private readonly maxInFlight: number,
    /** Leases ready together in one frame (parsed once); false under maxBytes, where the
     * socket is paused between two frames so that no more than the bound is read ahead. */
    private readonly batchFrames: boolean,
    private readonly onError: (text: string) => void,
  ) {}

  async connect(feed: Feed): Promise<Connection> {
    const frames = this.batchFrames ? "batch" : "single";
    const query = `max_in_flight=${this.maxInFlight}&encoding=base64&frames=${frames}`;
    const wsBase = this.api.base.replace(/^http/, "ws");
    const connection = new WsConnection(feed, this.onError);
    if (isNode()) {
      const { WebSocket } = await import("ws");
      const url = `${wsBase}${consumerPath(this.stream, this.consumer, "ws")}?${query}`;
      const headers = this.api.headers();
      delete headers["content-type"];
      const socket = new WebSocket(url, { headers, perMessageDeflate: false });
      const opened = deferred<void>();
      socket.on("unexpected-response", (_request, response) => {
        const status = response.statusCode ?? 0;
        const chunks: Buffer[] = [];
        response.on("data", (chunk: Buffer) => chunks.push(chunk));
        response.on("end", () => {
          const text = Buffer.concat(chunks).toString();
          let detail = text;
          try {
            detail = (JSON.parse(text) as { detail?: string }).detail ?? text;
          } catch {
            // not a problem+json body: the text as it is
          }
          opened.reject(status === 401 || status === 403 ? new AuthError(status, detail) : new HttpError(status, detail));
          socket.terminate();
        });
        response.on("close", () => opened.reject(status === 401 || status === 403 ? new AuthError(status, "") : new HttpError(status, "")));
      });
      socket.on("open", () => opened.resolve());
      socket.on("error", (err) => opened.reject(err));
      socket.on("message", (data) => connection.frame(data.toString()));
      socket.on("close", () => connection.ended());
      connection.attach(socket, () => socket.pause(), () => socket.resume());
      await opened.promise;
      socket.on("error", () => undefined);
    } else {
      // A browser cannot set Authorization on a WebSocket: a single-use ticket instead.
      let path = `${consumerPath(this.stream, this.consumer, "ws")}?${query}`;
      if (this.api.hasToken()) {
        const ticket = await this.api.ticket(this.stream, this.consumer);
        path = `${ticket.ws}&${query}`;
      }
      const socket = new WebSocket(wsBase + path);
      const opened = deferred<void>();
      socket.onopen = () => opened.resolve();
      socket.onerror = () => opened.reject(new Error(`WebSocket to ${wsBase} failed`));
      socket.onmessage = (event: MessageEvent) => connection.frame(String(event.data));
      socket.onclose = () => {
        opened.reject(new Error("WebSocket closed before it opened"));
        connection.ended();
      };
      // A browser WebSocket cannot be paused: maxBytes is kept by the credit alone there.
      connection.attach(socket, () => undefined, () => undefined);
      await opened.promise;
    }
    return connection;
  }
}

class WsConnection implements Connection {
  private socket: Socket | undefined;
  private pauseSocket: () => void = () => undefined;
  private resumeSocket: () => void = () => undefined;
  private readonly ops = new Map<number, InBandAnswer>();
  private nextRef = 1;
  private readonly end = deferred<void>();
  readonly closed = this.end.promise;
  private open = true;

  constructor(
    private readonly feed: Feed,
    private readonly onError: (text: string) => void,
  ) {}

  attach(socket: Socket, pause: () => void, resume: () => void): void {
    this.socket = socket;
    this.pauseSocket = pause;
    this.resumeSocket = resume;
  }

  frame(text: string): void {
    const frame = JSON.parse(text) as Frame;
    switch (frame.type) {
      case "messages":
        for (const message of frame.messages ?? []) this.feed.deliver(message);
        break;
      case "message": // a frame a lease: the framing asked for under maxBytes
        this.feed.deliver(frame as unknown as WireMessage);
        break;
      case "settled": {
        const op = frame.ref === undefined ? undefined : this.ops.get(frame.ref);
        if (op !== undefined && frame.ref !== undefined) {
          this.ops.delete(frame.ref);
          // At once, not on a later tick: the socket may hand over the next frame (a lease
          // this settle made room for) in the same turn.
          op.answered(frame.results ?? []);
        }
        break;
      }
      case "shutdown":
        this.feed.shutdown(frame.reason ?? "shutdown");
        break;
      case "error":
        this.onError(`the gateway refused a frame: ${frame.status ?? "?"} ${frame.detail ?? ""}`);
        break;
      default:
        break;
    }
  }

  ended(): void {
    this.open = false;
    this.loseAnswers();
    this.end.resolve();
  }

  sendInBand(op: SettleOp, ids: string[], extra: SettleExtra, answer: InBandAnswer): boolean {
    if (!this.open || this.socket === undefined || this.socket.readyState !== 1) return false;
    const ref = this.nextRef++;
    this.ops.set(ref, answer);
    this.socket.send(JSON.stringify({ op, ids, ref, ...extra }));
    return true;
  }

  /** The settles sent and never answered: over HTTP instead. */
  private loseAnswers(): void {
    const lost = [...this.ops.values()];
    this.ops.clear();
    for (const op of lost) op.lost();
  }

  pause(): void {
    this.pauseSocket();
  }

  resume(): void {
    this.resumeSocket();
  }

  wake(): void {
    // The gateway frees credit itself when a lease ends.
  }

  close(): void {
    if (!this.open) return;
    this.open = false;
    this.loseAnswers();
    this.socket?.close(1000, "worker stopping");
  }
}
