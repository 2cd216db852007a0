// Benchmark rows, one run: 20 000 messages of 256 B on one nats-server, drained by (1) this
// library's Worker (no-op handler, transport ws), (2) a @nats-io/jetstream consume() worker
// acking each message (the native client), (3) a bare `ws` loop over the gateway acking 100
// ids in band — a frame per lease, as the issue measured it, and with frames=batch, as the
// Worker reads them. Each reads its own durable consumer of the same stream. Prints msg/s, the
// ratios the issue asks for, and the CPU per message of this process, the gateway and nats-server.
// Run: node build/bench/bench.js (RUSTSTREAM_BIN: a release gateway; NATS_SERVER_BIN).

import { jetstream, jetstreamManager, AckPolicy } from "@nats-io/jetstream";
import { connect } from "@nats-io/transport-node";
import { readFileSync } from "node:fs";
import WebSocket from "ws";

import { Worker } from "../src/index.js";
import { Fixture, waitFor } from "../test/fixture.js";

const COUNT = Number(process.env["BENCH_MESSAGES"] ?? 20_000);
const payload = new Uint8Array(256).fill(97);
const silent = { debug: () => undefined, info: () => undefined, warn: console.error, error: console.error };

interface Row {
  name: string;
  seconds: number;
  cpuMicros: number;
  /** The gateway's and nats-server's CPU over the row, in µs (NaN without /proc). */
  gatewayMicros: number;
  serverMicros: number;
}

/** A process's CPU time so far (user + system) in µs, read from /proc (Linux); NaN elsewhere. */
function processMicros(pid: number | undefined): number {
  if (pid === undefined) return NaN;
  try {
    const fields = readFileSync(`/proc/${pid}/stat`, "utf8").split(")").pop()?.trim().split(" ") ?? [];
    // utime and stime, the 14th and 15th fields of stat (the 12th and 13th after the name).
    return ((Number(fields[11]) + Number(fields[12])) / CLOCK_TICKS) * 1e6;
  } catch {
    return NaN;
  }
}
/** Linux's USER_HZ: /proc counts CPU time in hundredths of a second. */
const CLOCK_TICKS = 100;

async function measure(name: string, body: () => Promise<void>): Promise<Row> {
  const pids = gateway.pids();
  const [gatewayBefore, serverBefore] = [processMicros(pids.gateway), processMicros(pids.nats)];
  const cpu = process.cpuUsage();
  const started = performance.now();
  await body();
  const seconds = (performance.now() - started) / 1000;
  const used = process.cpuUsage(cpu);
  return {
    name,
    seconds,
    cpuMicros: used.user + used.system,
    gatewayMicros: processMicros(pids.gateway) - gatewayBefore,
    serverMicros: processMicros(pids.nats) - serverBefore,
  };
}

/** A bare loop over the gateway's WebSocket: every lease acked in band, up to 100 ids an op. */
async function bareLoop(consumer: string, frames: "single" | "batch"): Promise<void> {
  const url = `${gateway.url.replace("http", "ws")}/streams/ORDERS/consumers/${consumer}/ws?max_in_flight=100&encoding=base64&frames=${frames}`;
  const socket = new WebSocket(url, { perMessageDeflate: false });
  let ids: string[] = [];
  let acked = 0;
  let flushing = false;
  const flush = (): void => {
    flushing = false;
    if (ids.length > 0) socket.send(JSON.stringify({ op: "ack", ids }));
    ids = [];
  };
  const take = (id: string): void => {
    ids.push(id);
    if (ids.length === 100) flush();
    else if (!flushing) {
      flushing = true;
      setImmediate(flush);
    }
  };
  await new Promise<void>((done, fail) => {
    socket.on("error", fail);
    socket.on("message", (data) => {
      const frame = JSON.parse(data.toString()) as { type: string; id: string; messages?: { id: string }[]; results?: unknown[] };
      if (frame.type === "message") take(frame.id);
      else if (frame.type === "messages") for (const message of frame.messages ?? []) take(message.id);
      else if (frame.type === "settled") {
        acked += frame.results?.length ?? 0;
        if (acked >= COUNT) done();
      }
    });
  });
  socket.close();
}

const gateway = await Fixture.start({
  ackWait: "30s",
  consumers: () =>
    ["bare", "barebatch"].map((name) => `[[consumer]]\nstream = "ORDERS"\nname = "${name}"\nfilter_subject = "orders.>"\n`).join("\n"),
});
const nc = await connect({ servers: gateway.natsUrl });
try {
  const js = jetstream(nc);
  const jsm = await jetstreamManager(nc);
  await jsm.consumers.add("ORDERS", { durable_name: "natsjs", ack_policy: AckPolicy.Explicit, filter_subject: "orders.>" });
  for (let start = 0; start < COUNT; start += 500) {
    await Promise.all(Array.from({ length: Math.min(500, COUNT - start) }, (_, i) => js.publish(`orders.bench.${start + i}`, payload)));
  }

  const rows: Row[] = [];
  rows.push(
    await measure("ruststream Worker, ws, no-op handler", async () => {
      const worker = new Worker({ url: gateway.url, logger: silent });
      const run = worker.run(() => undefined);
      await waitFor("the worker's acks", () => worker.stats.acked >= COUNT, 120_000);
      await worker.stop();
      await run;
    }),
  );
  rows.push(
    await measure("@nats-io/jetstream consume(), m.ack()", async () => {
      const consumer = await js.consumers.get("ORDERS", "natsjs");
      const messages = await consumer.consume({ max_messages: 100 });
      let acked = 0;
      for await (const message of messages) {
        message.ack();
        if (++acked === COUNT) break;
      }
      await nc.flush();
    }),
  );
  for (const [consumer, frames] of [["bare", "single"], ["barebatch", "batch"]] as const) {
    rows.push(await measure(`bare ws loop, 100 ids acked in band, frames=${frames}`, () => bareLoop(consumer, frames)));
  }
  const rate = (row: Row): number => COUNT / row.seconds;
  const [worker, native, bare, bareBatch] = rows.map(rate) as [number, number, number, number];
  console.log(`${COUNT} messages of ${payload.length} B, one nats-server, one run`);
  console.log("row | msg/s | × nats.js | × bare ws | × bare ws, frames=batch | CPU µs/msg: this process / gateway / nats-server");
  for (const row of rows) {
    const perMessage = [row.cpuMicros, row.gatewayMicros, row.serverMicros].map((micros) => (micros / COUNT).toFixed(1)).join(" / ");
    console.log(
      `${row.name} | ${Math.round(rate(row))} | ${(rate(row) / native).toFixed(2)} | ${(rate(row) / bare).toFixed(2)} | ${(rate(row) / bareBatch).toFixed(2)} | ${perMessage}`,
    );
  }
  console.log(
    `worker/nats.js ${(worker / native).toFixed(2)} (issue: >= 1.0), worker/bare ws ${(worker / bare).toFixed(2)} (issue: >= 0.8), worker/bare ws batch ${(worker / bareBatch).toFixed(2)}`,
  );
} finally {
  await nc.close();
  await gateway.stop();
}
