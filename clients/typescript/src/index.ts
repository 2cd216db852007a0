// The package's public surface: the Worker and its options, the Message a handler gets, the
// errors, the publishing Client and the push-receiver helpers.

export { Worker, type Handler, type RunOptions } from "./worker.js";
export { Message } from "./message.js";
export { Nak, Term, AuthError, HttpError } from "./errors.js";
export type { WorkerOptions, WorkerStats, Logger, TransportName } from "./options.js";
