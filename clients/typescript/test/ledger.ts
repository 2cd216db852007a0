// The ledger test of issue 42, per transport: 20 000 messages drained by a worker process that
// is killed -9 and restarted three times while the gateway is restarted twice (once by SIGTERM,
// once by kill -9, on its port with its lease key). Lost 0: every message handled to completion
// at least once and the consumer left holding nothing; none acked twice: no message has two
// acks the gateway confirmed. Duplicate handlings (at-least-once after a kill) are counted.

import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { closeSync, fstatSync, mkdtempSync, openSync, readSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { jetstream } from "@nats-io/jetstream";
import { connect } from "@nats-io/transport-node";

import type { TransportName, WorkerStats } from "../src/index.js";
import { Fixture, waitFor } from "./fixture.js";

const HERE = dirname(fileURLToPath(import.meta.url));
const TOTAL = 20_000;
const PAYLOAD_BYTES = 256;
/** ledger-child.ts's drainTimeoutMs. */
const DRAIN_TIMEOUT_MS = 5_000;

/** What happens once this many distinct messages were handled (a different point of the drain each time). */
const PLAN: { at: number; action: "kill -9 the worker" | "restart the gateway (SIGTERM)" | "restart the gateway (kill -9)" }[] = [
  { at: 2_500, action: "kill -9 the worker" },
  { at: 5_500, action: "restart the gateway (SIGTERM)" },
  { at: 8_500, action: "kill -9 the worker" },
  { at: 11_500, action: "kill -9 the worker" },
  // The last worker lives through this one, and must still drain to a clean exit.
  { at: 14_500, action: "restart the gateway (kill -9)" },
];

const idOf = (i: number): string => `ledger-${String(i).padStart(5, "0")}`;

/** A 256-byte JSON record carrying its unique id. */
function record(i: number): Uint8Array {
  const head = `{"id":"${idOf(i)}","pad":"`;
  return new TextEncoder().encode(head + "x".repeat(PAYLOAD_BYTES - head.length - 2) + '"}');
}

/** Publish the ledger straight to JetStream (500 at a time): the gateway is what is under test, not its publish path. */
async function publishLedger(natsUrl: string): Promise<number> {
  const nc = await connect({ servers: natsUrl });
  try {
    const js = jetstream(nc);
    let last = 0;
    for (let start = 0; start < TOTAL; start += 500) {
      const acks = await Promise.all(
        Array.from({ length: Math.min(500, TOTAL - start) }, (_, k) => js.publish(`orders.ledger.${(start + k) % 16}`, record(start + k))),
      );
      for (const ack of acks) last = Math.max(last, ack.seq);
    }
    return last;
  } finally {
    await nc.close();
  }
}

/** The worker processes' shared ledger file, read as it grows. */
class Ledger {
  /** Worker processes that started, in order. */
  processes = 0;
  /** Every completed handling: process (1-based), stream sequence, delivery. */
  readonly handled: { process: number; sequence: number; delivered: number; id: string }[] = [];
  readonly ids = new Set<string>();
  /** Acks the gateway confirmed, per stream sequence. */
  readonly acks = new Map<number, { process: number; delivered: number }[]>();
  /** Confirmed acks of a delivery whose handling had not completed before (never expected). */
  readonly ackedBeforeHandled: string[] = [];
  /** Log lines by level (debug: the confirmed settles). */
  readonly logs = new Map<string, string[]>();
  private readonly completed = new Set<string>();
  private offset = 0;
  private rest = "";

  constructor(private readonly path: string) {}

  /** Take in what was appended since the last read. */
  read(): void {
    let fd: number;
    try {
      fd = openSync(this.path, "r");
    } catch {
      return;
    }
    try {
      const size = fstatSync(fd).size;
      if (size <= this.offset) return;
      const chunk = Buffer.alloc(size - this.offset);
      const got = readSync(fd, chunk, 0, chunk.length, this.offset);
      this.offset += got;
      const lines = (this.rest + chunk.subarray(0, got).toString("utf8")).split("\n");
      this.rest = lines.pop() ?? "";
      for (const line of lines) this.take(line);
    } finally {
      closeSync(fd);
    }
  }

  private take(line: string): void {
    const [kind = "", ...fields] = line.split(" ");
    if (kind === "start") {
      this.processes++;
    } else if (kind === "handled") {
      const [sequence, delivered, id = ""] = fields;
      this.handled.push({ process: this.processes, sequence: Number(sequence), delivered: Number(delivered), id });
      this.ids.add(id);
      this.completed.add(`${sequence}/${delivered}`);
    } else {
      const text = fields.join(" ");
      this.logs.set(kind, [...(this.logs.get(kind) ?? []), text]);
      const ack = /^ruststream: ack of ORDERS#(\d+) \(delivery (\d+)\) confirmed \(2\d\d\)$/.exec(text);
      if (kind === "debug" && ack !== null) {
        const sequence = Number(ack[1]);
        const delivered = Number(ack[2]);
        this.acks.set(sequence, [...(this.acks.get(sequence) ?? []), { process: this.processes, delivered }]);
        if (!this.completed.has(`${sequence}/${delivered}`)) this.ackedBeforeHandled.push(`${sequence}/${delivered}`);
      }
    }
  }
}

/** One worker process (ledger-child.ts) writing to the ledger. */
class WorkerProcess {
  private readonly child: ChildProcess;
  private readonly exited: Promise<{ code: number | null; signal: NodeJS.Signals | null }>;
  private stdout = "";

  constructor(url: string, transport: TransportName, ledgerPath: string) {
    this.child = spawn(process.execPath, [join(HERE, "ledger-child.js")], {
      env: { ...process.env, GATEWAY_URL: url, TRANSPORT: transport, LEDGER_FILE: ledgerPath },
      stdio: ["ignore", "pipe", "inherit"],
    });
    this.child.stdout?.on("data", (chunk: Buffer) => (this.stdout += chunk.toString()));
    this.exited = new Promise((ok) => this.child.once("exit", (code, signal) => ok({ code, signal })));
  }

  get running(): boolean {
    return this.child.exitCode === null && this.child.signalCode === null;
  }

  async kill(): Promise<void> {
    if (this.running) this.child.kill("SIGKILL");
    await this.exited;
  }

  /** SIGTERM: the worker drains and exits 0 (within its drainTimeoutMs and a margin); its stats. */
  async terminate(): Promise<WorkerStats> {
    this.child.kill("SIGTERM");
    let timer: ReturnType<typeof setTimeout> | undefined;
    const late = new Promise<"late">((ok) => (timer = setTimeout(() => ok("late"), DRAIN_TIMEOUT_MS + 10_000)));
    const exit = await Promise.race([this.exited, late]);
    clearTimeout(timer);
    assert.notEqual(exit, "late", "the last worker did not exit after SIGTERM");
    const { code, signal } = exit as Awaited<typeof this.exited>;
    assert.equal(code, 0, `the last worker exited with ${String(code ?? signal)}: ${this.stdout}`);
    return JSON.parse(this.stdout.trim()) as WorkerStats;
  }
}

export function defineLedger(transport: TransportName): void {
  test(
    `${transport}: a ledger of 20 000 messages, the worker process killed -9 and restarted three times and the gateway restarted twice: lost 0, every message handled to completion at least once, none acked twice`,
    async (t) => {
      const began = Date.now();
      const gateway = await Fixture.start({ ackWait: "2s" });
      const dir = mkdtempSync(join(tmpdir(), "ruststream-ledger-"));
      const ledgerPath = join(dir, "ledger");
      let worker: WorkerProcess | undefined;
      try {
        assert.equal(await publishLedger(gateway.natsUrl), TOTAL);
        const published = Date.now();
        const ledger = new Ledger(ledgerPath);
        const handledAtLeast = (n: number) => () => {
          ledger.read();
          return ledger.ids.size >= n;
        };
        worker = new WorkerProcess(gateway.url, transport, ledgerPath);
        const timeline: string[] = [];
        for (const { at, action } of PLAN) {
          await waitFor(`${at} messages handled`, handledAtLeast(at), 60_000);
          timeline.push(`${action} at ${ledger.ids.size} handled (${ledger.handled.length} handlings), ${Date.now() - published} ms`);
          if (action === "kill -9 the worker") {
            await worker.kill();
            worker = new WorkerProcess(gateway.url, transport, ledgerPath);
          } else {
            await (action === "restart the gateway (SIGTERM)" ? gateway.terminateGateway() : gateway.killGateway());
            await gateway.startGateway();
          }
        }
        await waitFor(`all ${TOTAL} messages handled`, handledAtLeast(TOTAL), 60_000);
        // Lost 0 at the server too: nothing left to deliver, nothing delivered and unacked.
        let consumer = await waitFor(
          "the consumer to hold nothing",
          async () => {
            const info = await gateway.consumer();
            return info.num_pending === 0 && info.num_ack_pending === 0 && info.leases_in_flight === 0 && info;
          },
          30_000,
        );
        const drained = Date.now();
        const stats = await worker.terminate();
        ledger.read();
        consumer = await gateway.consumer();

        const missing = Array.from({ length: TOTAL }, (_, i) => idOf(i)).filter((id) => !ledger.ids.has(id));
        assert.deepEqual(missing.slice(0, 20), [], `${missing.length} messages never handled to completion`);
        assert.equal(ledger.ids.size, TOTAL);
        assert.equal(consumer.num_pending, 0);
        assert.equal(consumer.num_ack_pending, 0);
        assert.equal(consumer.leases_in_flight, 0);
        // Each stream sequence carried one id: the handlings are of the ledger's messages, read whole.
        const idBySequence = new Map<number, string>();
        for (const { sequence, id } of ledger.handled) {
          assert.equal(idBySequence.get(sequence) ?? id, id, `#${sequence}`);
          idBySequence.set(sequence, id);
        }
        // None acked twice, and none acked before its handling completed.
        const ackedTwice = [...ledger.acks].filter(([, acks]) => acks.length > 1).map(([sequence, acks]) => `#${sequence}: ${JSON.stringify(acks)}`);
        assert.deepEqual(ackedTwice, []);
        assert.deepEqual(ledger.ackedBeforeHandled, []);
        assert.equal(ledger.processes, 4);
        // The last worker lived through the gateway's kill -9 and still drained to a clean exit
        // (run() returns once every lease it held was settled or given up), having logged each
        // confirmed ack it counted.
        assert.equal(stats.acked, [...ledger.acks.values()].flat().filter((ack) => ack.process === 4).length);
        assert.ok(stats.reconnects >= 1 || transport === "fetch", JSON.stringify(stats));
        assert.deepEqual(ledger.logs.get("error") ?? [], []);

        const confirmedAcks = [...ledger.acks.values()].reduce((sum, acks) => sum + acks.length, 0);
        const redelivered = ledger.handled.filter((handling) => handling.delivered > 1).length;
        for (const line of timeline) t.diagnostic(line);
        for (const line of (ledger.logs.get("warn") ?? []).slice(0, 10)) t.diagnostic(`logged: ${line}`);
        t.diagnostic(
          `${transport}: handled ${ledger.handled.length} times for ${TOTAL} messages: ${ledger.handled.length - TOTAL} duplicate handlings (${redelivered} handlings of a redelivery); ` +
            `${confirmedAcks} acks confirmed to the workers, none twice; ${(ledger.logs.get("warn") ?? []).length} warnings logged`,
        );
        t.diagnostic(`${transport}: the last worker's stats: ${JSON.stringify(stats)}`);
        t.diagnostic(
          `${transport}: published in ${published - began} ms (with the start-up), drained in ${drained - published} ms, ${Date.now() - began} ms in all`,
        );
      } finally {
        await worker?.kill();
        await gateway.stop();
        rmSync(dir, { recursive: true, force: true });
      }
    },
  );
}
