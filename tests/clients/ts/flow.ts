// The lease flow through a TypeScript client generated from openapi/openapi.json
// (openapi-typescript types + openapi-fetch), run by scripts/ecosystem.sh against a live
// gateway (started with --ack-wait 2s) and nats-server. `tsc` type-checks it against the
// generated types first, so a spec change that breaks this client fails the build.
//
// Publish three messages, fetch them, extend + ack the first, nak the second with a delay,
// term the third; the nak'd one comes back after the delay with a higher delivery count, the
// acked and termed ones never do, and problem+json answers parse as the Problem schema.
//
// Usage: node dist/flow.js BASE_URL TOKEN   (TOKEN: a bearer token with every scope)

import createClient from "openapi-fetch";
import type { components, paths } from "./generated/schema.js";

type Message = components["schemas"]["MessageDto"];
type Problem = components["schemas"]["Problem"];

// The one Node global used; declared here rather than pulling in all of @types/node.
declare const process: { argv: string[] };

const NAK_DELAY_MS = 1500;
const ACK_WAIT_MS = 2000;

const [baseUrl, bearer] = process.argv.slice(2);
if (!baseUrl || !bearer) {
  throw new Error("usage: node dist/flow.js BASE_URL TOKEN");
}
const client = createClient<paths>({ baseUrl, headers: { Authorization: `Bearer ${bearer}` } });
const anonymous = createClient<paths>({ baseUrl });

function check(condition: unknown, message: string): asserts condition {
  if (!condition) {
    throw new Error(message);
  }
}

function expectProblem(
  response: Response,
  error: Problem | undefined,
  status: number,
  kind: string,
  field?: string,
): Problem {
  check(response.status === status, `expected ${status}, got ${response.status}`);
  const contentType = response.headers.get("content-type") ?? "";
  check(contentType.startsWith("application/problem+json"), `content type ${contentType}`);
  check(error !== undefined, "no problem body");
  check(error.status === status, `problem.status ${error.status}`);
  check(error.type === `urn:ruststream-nats:problem:${kind}`, `problem.type ${error.type}`);
  check(error.title.length > 0 && error.detail.length > 0, `title/detail: ${JSON.stringify(error)}`);
  if (field !== undefined) {
    check(error.field === field, `problem.field ${error.field}, want ${field}`);
  }
  return error;
}

/** One fetch; the messages of this run (others' are nak'd back at once). */
async function fetchOurs(token: string, waitMs = 1000): Promise<Message[]> {
  const { data, response } = await client.POST("/fetch", {
    body: { batch: 10, wait_ms: waitMs, encoding: "utf8" },
  });
  check(response.status === 200 && data, `fetch: ${response.status}`);
  const ours: Message[] = [];
  for (const message of data.messages) {
    if (message.data.startsWith(token)) {
      ours.push(message);
    } else {
      await client.POST("/messages/{id}/nak", { params: { path: { id: message.id } } });
    }
  }
  return ours;
}

async function main(): Promise<void> {
  const ready = await client.GET("/readyz");
  check(ready.response.status === 200 && ready.data?.status === "ok", "gateway not ready");
  // Without the token, a protected operation answers 401 as the spec says.
  const refused = await anonymous.GET("/consumer");
  expectProblem(refused.response, refused.error, 401, "unauthorized");
  const token = `ts-${Math.random().toString(16).slice(2, 14)}`;

  for (const name of ["ack", "nak", "term"]) {
    const { data, response } = await client.POST("/publish", {
      body: { subject: "orders.clients.typescript", data: `${token}-${name}` },
    });
    // 201 (stored) and 202 (a delayed message's schedule) answer different bodies: a
    // generated client tells them apart by a field of its own.
    check(
      response.status === 201 && data !== undefined && "sequence" in data && data.sequence > 0,
      `publish: ${response.status}`,
    );
  }

  const leased = new Map<string, Message>();
  const fetchDeadline = Date.now() + 10_000;
  while (leased.size < 3 && Date.now() < fetchDeadline) {
    for (const message of await fetchOurs(token)) {
      leased.set(message.data.slice(token.length + 1), message);
    }
  }
  const ack = leased.get("ack");
  const nak = leased.get("nak");
  const term = leased.get("term");
  check(ack && nak && term, `fetched ${[...leased.keys()].join(", ")}`);
  check([ack, nak, term].every((m) => m.delivered === 1), "first deliveries");

  const extended = await client.POST("/messages/{id}/in-progress", {
    params: { path: { id: ack.id } },
  });
  check(extended.response.status === 200 && extended.data?.lease_expires_at, "extend");
  const acked = await client.POST("/messages/{id}/ack", { params: { path: { id: ack.id } } });
  check(acked.response.status === 204, `ack: ${acked.response.status}`);
  const nakedAt = Date.now();
  const naked = await client.POST("/messages/{id}/nak", {
    params: { path: { id: nak.id } },
    body: { delay_ms: NAK_DELAY_MS },
  });
  check(naked.response.status === 204, `nak: ${naked.response.status}`);
  const termed = await client.POST("/messages/{id}/term", {
    params: { path: { id: term.id } },
    body: { reason: "bad order" },
  });
  check(termed.response.status === 204, `term: ${termed.response.status}`);

  // Bad calls answer problem+json, typed as the spec's Problem.
  const unknown = await client.POST("/messages/{id}/ack", { params: { path: { id: "not-a-lease" } } });
  expectProblem(unknown.response, unknown.error, 404, "lease-not-found");
  const conflict = await client.POST("/messages/{id}/nak", { params: { path: { id: ack.id } } });
  expectProblem(conflict.response, conflict.error, 409, "lease-settled");
  const invalid = await client.POST("/fetch", { body: { batch: 0 } });
  expectProblem(invalid.response, invalid.error, 422, "invalid-request", "batch");

  // The nak'd message comes back after its delay with delivered 2; nothing else of ours does.
  let again: Message | undefined;
  const redeliveryDeadline = Date.now() + 15_000;
  while (!again && Date.now() < redeliveryDeadline) {
    for (const message of await fetchOurs(token)) {
      check(message.data === `${token}-nak`, `${message.data} came back after ack/term`);
      again = message;
    }
  }
  const elapsed = Date.now() - nakedAt;
  check(again, "the nak'd message did not come back");
  check(elapsed >= NAK_DELAY_MS - 100, `redelivered after ${elapsed} ms, before the delay`);
  check(again.delivered === 2, `redelivery count ${again.delivered}`);
  check(again.id !== nak.id, "a redelivery has a new lease id");
  const batch = await client.POST("/messages/ack", { body: { ids: [again.id] } });
  check(batch.response.status === 200 && batch.data, `batch ack: ${batch.response.status}`);
  check(batch.data.results.map((r) => r.status).join() === "204", "batch results");

  // Past one more ack_wait nothing of ours is redelivered: the acks and the term held.
  const quietUntil = Date.now() + ACK_WAIT_MS + 500;
  while (Date.now() < quietUntil) {
    const stray = await fetchOurs(token, 500);
    check(stray.length === 0, `redelivered after being settled: ${stray.map((m) => m.data)}`);
  }
  const consumer = await client.GET("/consumer");
  check(consumer.response.status === 200 && consumer.data?.stream === "ORDERS", "consumer");

  // A named consumer (the consumers file's ORDERS/clients, filter orders.named.>), fetched
  // by name and acked through the same settle route.
  const published = await client.POST("/publish", {
    body: { subject: "orders.named.typescript", data: `${token}-named` },
  });
  check(published.response.status === 201, `publish: ${published.response.status}`);
  const path = { stream: "ORDERS", consumer: "clients" };
  let named: Message | undefined;
  const namedDeadline = Date.now() + 10_000;
  while (!named && Date.now() < namedDeadline) {
    const fetched = await client.POST("/streams/{stream}/consumers/{consumer}/fetch", {
      params: { path },
      body: { batch: 10, wait_ms: 1000, encoding: "utf8" },
    });
    check(fetched.response.status === 200 && fetched.data, `named fetch: ${fetched.response.status}`);
    for (const message of fetched.data.messages) {
      if (message.data === `${token}-named`) {
        named = message;
      } else {
        await client.POST("/messages/{id}/nak", { params: { path: { id: message.id } } });
      }
    }
  }
  check(named && named.consumer === "clients", "the named consumer's lease");
  const namedAck = await client.POST("/messages/{id}/ack", { params: { path: { id: named.id } } });
  check(namedAck.response.status === 204, `named ack: ${namedAck.response.status}`);
  const listed = await client.GET("/consumers");
  check(listed.response.status === 200 && listed.data, "list consumers");
  const sources = listed.data.consumers.map((c) => `${c.name}:${c.source}`);
  check(sources.includes("ecosystem:default") && sources.includes("clients:file"), `consumers ${sources}`);
  const nobody = await client.POST("/streams/{stream}/consumers/{consumer}/fetch", {
    params: { path: { stream: "ORDERS", consumer: "nobody" } },
    body: { wait_ms: 0 },
  });
  expectProblem(nobody.response, nobody.error, 404, "consumer-not-found");
  console.log(`typescript client flow: ok (${token}; nak'd message back after ${elapsed} ms, delivered 2)`);
}

await main();
