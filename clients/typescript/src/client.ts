// The producer side: publish a message through the gateway's `POST /publish`, with headers,
// a de-duplication id (Nats-Msg-Id) and an ordering key.

import { Api } from "./http.js";

export interface ClientOptions {
  /** The gateway's base URL. */
  url: string;
  /** Bearer token with the `publish` (or `admin`) scope. */
  token?: string | null;
}

export interface PublishOptions {
  /** NATS headers, a value or a list of values per name. */
  headers?: Record<string, string | string[]>;
  /** Sent as Nats-Msg-Id: the stream stores a message with the same id once within its duplicate window. */
  msgId?: string;
  /** Written as Ruststream-Ordering-Key (1 to 1024 bytes): a consumer ordered by `header` leases a key's messages one at a time, in order. */
  orderingKey?: string;
}

export interface PublishResult {
  stream: string;
  /** The message's stream sequence. */
  sequence: number;
  /** The stream already had a message with this msgId. */
  duplicate: boolean;
}

export class Client {
  private readonly api: Api;

  constructor(options: ClientOptions) {
    this.api = new Api(options.url, options.token);
  }

  /** Publish to a subject a served stream captures; resolves once the stream stored it. Throws HttpError (e.g. 412, 422, 503) or AuthError. */
  async publish(subject: string, data: string | Uint8Array, options: PublishOptions = {}): Promise<PublishResult> {
    const headers: Record<string, string | string[]> = { ...options.headers };
    if (options.msgId !== undefined) headers["Nats-Msg-Id"] = options.msgId;
    const body: Record<string, unknown> =
      typeof data === "string" ? { subject, data, encoding: "utf8" } : { subject, data: toBase64(data), encoding: "base64" };
    if (Object.keys(headers).length > 0) body["headers"] = headers;
    if (options.orderingKey !== undefined) body["ordering_key"] = options.orderingKey;
    return this.api.post<PublishResult>("/publish", body);
  }
}

export function toBase64(bytes: Uint8Array): string {
  const nodeBuffer = (globalThis as { Buffer?: { from(data: Uint8Array): { toString(encoding: string): string } } }).Buffer;
  if (nodeBuffer !== undefined) return nodeBuffer.from(bytes).toString("base64");
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}
