// Test fixture: a real nats-server and a real gateway on free ports with temporary store
// directories, started per test and always stopped; a few typed calls to the gateway's API.
// Binaries: RUSTSTREAM_BIN (default: the worktree's target/debug/ruststream-nats) and
// NATS_SERVER_BIN (default: nats-server on PATH).

import { spawn, type ChildProcess } from "node:child_process";
import { randomBytes } from "node:crypto";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const HERE = dirname(fileURLToPath(import.meta.url));
const GATEWAY_BIN = process.env["RUSTSTREAM_BIN"] ?? resolve(HERE, "../../../../target/debug/ruststream-nats");
const NATS_BIN = process.env["NATS_SERVER_BIN"] ?? "nats-server";

export interface GatewayOptions {
  ackWait?: string;
  /** --ordering-key of the default consumer. */
  orderingKey?: string;
  /** Terms are copied to DLQ.orders, readable through the consumer ORDERS/dlq. */
  deadLetters?: boolean;
  /** More [[consumer]] entries of the consumers file; `dir` is the fixture's temporary directory. */
  consumers?: (dir: string) => string;
  /** More flags, e.g. --auth-tokens. */
  args?: string[];
}

export interface ConsumerInfo {
  leases_in_flight: number;
  num_pending: number;
  num_ack_pending: number;
  num_redelivered: number;
}

export interface Fetched {
  id: string;
  subject: string;
  data: string;
  stream_sequence: number;
  delivered: number;
  headers: Record<string, string[]>;
}

const LOWEST_PORT = 10_000;
let portsGiven = 0;

function ephemeralFrom(): number {
  try {
    const first = Number(readFileSync("/proc/sys/net/ipv4/ip_local_port_range", "utf8").trim().split(/\s+/)[0]);
    return Number.isInteger(first) ? first : 32_768;
  } catch {
    return 32_768;
  }
}

function bindable(port: number): Promise<boolean> {
  return new Promise((ok) => {
    const server = createServer();
    server.once("error", () => ok(false));
    server.listen(port, "127.0.0.1", () => server.close(() => ok(true)));
  });
}

/**
 * A port free now, below the kernel's ephemeral range, never handed out twice by this process.
 * Ports in that range are what listen(0) and every outgoing connection take, so one probed free
 * there can be taken before its server binds it, or while a killed gateway is down before its
 * restart on the same port.
 */
export async function freePort(): Promise<number> {
  const span = ephemeralFrom() - LOWEST_PORT;
  if (span < 1_000) {
    throw new Error(`the ephemeral port range starts at ${span + LOWEST_PORT}: too low for the tests`);
  }
  // Another test process (node --test runs each file in its own) starts elsewhere in the span.
  const offset = (process.pid * 7_919) % span;
  for (let tried = 0; tried < span; tried++) {
    const port = LOWEST_PORT + ((offset + portsGiven++) % span);
    if (await bindable(port)) return port;
  }
  throw new Error(`no free port below ${span + LOWEST_PORT}`);
}

/** Poll `check` until it returns a value other than undefined/false, or fail at the deadline. */
export async function waitFor<T>(what: string, check: () => Promise<T | undefined | false> | T | undefined | false, timeoutMs = 10_000): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    let value: T | undefined | false;
    try {
      value = await check();
    } catch {
      value = undefined;
    }
    if (value !== undefined && value !== false) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(20);
  }
}

export const sleep = (ms: number): Promise<void> => new Promise((ok) => setTimeout(ok, ms));

export class Fixture {
  readonly url: string;
  /** The nats-server's URL (set once started). */
  natsUrl = "";
  private nats: ChildProcess | undefined;
  private gateway: ChildProcess | undefined;
  private readonly dir: string;
  private readonly gatewayArgs: string[];
  private readonly env: NodeJS.ProcessEnv;

  /** The process ids of nats-server and the gateway, while they run (the benchmark reads their CPU). */
  pids(): { nats: number | undefined; gateway: number | undefined } {
    return { nats: this.nats?.pid, gateway: this.gateway?.pid };
  }

  private constructor(dir: string, httpPort: number, gatewayArgs: string[]) {
    this.dir = dir;
    this.url = `http://127.0.0.1:${httpPort}`;
    this.gatewayArgs = gatewayArgs;
    // The gateway reads RUSTSTREAM_* and NATS_* variables: none of the caller's may change a test.
    this.env = Object.fromEntries(
      Object.entries(process.env).filter(([name]) => name === "RUSTSTREAM_TEST_RUN" || !/^(RUSTSTREAM|NATS)_/.test(name)),
    );
    this.env["RUST_LOG"] = "warn";
  }

  static async start(options: GatewayOptions = {}): Promise<Fixture> {
    const dir = mkdtempSync(join(tmpdir(), "ruststream-ts-"));
    const natsPort = await freePort();
    const httpPort = await freePort();
    writeFileSync(join(dir, "lease.key"), randomBytes(32).toString("hex"));
    const args = [
      "--nats-url", `nats://127.0.0.1:${natsPort}`,
      "--listen", `127.0.0.1:${httpPort}`,
      "--create-stream", "--stream", "ORDERS", "--stream-subjects", "orders.>,DLQ.>",
      "--consumer", "billing", "--filter-subject", "orders.>",
      "--ack-wait", options.ackWait ?? "2s",
      "--lease-key-file", join(dir, "lease.key"),
      "--shutdown-grace", "1s",
    ];
    if (options.orderingKey !== undefined) args.push("--ordering-key", options.orderingKey);
    args.push(...(options.args ?? []));
    let consumers = options.consumers?.(dir) ?? "";
    if (options.deadLetters === true) {
      consumers += '[[consumer]]\nstream = "ORDERS"\nname = "dlq"\nfilter_subject = "DLQ.>"\n';
      args.push("--dead-letter-subject", "DLQ.orders");
    }
    if (consumers !== "") {
      writeFileSync(join(dir, "consumers.toml"), consumers);
      args.push("--consumers-file", join(dir, "consumers.toml"));
    }
    const fixture = new Fixture(dir, httpPort, args);
    fixture.natsUrl = `nats://127.0.0.1:${natsPort}`;
    try {
      fixture.nats = spawn(NATS_BIN, ["-js", "-a", "127.0.0.1", "-p", String(natsPort), "-sd", join(dir, "nats")], {
        stdio: "ignore",
        env: fixture.env,
      });
      await fixture.startGateway();
    } catch (err) {
      await fixture.stop();
      throw err;
    }
    return fixture;
  }

  /** Start (or start again, after killGateway) the gateway, and wait for /readyz. */
  async startGateway(): Promise<void> {
    const child = spawn(GATEWAY_BIN, this.gatewayArgs, { stdio: ["ignore", "ignore", "pipe"], env: this.env });
    let log = "";
    child.stderr?.on("data", (chunk: Buffer) => (log = (log + chunk.toString()).slice(-4000)));
    this.gateway = child;
    await waitFor(
      `the gateway at ${this.url} to be ready`,
      async () => {
        if (child.exitCode !== null) throw new Error(`the gateway exited (${child.exitCode}): ${log}`);
        return (await fetch(`${this.url}/readyz`)).status === 200;
      },
      30_000,
    ).catch((err: unknown) => {
      throw new Error(`${String(err)}; gateway log: ${log}`);
    });
  }

  /** kill -9 the gateway (the worker's leases stay valid at the server until ack_wait). */
  killGateway(): Promise<void> {
    return this.signalGateway("SIGKILL");
  }

  /** Stop the gateway with SIGTERM (its graceful stop: settles taken for --shutdown-grace, then what is still leased nak'd) and wait for its exit. */
  terminateGateway(): Promise<void> {
    return this.signalGateway("SIGTERM");
  }

  private async signalGateway(signal: NodeJS.Signals): Promise<void> {
    const child = this.gateway;
    if (child === undefined || child.exitCode !== null || child.signalCode !== null) return;
    const exited = new Promise((ok) => child.once("exit", ok));
    child.kill(signal);
    await exited;
  }

  async stop(): Promise<void> {
    for (const child of [this.gateway, this.nats]) {
      if (child === undefined || child.exitCode !== null || child.signalCode !== null) continue;
      const exited = new Promise((ok) => child.once("exit", ok));
      child.kill("SIGTERM");
      const timer = setTimeout(() => child.kill("SIGKILL"), 5_000);
      await exited;
      clearTimeout(timer);
    }
    rmSync(this.dir, { recursive: true, force: true });
  }

  /** The token the fixture's own calls send (with --auth-tokens). */
  token: string | undefined;

  async call<T>(method: string, path: string, body?: unknown): Promise<T> {
    const headers: Record<string, string> = { "content-type": "application/json" };
    if (this.token !== undefined) headers["authorization"] = `Bearer ${this.token}`;
    const init: RequestInit = { method, headers };
    if (body !== undefined) init.body = JSON.stringify(body);
    const response = await fetch(this.url + path, init);
    if (!response.ok) throw new Error(`${method} ${path}: ${response.status} ${await response.text()}`);
    return (response.status === 204 ? undefined : await response.json()) as T;
  }

  async publish(subject: string, data: string, orderingKey?: string): Promise<number> {
    const body: Record<string, unknown> = { subject, data };
    if (orderingKey !== undefined) body["ordering_key"] = orderingKey;
    return (await this.call<{ sequence: number }>("POST", "/publish", body)).sequence;
  }

  /** Publish n messages (50 requests at a time), in order of i within each key. */
  async publishMany(n: number, message: (i: number) => { subject: string; data: string; key?: string }): Promise<void> {
    for (let start = 0; start < n; start += 50) {
      const batch: Promise<number>[] = [];
      for (let i = start; i < Math.min(n, start + 50); i++) {
        const { subject, data, key } = message(i);
        batch.push(this.publish(subject, data, key));
      }
      await Promise.all(batch);
    }
  }

  consumer(): Promise<ConsumerInfo> {
    return this.call<ConsumerInfo>("GET", "/consumer");
  }

  async fetch(batch: number, waitMs: number, path = "/fetch"): Promise<Fetched[]> {
    return (await this.call<{ messages: Fetched[] }>("POST", path, { batch, wait_ms: waitMs, encoding: "utf8" })).messages;
  }
}
