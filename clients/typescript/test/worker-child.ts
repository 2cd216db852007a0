// A worker process for the SIGTERM test: holds leases with slow handlers, prints `started <seq>`
// as each handler begins, `acked <seq>` for each message it handled, and its stats as one JSON
// line when run() returns.

import { Worker, type TransportName } from "../src/index.js";

const worker = new Worker({
  url: process.env["GATEWAY_URL"] as string,
  transport: process.env["TRANSPORT"] as TransportName,
  maxInFlight: 100,
  concurrency: 10,
  drainTimeoutMs: Number(process.env["DRAIN_TIMEOUT_MS"]),
  logger: { debug: () => undefined, info: () => undefined, warn: console.error, error: console.error },
});
const handled: number[] = [];
await worker.run(
  async (message) => {
    // Tells the test this process really holds leases (the gateway counts them from the
    // moment it leases, before they reach here).
    process.stdout.write(`started ${message.streamSequence}\n`);
    await new Promise((ok) => setTimeout(ok, 1_000));
    await message.ack();
    handled.push(message.streamSequence);
  },
  { signals: true },
);
process.stdout.write(handled.map((sequence) => `acked ${sequence}\n`).join("") + JSON.stringify(worker.stats) + "\n");
