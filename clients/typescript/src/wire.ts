// The gateway's JSON shapes as this library reads them (docs/api.md): a leased message and the
// result of one id in a settle, plus the base64 decoding shared by Node and browsers.

/** A leased message as `POST /fetch`, `GET /events` and `GET /ws` send it (base64 encoding). */
export interface WireMessage {
  id: string;
  subject: string;
  data: string;
  encoding: "base64" | "utf8";
  headers: Record<string, string[]>;
  stream: string;
  consumer: string;
  stream_sequence: number;
  consumer_sequence: number;
  delivered: number;
  pending: number;
  published_at: string;
  lease_expires_at: string;
}

/** One id's answer in a batch settle or an in-band `settled` frame. */
export interface SettleResult {
  id: string;
  status: number;
  detail?: string;
  lease_expires_at?: string;
}

export type SettleOp = "ack" | "nak" | "term" | "in_progress";

/** Extra fields of an operation: `delay_ms` of a nak, `reason` of a term. */
export interface SettleExtra {
  delay_ms?: number;
  reason?: string;
}

const utf8 = new TextEncoder();

/** The payload's bytes: Node's Buffer where there is one (fast), else atob. */
export function decodeData(message: WireMessage): Uint8Array {
  if (message.encoding === "utf8") return utf8.encode(message.data);
  const nodeBuffer = (globalThis as { Buffer?: { from(text: string, encoding: string): Uint8Array } }).Buffer;
  if (nodeBuffer !== undefined) return nodeBuffer.from(message.data, "base64");
  const binary = atob(message.data);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}
