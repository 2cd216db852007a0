// A leased message as a handler sees it: its fields, its payload, and the explicit settles
// (ack, nak, term, extend) that go through the worker so that its bookkeeping stays exact.

import { decodeData, type WireMessage } from "./wire.js";

/** What a Message asks of the worker that received it. */
export interface MessageOwner {
  settle(message: Message, op: "ack" | "nak" | "term", delayMs?: number, reason?: string): Promise<void>;
  extend(message: Message): Promise<void>;
}

const utf8 = new TextDecoder();

export class Message {
  /** The lease id: opaque, settles this delivery at any gateway replica. */
  readonly id: string;
  readonly subject: string;
  readonly headers: Readonly<Record<string, string[]>>;
  readonly stream: string;
  readonly consumer: string;
  readonly streamSequence: number;
  /** 1 on the first delivery, +1 on each redelivery. */
  readonly delivered: number;
  readonly publishedAt: Date;
  /** When the lease ends unless extended (the worker extends it while the handler runs). */
  leaseExpiresAt: Date;
  private readonly raw: WireMessage;
  private bytes: Uint8Array | undefined;
  /** @internal */
  readonly owner: MessageOwner;

  /** @internal */
  constructor(raw: WireMessage, owner: MessageOwner) {
    this.raw = raw;
    this.owner = owner;
    this.id = raw.id;
    this.subject = raw.subject;
    this.headers = raw.headers;
    this.stream = raw.stream;
    this.consumer = raw.consumer;
    this.streamSequence = raw.stream_sequence;
    this.delivered = raw.delivered;
    this.publishedAt = new Date(raw.published_at);
    this.leaseExpiresAt = new Date(raw.lease_expires_at);
  }

  /** The payload's exact bytes. */
  get data(): Uint8Array {
    if (this.bytes === undefined) this.bytes = decodeData(this.raw);
    return this.bytes;
  }

  /** The payload as UTF-8 text. */
  text(): string {
    return this.raw.encoding === "utf8" ? this.raw.data : utf8.decode(this.data);
  }

  /** The payload parsed as JSON. */
  json<T = unknown>(): T {
    return JSON.parse(this.text()) as T;
  }

  /** The first value of a header (names compared case-insensitively), or undefined. */
  header(name: string): string | undefined {
    const wanted = name.toLowerCase();
    for (const [key, values] of Object.entries(this.raw.headers)) {
      if (key.toLowerCase() === wanted) return values[0];
    }
    return undefined;
  }

  /** Ack now (confirmed by the server when the promise resolves); the handler's return then settles nothing more. */
  ack(): Promise<void> {
    return this.owner.settle(this, "ack");
  }

  /** Nak now: redelivered after `delayMs` (default 0). */
  nak(delayMs = 0): Promise<void> {
    return this.owner.settle(this, "nak", delayMs);
  }

  /** Terminate now: never redelivered; `reason` goes to the server's advisory and the dead letter. */
  term(reason?: string): Promise<void> {
    return this.owner.settle(this, "term", undefined, reason);
  }

  /** Extend the lease now (the worker also does so on its own at half the lease). */
  extend(): Promise<void> {
    return this.owner.extend(this);
  }
}
