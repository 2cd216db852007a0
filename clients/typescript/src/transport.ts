// The seam between the worker's loop and the three ways leases arrive (WebSocket, SSE, long
// polls): a transport opens a connection that feeds leases in and may carry settles in band.

import type { SettleExtra, SettleOp, SettleResult, WireMessage } from "./wire.js";

/** What a connection tells the worker. */
export interface Feed {
  /** A lease arrived. */
  deliver(message: WireMessage): void;
  /** The gateway announced the end of this stream (it is stopping, or the stream was ended). */
  shutdown(reason: string): void;
  /** Lease slots free now (maxInFlight less the leases held): how many a poll may ask for. */
  room(): number;
}

/** One open stream of leases. */
export interface Connection {
  /** Resolves when the connection ended (either side); rejects with AuthError on 401/403. */
  readonly closed: Promise<void>;
  /**
   * Send a settle in band; false when the connection is not open. `answer` is called with the
   * results as their frame is read, before any frame after it (a lease the settle made room
   * for is not counted while the settled one still is), `lost` when the connection ends
   * before the answer (the caller retries over HTTP). Absent: settles go over HTTP.
   */
  sendInBand?(op: SettleOp, ids: string[], extra: SettleExtra, answer: InBandAnswer): boolean;
  /** Stop taking leases for now (the local buffer is over maxBytes); resume() undoes it. */
  pause(): void;
  resume(): void;
  /** Room grew (a lease ended): a poller may ask for more. */
  wake(): void;
  /** Take nothing more: the credit is withdrawn. */
  close(): void;
}

/** Where an in-band settle's answer goes. */
export interface InBandAnswer {
  answered(results: SettleResult[]): void;
  lost(): void;
}

export interface Transport {
  /** Open a connection; rejects with AuthError on 401/403, with another error when the gateway cannot be reached. */
  connect(feed: Feed): Promise<Connection>;
}

/** A promise with its resolve/reject at hand. */
export interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
  reject(reason: unknown): void;
}

export function deferred<T>(): Deferred<T> {
  let resolve!: (value: T) => void;
  let reject!: (reason: unknown) => void;
  const promise = new Promise<T>((ok, fail) => {
    resolve = ok;
    reject = fail;
  });
  return { promise, resolve, reject };
}

/** True in Node (where a WebSocket may carry Authorization), false in a browser. */
export function isNode(): boolean {
  const proc = (globalThis as { process?: { versions?: { node?: string } } }).process;
  return proc?.versions?.node !== undefined;
}
