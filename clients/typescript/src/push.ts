// The push receiver's side (docs/push.md): verify a push's Standard Webhooks signature
// (HMAC-SHA256 over "id.timestamp.body", constant-time compare, 5 min tolerance, several
// secrets for rotation), read the pushed message(s) with their lease ids, and answer with a
// Ruststream-Settle header value. Verifying needs Node (node:crypto, fetched when first used,
// never imported: the package's main entry, which exports this too, stays bundleable for
// browsers — where verifying has no place, as it needs the secret).

import { decodeData, type WireMessage } from "./wire.js";

type NodeCrypto = typeof import("node:crypto");

/** node:crypto from Node's own modules (Node 20.16 or later), without an import a browser bundler would have to resolve. */
function nodeCrypto(): NodeCrypto {
  const process = (globalThis as { process?: { getBuiltinModule?: (id: string) => unknown } }).process;
  const crypto = process?.getBuiltinModule?.("node:crypto") as NodeCrypto | undefined;
  if (crypto === undefined) throw new Error("verifyPush needs Node 20.16 or later (node:crypto through process.getBuiltinModule)");
  return crypto;
}

/** The answer header the gateway reads. */
export const SETTLE_HEADER = "Ruststream-Settle";
/** How far a push's timestamp may be from now. */
export const TOLERANCE_MS = 5 * 60 * 1000;

/** Values for the Ruststream-Settle header of a push's answer. */
export const PushAnswer = {
  /** Acked (as any 2xx without the header). */
  ack: "ack",
  /** Left leased: settle it later through the usual routes (lease id) before it expires. */
  later: "later",
  /** Redelivered after delayMs (whole milliseconds, at most a week); without it, at once. */
  nak(delayMs?: number): string {
    if (delayMs === undefined) return "nak";
    if (!Number.isInteger(delayMs) || delayMs < 0 || delayMs > 604_800_000) throw new RangeError(`delayMs must be an integer in 0..604800000, got ${delayMs}`);
    return `nak; delay=${delayMs}`;
  },
  /** Never redelivered (dead-lettered where the consumer dead-letters), with reason. */
  term(reason?: string): string {
    if (reason === undefined) return "term";
    return `term; reason=${reason.replace(/[\x00-\x1f\x7f]/g, " ").slice(0, 1024)}`;
  },
} as const;

export class PushVerificationError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "PushVerificationError";
  }
}

/** A pushed message: the lease id settles it later (with PushAnswer.later) through the usual routes. */
export interface PushedMessage {
  /** The lease id. */
  id: string;
  subject: string;
  data: Uint8Array;
  text(): string;
  json<T = unknown>(): T;
  headers: Record<string, string[]>;
  stream: string;
  streamSequence: number;
  delivered: number;
  leaseExpiresAt: Date | undefined;
}

type HeaderSource = Headers | Record<string, string | string[] | undefined>;

function header(headers: HeaderSource, name: string): string | undefined {
  if (typeof (headers as Headers).get === "function") return (headers as Headers).get(name) ?? undefined;
  for (const [key, value] of Object.entries(headers as Record<string, string | string[] | undefined>)) {
    if (key.toLowerCase() === name) return Array.isArray(value) ? value.join(" ") : value;
  }
  return undefined;
}

function secretKey(secret: string): Buffer {
  return Buffer.from(secret.startsWith("whsec_") ? secret.slice("whsec_".length) : secret, "base64");
}

/**
 * Check a push's signature against any of `secrets` and return its message(s). Throws
 * PushVerificationError when the headers are missing, the timestamp is more than 5 minutes
 * off, or no signature matches.
 */
export function verifyPush(secrets: string | string[], headers: HeaderSource, body: string | Uint8Array, now = Date.now()): PushedMessage[] {
  const id = header(headers, "webhook-id");
  const timestamp = header(headers, "webhook-timestamp");
  const signatures = header(headers, "webhook-signature");
  if (id === undefined || timestamp === undefined || signatures === undefined) {
    throw new PushVerificationError("missing webhook-id, webhook-timestamp or webhook-signature");
  }
  const seconds = Number(timestamp);
  if (!/^\d+$/.test(timestamp) || Math.abs(now - seconds * 1000) > TOLERANCE_MS) {
    throw new PushVerificationError(`webhook-timestamp ${timestamp} is not within 5 minutes of now`);
  }
  const bytes = typeof body === "string" ? Buffer.from(body) : Buffer.from(body.buffer, body.byteOffset, body.byteLength);
  const signed = Buffer.concat([Buffer.from(`${id}.${timestamp}.`), bytes]);
  const offered = signatures
    .split(" ")
    .filter((entry) => entry.startsWith("v1,"))
    .map((entry) => Buffer.from(entry.slice(3), "base64"));
  const { createHmac, timingSafeEqual } = nodeCrypto();
  let matched = false;
  for (const secret of Array.isArray(secrets) ? secrets : [secrets]) {
    const expected = createHmac("sha256", secretKey(secret)).update(signed).digest();
    for (const signature of offered) {
      // Every comparison runs: no early exit that would time which secret matched.
      if (signature.length === expected.length && timingSafeEqual(signature, expected)) matched = true;
    }
  }
  if (!matched) throw new PushVerificationError("no webhook-signature matches any of the secrets");
  return readPush(headers, bytes);
}

/** The message(s) of a push: a JSON body (`format = "json"`), or the raw payload with Ruststream-* headers (binary, cloudevents). */
export function readPush(headers: HeaderSource, body: Uint8Array): PushedMessage[] {
  const type = header(headers, "content-type") ?? "";
  if (type.startsWith("application/json") && header(headers, "ruststream-subject") === undefined) {
    const parsed = JSON.parse(Buffer.from(body).toString("utf8")) as WireMessage | { messages: WireMessage[] };
    const messages = "messages" in parsed ? parsed.messages : [parsed];
    return messages.map(fromWire);
  }
  const data = new Uint8Array(body);
  return [
    {
      id: header(headers, "ruststream-lease-id") ?? "",
      subject: header(headers, "ruststream-subject") ?? "",
      data,
      text: () => new TextDecoder().decode(data),
      json: <T>() => JSON.parse(new TextDecoder().decode(data)) as T,
      headers: {},
      stream: header(headers, "ruststream-stream") ?? "",
      streamSequence: Number(header(headers, "ruststream-stream-sequence") ?? 0),
      delivered: Number(header(headers, "ruststream-delivered") ?? 1),
      leaseExpiresAt: undefined,
    },
  ];
}

function fromWire(raw: WireMessage): PushedMessage {
  const data = decodeData(raw);
  const text = (): string => (raw.encoding === "utf8" ? raw.data : new TextDecoder().decode(data));
  return {
    id: raw.id,
    subject: raw.subject,
    data,
    text,
    json: <T>() => JSON.parse(text()) as T,
    headers: raw.headers,
    stream: raw.stream,
    streamSequence: raw.stream_sequence,
    delivered: raw.delivered,
    leaseExpiresAt: new Date(raw.lease_expires_at),
  };
}
