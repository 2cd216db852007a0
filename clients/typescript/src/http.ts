// The gateway's HTTP routes this library calls (docs/api.md): batch settles, one extension,
// fetch long polls, stream tickets, publish. One place that adds the token and turns error
// answers into HttpError / AuthError.

import { AuthError, HttpError } from "./errors.js";
import type { SettleExtra, SettleOp, SettleResult, WireMessage } from "./wire.js";

export class Api {
  readonly base: string;
  private readonly token: string | undefined;

  constructor(url: string, token?: string | null) {
    this.base = url.replace(/\/+$/, "");
    this.token = token ?? undefined;
  }

  hasToken(): boolean {
    return this.token !== undefined;
  }

  headers(extra?: Record<string, string>): Record<string, string> {
    const headers: Record<string, string> = { "content-type": "application/json", ...extra };
    if (this.token !== undefined) headers["authorization"] = `Bearer ${this.token}`;
    return headers;
  }

  /** POST a JSON body; the parsed answer (undefined for 204). Throws AuthError on 401/403, HttpError on any other non-2xx. */
  async post<T>(path: string, body: unknown, signal?: AbortSignal, extraHeaders?: Record<string, string>): Promise<T> {
    const init: RequestInit = { method: "POST", headers: this.headers(extraHeaders), body: JSON.stringify(body ?? {}) };
    if (signal !== undefined) init.signal = signal;
    const response = await fetch(this.base + path, init);
    return answer<T>(response);
  }

  async get<T>(path: string): Promise<T> {
    const response = await fetch(this.base + path, { headers: this.headers() });
    return answer<T>(response);
  }

  /** Settle many ids in one request (ack, nak, term); in_progress has no batch route, so it goes id by id. */
  async settle(op: SettleOp, ids: string[], extra: SettleExtra): Promise<SettleResult[]> {
    if (op === "in_progress") {
      return Promise.all(ids.map((id) => this.extendOne(id)));
    }
    const answer = await this.post<{ results: SettleResult[] }>(`/messages/${op}`, { ids, ...extra });
    return answer.results;
  }

  private async extendOne(id: string): Promise<SettleResult> {
    try {
      const answer = await this.post<{ lease_expires_at: string }>(`/messages/${encodeURIComponent(id)}/in-progress`, {});
      return { id, status: 200, lease_expires_at: answer.lease_expires_at };
    } catch (err) {
      if (err instanceof HttpError) return { id, status: err.status, detail: err.message };
      throw err;
    }
  }

  /** One long poll. */
  async fetch(path: string, batch: number, waitMs: number, signal: AbortSignal): Promise<WireMessage[]> {
    const answer = await this.post<{ messages: WireMessage[] }>(path, { batch, wait_ms: waitMs, encoding: "base64" }, signal);
    return answer.messages;
  }

  /** A single-use stream ticket (browsers, which cannot set Authorization on a WebSocket). */
  async ticket(stream?: string, consumer?: string): Promise<{ ws: string; events: string }> {
    const body = stream !== undefined && consumer !== undefined ? { stream, consumer } : {};
    return this.post<{ ws: string; events: string }>("/stream-tickets", body);
  }
}

/** The problem detail of an error answer, for messages. */
export async function problemDetail(response: Response): Promise<string> {
  try {
    const text = await response.text();
    try {
      const problem = JSON.parse(text) as { detail?: string; title?: string };
      return problem.detail ?? problem.title ?? text;
    } catch {
      return text || response.statusText;
    }
  } catch {
    return response.statusText;
  }
}

export function retryAfterMs(response: Response): number | undefined {
  const value = response.headers.get("retry-after");
  if (value === null) return undefined;
  const seconds = Number(value);
  if (Number.isFinite(seconds)) return Math.max(0, seconds * 1000);
  const at = Date.parse(value);
  return Number.isNaN(at) ? undefined : Math.max(0, at - Date.now());
}

async function answer<T>(response: Response): Promise<T> {
  if (response.status === 401 || response.status === 403) {
    throw new AuthError(response.status, await problemDetail(response));
  }
  if (!response.ok) {
    throw new HttpError(response.status, await problemDetail(response), retryAfterMs(response));
  }
  if (response.status === 204) {
    await response.body?.cancel();
    return undefined as T;
  }
  return (await response.json()) as T;
}

/** The route of a consumer's stream or fetch: the default consumer's without stream/consumer. */
export function consumerPath(stream: string | undefined, consumer: string | undefined, route: "ws" | "events" | "fetch"): string {
  if (stream === undefined && consumer === undefined) return `/${route}`;
  if (stream === undefined || consumer === undefined) {
    throw new TypeError("give both stream and consumer, or neither (the gateway's default consumer)");
  }
  return `/streams/${encodeURIComponent(stream)}/consumers/${encodeURIComponent(consumer)}/${route}`;
}
