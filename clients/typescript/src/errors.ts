// The errors a handler throws to choose how its message is settled (`Nak`, `Term`), and the
// errors the library itself raises to its caller (`AuthError`, `HttpError`).

/** Thrown by a handler: the message is nak'd (redelivered after `delayMs`, default 0). */
export class Nak extends Error {
  readonly delayMs: number;
  constructor(delayMs = 0, message?: string) {
    super(message ?? `nak (redeliver after ${delayMs} ms)`);
    this.name = "Nak";
    this.delayMs = delayMs;
  }
}

/** Thrown by a handler: the message is terminated (never redelivered; dead-lettered where the consumer dead-letters), with `reason`. */
export class Term extends Error {
  readonly reason: string | undefined;
  constructor(reason?: string) {
    super(reason === undefined ? "term" : `term: ${reason}`);
    this.name = "Term";
    this.reason = reason;
  }
}

/** The gateway refused the token (401) or its scope (403): the worker stops with this error. */
export class AuthError extends Error {
  readonly status: number;
  constructor(status: number, detail: string) {
    super(
      status === 401
        ? `the gateway refused the token (401 Unauthorized): ${detail}`
        : `the token lacks a scope this worker needs (403 Forbidden): ${detail}`,
    );
    this.name = "AuthError";
    this.status = status;
  }
}

/** An HTTP answer the library did not expect, with the gateway's problem detail. */
export class HttpError extends Error {
  readonly status: number;
  readonly retryAfterMs: number | undefined;
  constructor(status: number, detail: string, retryAfterMs?: number) {
    super(`HTTP ${status}: ${detail}`);
    this.name = "HttpError";
    this.status = status;
    this.retryAfterMs = retryAfterMs;
  }
}
