// Settles and extensions on their way to the gateway: those of concurrent handlers are
// coalesced into operations of many ids (flushed within 5 ms, at once when a burst is over),
// sent in band while the stream's connection carries them and over HTTP otherwise, and an
// id whose answer is a retryable failure is sent again while its lease lives.

import { AuthError, HttpError } from "./errors.js";
import type { Api } from "./http.js";
import type { Connection } from "./transport.js";
import type { SettleExtra, SettleOp, SettleResult } from "./wire.js";

/** The longest a settle waits for others to share its operation. */
export const COALESCE_MS = 5;
/** Ids per operation, the gateway's limit. */
const MAX_IDS = 1000;
/** A burst this large goes out without waiting. */
const FLUSH_AT = 64;

/** One id waiting for its answer. */
export interface Item {
  id: string;
  /** Called with the id's answer; returns true when it should be sent again (after a pause). */
  answered(result: SettleResult): boolean;
}

interface Group {
  op: SettleOp;
  extra: SettleExtra;
  items: Item[];
}

/**
 * Run `callback` once the events of this turn were handled, returning its cancel: Node's
 * setImmediate (after the I/O callbacks of this loop pass, so the settles of handlers that
 * ended together share one operation); a browser has none, and there a zero-delay timer (the
 * next task) does the same.
 */
export function afterThisTurn(callback: () => void): () => void {
  if (typeof setImmediate === "function") {
    const immediate = setImmediate(callback);
    return () => clearImmediate(immediate);
  }
  const timer = setTimeout(callback, 0);
  return () => clearTimeout(timer);
}

/** Status given to an id whose request never got an answer (gateway unreachable, connection lost). */
export const UNREACHABLE = 0;

export class Settler {
  private readonly groups = new Map<string, Group>();
  private pending = 0;
  private timer: ReturnType<typeof setTimeout> | undefined;
  /** Cancels the flush flushSoon() scheduled, while it has not run. */
  private cancelSoon: (() => void) | undefined;
  /** Operations sent and not yet answered. */
  private inFlight = 0;

  constructor(
    private readonly api: Api,
    private readonly connection: () => Connection | undefined,
    /** True when nothing else will be settled soon (no handler running): flush at once. */
    private readonly idle: () => boolean,
  ) {}

  submit(op: SettleOp, extra: SettleExtra, item: Item): void {
    const key = `${op}|${extra.delay_ms ?? ""}|${extra.reason ?? ""}`;
    let group = this.groups.get(key);
    if (group === undefined) {
      group = { op, extra, items: [] };
      this.groups.set(key, group);
    }
    group.items.push(item);
    this.pending++;
    if (this.pending >= FLUSH_AT || this.idle()) {
      this.flushSoon();
    } else if (this.timer === undefined) {
      this.timer = setTimeout(() => this.flush(), COALESCE_MS);
    }
  }

  /** After the current burst of events (the settles of handlers that ended together). */
  flushSoon(): void {
    if (this.cancelSoon === undefined) this.cancelSoon = afterThisTurn(() => this.flush());
  }

  flush(): void {
    if (this.timer !== undefined) clearTimeout(this.timer);
    this.cancelSoon?.();
    this.timer = undefined;
    this.cancelSoon = undefined;
    const groups = [...this.groups.values()];
    this.groups.clear();
    this.pending = 0;
    for (const group of groups) {
      for (let start = 0; start < group.items.length; start += MAX_IDS) {
        this.send(group.op, group.extra, group.items.slice(start, start + MAX_IDS));
      }
    }
  }

  /** Operations sent and not yet answered, and ids waiting to be sent. */
  busy(): boolean {
    return this.inFlight > 0 || this.pending > 0;
  }

  private send(op: SettleOp, extra: SettleExtra, items: Item[]): void {
    const ids = items.map((item) => item.id);
    this.inFlight++;
    const answer = (results: SettleResult[]): void => {
      this.inFlight--;
      this.answered(op, extra, items, results);
    };
    const overHttp = (): void => {
      this.api.settle(op, ids, extra).then(answer, (err: unknown) => {
        const status = err instanceof AuthError || err instanceof HttpError ? err.status : UNREACHABLE;
        const detail = err instanceof Error ? err.message : String(err);
        answer(ids.map((id) => ({ id, status, detail })));
      });
    };
    // In band while the stream's connection is open; over HTTP otherwise, or when it ends
    // before answering (a settle repeated answers as the first did, so that is safe).
    const inBand = this.connection()?.sendInBand?.(op, ids, extra, { answered: answer, lost: overHttp }) ?? false;
    if (!inBand) overHttp();
  }

  /** Each id's answer to its item; those to send again go out after a short pause. */
  private answered(op: SettleOp, extra: SettleExtra, items: Item[], results: SettleResult[]): void {
    const byId = new Map(results.map((result) => [result.id, result]));
    const again: Item[] = [];
    for (const item of items) {
      const result = byId.get(item.id) ?? { id: item.id, status: UNREACHABLE, detail: "no answer for this id" };
      if (item.answered(result)) again.push(item);
    }
    if (again.length > 0) {
      // A retryable failure (503, 504, unreachable): a short pause, then once more.
      const pause = 200 + Math.random() * 300;
      setTimeout(() => {
        for (const item of again) this.submit(op, extra, item);
        this.flushSoon();
      }, pause);
    }
  }
}
