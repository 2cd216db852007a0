// The integration suite every transport passes, against a real gateway and nats-server:
// lease extension, bounds, retries, dead letters, drain on SIGTERM, a gateway killed under
// the worker, ordering per key.

import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import { dirname, join } from "node:path";
import { test } from "node:test";
import { fileURLToPath } from "node:url";

import { Nak, Term, Worker, type Logger, type TransportName, type WorkerOptions } from "../src/index.js";
import { Fixture, sleep, waitFor } from "./fixture.js";

const HERE = dirname(fileURLToPath(import.meta.url));

/** Records what the worker logs, and echoes warnings and errors. */
export function recordingLogger(): Logger & { lines: string[] } {
  const lines: string[] = [];
  const keep = (level: string) => (message: string) => {
    lines.push(`${level} ${message}`);
  };
  return { lines, debug: keep("debug"), info: keep("info"), warn: keep("warn"), error: keep("error") };
}

async function withGateway(options: Parameters<typeof Fixture.start>[0], body: (gateway: Fixture) => Promise<void>): Promise<void> {
  const gateway = await Fixture.start(options);
  try {
    await body(gateway);
  } finally {
    await gateway.stop();
  }
}

export function defineSuite(transport: TransportName): void {
  const make = (gateway: Fixture, options: Partial<WorkerOptions> = {}): Worker =>
    new Worker({ url: gateway.url, transport, logger: recordingLogger(), ...options });

  test(`${transport}: a handler taking 3 x ack_wait finishes with one delivery and one ack`, async () => {
    await withGateway({ ackWait: "2s" }, async (gateway) => {
      await gateway.publish("orders.slow", "slow");
      const worker = make(gateway);
      const calls: number[] = [];
      const handled = new Promise<void>((done) => {
        void worker.run(async (message) => {
          calls.push(message.delivered);
          await sleep(6_000);
          done();
        });
      });
      await handled;
      await waitFor("the ack", () => worker.stats.acked === 1);
      await worker.stop();
      assert.deepEqual(calls, [1]);
      assert.ok(worker.stats.extended >= 2, `extended ${worker.stats.extended} times`);
      assert.deepEqual(worker.stats.settleFailures, {});
      // Nothing comes back: the one delivery was acked.
      assert.deepEqual(await gateway.fetch(10, 2_500), []);
      const info = await gateway.consumer();
      assert.equal(info.num_redelivered, 0);
      assert.equal(info.num_ack_pending, 0);
    });
  });

  test(`${transport}: 1000 messages with concurrency 8 never exceed 8 running nor maxInFlight leases`, async () => {
    await withGateway({}, async (gateway) => {
      await gateway.publishMany(1000, (i) => ({ subject: `orders.bulk.${i}`, data: `m${i}` }));
      const maxInFlight = 40;
      const worker = make(gateway, { concurrency: 8, maxInFlight });
      let running = 0;
      let mostRunning = 0;
      const seen = new Set<number>();
      const run = worker.run(async (message) => {
        running++;
        mostRunning = Math.max(mostRunning, running);
        await sleep(Math.random() * 2);
        seen.add(message.streamSequence);
        running--;
      });
      let mostLeases = 0;
      let mostHeld = 0;
      await waitFor(
        "1000 messages handled",
        async () => {
          mostLeases = Math.max(mostLeases, (await gateway.consumer()).leases_in_flight);
          mostHeld = Math.max(mostHeld, worker.inFlight);
          return seen.size === 1000;
        },
        60_000,
      );
      await worker.stop();
      await run;
      assert.equal(mostRunning, 8);
      assert.ok(mostLeases <= maxInFlight, `leases_in_flight reached ${mostLeases}`);
      assert.ok(mostLeases > 0);
      // Over ws a settle's answer comes before any lease it made room for, and a poll asks
      // only for the room left; over sse the answer comes over HTTP, racing the stream, so
      // there the bound is the gateway's count above.
      if (transport !== "sse") assert.ok(mostHeld <= maxInFlight, `the worker held ${mostHeld}`);
      assert.equal((await gateway.consumer()).leases_in_flight, 0);
    });
  });

  test(`${transport}: exceptions nak with growing delays; Nak and Term as written; Term dead-letters with its reason`, async () => {
    await withGateway({ deadLetters: true }, async (gateway) => {
      await gateway.publish("orders.flaky", "flaky");
      await gateway.publish("orders.poison", "poison");
      await gateway.publish("orders.later", "later");
      const initial = 300;
      const worker = make(gateway, { backoffInitialMs: initial, backoffMaxMs: 10_000 });
      const flakyAt: number[] = [];
      const laterAt: number[] = [];
      const run = worker.run(async (message) => {
        if (message.subject === "orders.poison") throw new Term("bad order");
        if (message.subject === "orders.later") {
          laterAt.push(Date.now());
          if (message.delivered === 1) throw new Nak(700);
          return;
        }
        flakyAt.push(Date.now());
        if (message.delivered <= 3) throw new Error(`failure ${message.delivered}`);
      });
      await waitFor("the flaky message acked", () => worker.stats.acked === 2 && flakyAt.length === 4, 20_000);
      await worker.stop();
      await run;
      const gaps = flakyAt.slice(1).map((at, i) => at - (flakyAt[i] as number));
      gaps.forEach((gap, i) => assert.ok(gap >= 0.75 * initial * 2 ** i, `gap ${i + 1} was ${gap} ms`));
      assert.ok((gaps[2] as number) > (gaps[0] as number), `gaps ${gaps.join(", ")}`);
      assert.ok((laterAt[1] as number) - (laterAt[0] as number) >= 700);
      assert.equal(worker.stats.naked, 4);
      assert.equal(worker.stats.termed, 1);
      const dead = await waitFor("the dead letter", async () => {
        const [letter] = await gateway.fetch(1, 1_000, "/streams/ORDERS/consumers/dlq/fetch");
        return letter;
      });
      assert.equal(dead.data, "poison");
      assert.deepEqual(dead.headers["Ruststream-Dead-Letter-Reason"], ["terminated"]);
      assert.deepEqual(dead.headers["Ruststream-Dead-Letter-Term-Reason"], ["bad order"]);
    });
  });

  test(`${transport}: stop() naks what still runs after drainTimeoutMs; nothing is left leased`, async () => {
    await withGateway({ ackWait: "10s" }, async (gateway) => {
      await gateway.publishMany(5, (i) => ({ subject: `orders.stuck.${i}`, data: `s${i}` }));
      const worker = make(gateway, { drainTimeoutMs: 500, concurrency: 2 });
      let started = 0;
      const run = worker.run(() => {
        started++;
        return new Promise(() => undefined);
      });
      await waitFor("two handlers running and five leases held", () => started === 2 && worker.inFlight === 5);
      await worker.stop();
      await run;
      assert.equal(worker.stats.naked, 5);
      assert.equal((await gateway.consumer()).leases_in_flight, 0);
      const back = new Set<number>();
      await waitFor("the five back", async () => {
        for (const message of await gateway.fetch(10, 500)) back.add(message.stream_sequence);
        return back.size === 5;
      }, 2_000);
    });
  });

  test(`${transport}: SIGTERM to a worker process holding 100 leases: exit 0 within drainTimeoutMs, nothing left leased`, async () => {
    await withGateway({ ackWait: "10s" }, async (gateway) => {
      await gateway.publishMany(300, (i) => ({ subject: `orders.drain.${i}`, data: `d${i}` }));
      const drainTimeoutMs = 5_000;
      const child = spawn(process.execPath, [join(HERE, "worker-child.js")], {
        env: { ...process.env, GATEWAY_URL: gateway.url, TRANSPORT: transport, DRAIN_TIMEOUT_MS: String(drainTimeoutMs) },
        stdio: ["ignore", "pipe", "inherit"],
      });
      let output = "";
      child.stdout.on("data", (chunk: Buffer) => (output += chunk.toString()));
      const exited = new Promise<number | null>((ok) => child.once("exit", (code) => ok(code)));
      // Handlers have begun in the process (the gateway's count alone includes leases not yet
      // written to it: signalled then, it would have received none) and 100 are leased.
      await waitFor(
        "100 leases held by the worker process",
        async () => output.includes("started ") && (await gateway.consumer()).leases_in_flight === 100,
        20_000,
      );
      const signalledAt = Date.now();
      child.kill("SIGTERM");
      const code = await Promise.race([exited, sleep(drainTimeoutMs + 2_000).then(() => "late")]);
      assert.equal(code, 0, `exit ${String(code)} after ${Date.now() - signalledAt} ms`);
      assert.equal((await gateway.consumer()).leases_in_flight, 0);
      const acked = output.split("\n").filter((line) => line.startsWith("acked ")).map((line) => Number(line.slice(6)));
      const stats = JSON.parse(output.split("\n").find((line) => line.startsWith("{")) ?? "{}") as { received?: number; acked?: number; naked?: number };
      assert.equal(stats.acked, acked.length);
      // Every lease the worker received was acked or given back with a nak (leases the gateway
      // had not yet written when the stream closed are given back by the gateway itself).
      assert.ok((stats.received ?? 0) > 0);
      assert.equal((stats.acked ?? 0) + (stats.naked ?? 0), stats.received, output.slice(-600));
      // Everything not handled is back at once (ack_wait is 10 s): fetchable within 2 s.
      const left = 300 - acked.length;
      const again = new Set<number>();
      const deadline = Date.now() + 2_000;
      while (again.size < left && Date.now() < deadline) {
        for (const message of await gateway.fetch(1000, Math.max(1, deadline - Date.now()))) again.add(message.stream_sequence);
      }
      assert.equal(again.size, left);
      for (const sequence of acked) assert.ok(!again.has(sequence), `acked ${sequence} came back`);
    });
  });

  test(`${transport}: the gateway killed -9 and restarted under a running worker: it resumes, lost 0`, async () => {
    await withGateway({ ackWait: "2s" }, async (gateway) => {
      const total = 400;
      await gateway.publishMany(total, (i) => ({ subject: `orders.kill.${i}`, data: `k${i}` }));
      const worker = make(gateway, { concurrency: 8, maxInFlight: 50 });
      const handled = new Set<number>();
      const run = worker.run(async (message) => {
        await sleep(5);
        handled.add(message.streamSequence);
      });
      await waitFor("a quarter handled", () => handled.size >= total / 4, 20_000);
      await gateway.killGateway();
      await sleep(300);
      await gateway.startGateway();
      await waitFor("every message handled", () => handled.size === total, 60_000);
      await waitFor("nothing left leased", async () => (await gateway.consumer()).num_pending === 0 && worker.inFlight === 0, 20_000);
      await worker.stop();
      await run;
      // A stream's connection is broken by the kill, so it reconnects. Polls have no
      // connection to lose: when none was under way at the kill (the worker full, waiting
      // for room), the next one simply reaches the restarted gateway.
      if (transport !== "fetch") assert.ok(worker.stats.reconnects >= 1);
    });
  });

  test(`${transport}: ordering per key with concurrency 16: no two messages of a key overlap, order kept`, async () => {
    await withGateway({ orderingKey: "header" }, async (gateway) => {
      const total = 240;
      await gateway.publishMany(total, (i) => ({ subject: `orders.keyed.${i}`, data: `o${i}`, key: `k${i % 12}` }));
      const worker = make(gateway, { concurrency: 16 });
      const busy = new Set<string>();
      const order = new Map<string, number[]>();
      let overlaps = 0;
      let done = 0;
      const run = worker.run(async (message) => {
        const key = message.header("Ruststream-Ordering-Key") ?? "";
        if (busy.has(key)) overlaps++;
        busy.add(key);
        await sleep(Math.random() * 4);
        order.set(key, [...(order.get(key) ?? []), message.streamSequence]);
        busy.delete(key);
        done++;
      });
      await waitFor("every keyed message handled", () => done >= total, 60_000);
      await worker.stop();
      await run;
      assert.equal(overlaps, 0);
      assert.equal(order.size, 12);
      for (const [key, sequences] of order) {
        assert.deepEqual(sequences, [...sequences].sort((a, b) => a - b), `key ${key} out of order`);
        assert.equal(new Set(sequences).size, total / 12, `key ${key}`);
      }
    });
  });
}
