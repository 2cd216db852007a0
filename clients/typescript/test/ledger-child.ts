// A worker process for the ledger test (ledger.ts): handles the ledger's messages with a little
// real work and appends to LEDGER_FILE, each line with one synchronous write so that a kill -9
// loses nothing written: `start <pid>` first, `handled <seq> <delivered> <id>` once a handling
// completed (before the handler returns, so before its ack), and every line the worker logs
// (`debug ruststream: ack of ORDERS#<seq> (delivery <n>) confirmed (204)` for each settle the
// gateway confirmed). On SIGTERM it drains, prints its stats as one JSON line and exits 0.

import { openSync, writeSync } from "node:fs";

import { Worker, type TransportName } from "../src/index.js";

const ledger = openSync(process.env["LEDGER_FILE"] as string, "a");
/** One write(2) per line on an O_APPEND file: whole lines, in the kernel once this returns. */
const append = (line: string): void => {
  writeSync(ledger, line.replace(/\n/g, " ") + "\n");
};
const logTo = (level: string) => (message: string) => append(`${level} ${message}`);

append(`start ${process.pid}`);
const worker = new Worker({
  url: process.env["GATEWAY_URL"] as string,
  transport: process.env["TRANSPORT"] as TransportName,
  maxInFlight: 200,
  concurrency: 32,
  drainTimeoutMs: 5_000,
  logger: { debug: logTo("debug"), info: logTo("info"), warn: logTo("warn"), error: logTo("error") },
});
await worker.run(
  async (message) => {
    // The work: read the record, wait on something asynchronous, then write its line.
    const { id } = message.json<{ id: string }>();
    await new Promise((ok) => setTimeout(ok, 1));
    append(`handled ${message.streamSequence} ${message.delivered} ${id}`);
  },
  { signals: true },
);
process.stdout.write(JSON.stringify(worker.stats) + "\n");
