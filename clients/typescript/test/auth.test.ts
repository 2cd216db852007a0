// Authentication: a token goes as Authorization on every transport; a refused token (401) or
// scope (403) stops the worker with an AuthError, after draining.

import assert from "node:assert/strict";
import { test } from "node:test";

import { AuthError, Worker } from "../src/index.js";
import { Fixture, waitFor } from "./fixture.js";
import { recordingLogger } from "./suite.js";

test("a good token works on ws, sse and fetch; a bad token or a missing scope stops the worker with AuthError", async () => {
  const gateway = await Fixture.start({ args: ["--auth-tokens", "all-7f3a *;fetcher-9c1d fetch"] });
  gateway.token = "all-7f3a";
  try {
    for (const transport of ["ws", "sse", "fetch"] as const) {
      await gateway.publish(`orders.auth.${transport}`, transport);
      const worker = new Worker({ url: gateway.url, token: "all-7f3a", transport, logger: recordingLogger() });
      const seen: string[] = [];
      const run = worker.run((message) => void seen.push(message.text()));
      await waitFor(`${transport}: the message acked`, () => worker.stats.acked === 1);
      await worker.stop();
      await run;
      assert.deepEqual(seen, [transport]);

      const refused = new Worker({ url: gateway.url, token: "wrong", transport, logger: recordingLogger() });
      await assert.rejects(refused.run(() => undefined), (err: unknown) => err instanceof AuthError && err.status === 401);
    }
    // fetch scope without settle: the settles answer 403 and the worker stops.
    await gateway.publish("orders.auth.scope", "scope");
    const worker = new Worker({ url: gateway.url, token: "fetcher-9c1d", logger: recordingLogger() });
    await assert.rejects(worker.run(() => undefined), (err: unknown) => err instanceof AuthError && err.status === 403);
  } finally {
    await gateway.stop();
  }
});
