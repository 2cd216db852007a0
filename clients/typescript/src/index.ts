// The package's public surface: the Worker and its options, the Message a handler gets, the
// errors and the publishing Client. The push-receiver helpers (Node only: node:crypto) are
// the subpath `ruststream/push`, so that a browser bundle of this entry needs no Node module.

export { Worker, type Handler, type RunOptions } from "./worker.js";
export { Message } from "./message.js";
export { Nak, Term, AuthError, HttpError } from "./errors.js";
export type { WorkerOptions, WorkerStats, Logger, TransportName } from "./options.js";
export { Client, type ClientOptions, type PublishOptions, type PublishResult } from "./client.js";
export { verifyPush, readPush, PushAnswer, PushVerificationError, SETTLE_HEADER, type PushedMessage } from "./push.js";
