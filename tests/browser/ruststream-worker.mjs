// The TypeScript worker library (clients/typescript, npm `ruststream`) in a real headless
// Chromium (Debian's `chromium`, started by playwright-core), as a browser app uses it: a page
// of another origin (http://127.0.0.1:PAGE_PORT, served by this script) loads the package's
// ESM build as it is (BUNDLE_DIR, served under /ruststream/, named `ruststream` by an import
// map: no bundler), and runs `new Worker({ url, token, transport: "ws" }).run(handler)` with
// the bearer token. A browser's WebSocket cannot send Authorization, so the library must ask
// `POST /stream-tickets` with the token and open `/ws?ticket=…`. N messages published here
// beforehand are handled, acked by the worker in band over that WebSocket, and the worker is
// stop()ped. Asserted from outside: every message handled exactly once (delivery 1) and acked
// once in band (a `settled` frame with 204 for each), one WebSocket whose URL holds a ticket
// and not the token (no URL the page asked for does), and GET /consumer afterwards shows
// num_pending 0, num_ack_pending 0 and leases_in_flight 0. The page's own problems (its
// errors, the worker's warnings, a file of the build it could not load) and any request to
// anywhere but the gateway and the page fail the test.
//
//     node ruststream-worker.mjs BASE TOKEN ADMIN_TOKEN PAGE_PORT BUNDLE_DIR PROFILE_DIR
//
// BASE: the gateway (http://127.0.0.1:PORT), started with --cors-allow-origin
// http://127.0.0.1:PAGE_PORT, its default consumer holding nothing; TOKEN: fetch, settle and
// publish; ADMIN_TOKEN: admin (GET /consumer); BUNDLE_DIR: the package built by tsc (its
// dist/); PROFILE_DIR: an empty folder for the browser profile. CHROMIUM_BIN: the browser
// (default /usr/bin/chromium). Started by scripts/browser.sh.
import { readFile } from "node:fs/promises";
import { createServer } from "node:http";
import { join, normalize } from "node:path";
import { launch } from "./chromium.mjs";

const [base, token, adminToken, pagePort, bundleDir, profileDir] = process.argv.slice(2);
if (!profileDir) {
    console.error("usage: node ruststream-worker.mjs BASE TOKEN ADMIN_TOKEN PAGE_PORT BUNDLE_DIR PROFILE_DIR");
    process.exit(2);
}
/** Messages published and handled. */
const COUNT = 50;
/** The worker's credit and handlers, below COUNT: settles in band must make room for more leases. */
const MAX_IN_FLIGHT = 10;
const CONCURRENCY = 4;
const STEP_MS = 15_000;

const started = Date.now();
const say = (text) => console.error(`ruststream-worker.mjs: ${text} (at ${((Date.now() - started) / 1000).toFixed(1)}s)`);
const problems = [];

// ---- the page's origin: an HTML page and the package's build -----------------------------

const PAGE = `http://127.0.0.1:${pagePort}`;
// What an app's page does: the package's name mapped to its ESM entry (package.json
// "exports": "." -> dist/index.js), the rest of the build reached by its relative imports.
const html = `<!doctype html>
<title>ruststream worker</title>
<link rel="icon" href="data:,">
<script type="importmap">{"imports": {"ruststream": "/ruststream/index.js"}}</script>
<script type="module">
import { Worker } from "ruststream";

// Runs a worker on the gateway's default consumer until it acked \`count\` messages, then
// stops it; what it handled and logged.
window.consume = async ({ base, token, count, maxInFlight, concurrency, stepMs }) => {
    const handled = [];
    const log = { debug: [], info: [], warn: [], error: [] };
    const logger = Object.fromEntries(Object.keys(log).map((level) => [level, (text) => log[level].push(String(text))]));
    const worker = new Worker({ url: base, token, transport: "ws", maxInFlight, concurrency, logger });
    const running = worker.run(async (message) => {
        handled.push({ id: message.id, text: message.text(), delivered: message.delivered });
        // A handler that awaits something, so several run at once.
        await new Promise((resolve) => setTimeout(resolve, 5));
    });
    let runEnded = false;
    running.then(() => (runEnded = true), () => (runEnded = true));
    const deadline = Date.now() + stepMs;
    while (worker.stats.acked < count) {
        if (runEnded) break;
        if (Date.now() > deadline) {
            await worker.stop();
            throw new Error(\`the worker acked \${worker.stats.acked} of \${count} within \${stepMs} ms (\${JSON.stringify(worker.stats)})\`);
        }
        await new Promise((resolve) => setTimeout(resolve, 20));
    }
    await worker.stop();
    await running;
    return { handled, stats: worker.stats, inFlight: worker.inFlight, log };
};
window.ready = true;
</script>
<p>worker</p>`;

const bundleRoot = normalize(bundleDir);
const TYPES = { ".js": "text/javascript", ".map": "application/json" };
const pageServer = createServer(async (request, response) => {
    const path = new URL(request.url, PAGE).pathname;
    if (path === "/") {
        response.writeHead(200, { "Content-Type": "text/html" });
        response.end(html);
        return;
    }
    const file = normalize(join(bundleRoot, path.replace(/^\/ruststream\//, "")));
    const type = TYPES[file.slice(file.lastIndexOf("."))];
    if (path.startsWith("/ruststream/") && file.startsWith(bundleRoot + "/") && type !== undefined) {
        try {
            const body = await readFile(file);
            response.writeHead(200, { "Content-Type": type });
            response.end(body);
            return;
        } catch {
            // not in the build: 404 below
        }
    }
    problems.push(`the page asked for ${path}, which the page's server does not have`);
    response.writeHead(404);
    response.end();
});
await new Promise((resolve) => pageServer.listen(Number(pagePort), "127.0.0.1", resolve));

// ---- the gateway, from outside -----------------------------------------------------------

const call = async (method, path, body, bearer = token) => {
    const headers = { Authorization: `Bearer ${bearer}` };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(`${base}${path}`, {
        method,
        headers,
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(STEP_MS),
    });
    const text = await response.text();
    return { status: response.status, body: text ? JSON.parse(text) : undefined };
};
const consumerState = async () => {
    const answer = await call("GET", "/consumer", undefined, adminToken);
    if (answer.status !== 200) throw new Error(`GET /consumer: ${answer.status} ${JSON.stringify(answer.body)}`);
    const { num_pending, num_ack_pending, leases_in_flight } = answer.body;
    return { num_pending, num_ack_pending, leases_in_flight };
};

const context = await launch(profileDir);
let status = 1;
try {
    const before = await consumerState();
    if (before.num_pending !== 0 || before.num_ack_pending !== 0 || before.leases_in_flight !== 0) {
        throw new Error(`the consumer is not empty before the test (the tests before left it so): ${JSON.stringify(before)}`);
    }
    const run = `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`;
    const published = [];
    for (let i = 0; i < COUNT; i++) {
        const data = `browser worker ${run} #${i}`;
        const answer = await call("POST", "/publish", { subject: "orders.browser-worker", data });
        if (answer.status !== 201) throw new Error(`POST /publish: ${answer.status} ${JSON.stringify(answer.body)}`);
        published.push(data);
    }
    say(`published ${COUNT} messages`);

    const page = context.pages()[0] ?? (await context.newPage());
    page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
    let consumerRefused = 0;
    page.on("console", (message) => {
        if (message.type() !== "error") return;
        // The worker reads the consumer's ordering_key with GET /consumer, which needs the
        // admin scope this token lacks: the library takes the 403 as "unordered", and Chromium
        // logs the failed load. Any other error is a problem.
        const at = message.location().url;
        if (at === `${base}/consumer` && message.text().includes("403")) {
            consumerRefused += 1;
            return;
        }
        problems.push(`console error: ${message.text()} (${at})`);
    });
    const gatewayOrigin = new URL(base).origin;
    const wsOrigin = gatewayOrigin.replace(/^http/, "ws");
    const ticketRequests = [];
    page.on("request", (request) => {
        const url = request.url();
        if (![gatewayOrigin, wsOrigin, PAGE].includes(new URL(url).origin)) problems.push(`a request to elsewhere: ${url}`);
        if (url.includes(token)) problems.push(`the token in a URL: ${url}`);
        if (request.method() === "POST" && url === `${base}/stream-tickets`) ticketRequests.push(request.headers()["authorization"]);
    });
    // Every WebSocket the page opens, with the operations sent and the answers read on it.
    const sockets = [];
    page.on("websocket", (socket) => {
        const seen = { url: socket.url(), acked: [], settled: [], leases: 0 };
        sockets.push(seen);
        socket.on("framesent", ({ payload }) => {
            const frame = JSON.parse(String(payload));
            if (frame.op === "ack") seen.acked.push(...frame.ids);
            else problems.push(`a ${frame.op} sent over the WebSocket: ${String(payload)}`);
        });
        socket.on("framereceived", ({ payload }) => {
            const frame = JSON.parse(String(payload));
            if (frame.type === "message") seen.leases += 1;
            // frames=batch: the leases ready together in one frame.
            if (frame.type === "messages") seen.leases += frame.messages.length;
            if (frame.type === "settled") seen.settled.push(...frame.results);
        });
    });

    await page.goto(`${PAGE}/`);
    await page.waitForFunction(() => window.ready === true, null, { timeout: STEP_MS });
    say(`page at ${PAGE} loaded the package from ${bundleDir}; gateway at ${base}`);
    const outcome = await page.evaluate((args) => window.consume(args), {
        base,
        token,
        count: COUNT,
        maxInFlight: MAX_IN_FLIGHT,
        concurrency: CONCURRENCY,
        stepMs: STEP_MS,
    });
    say(`worker stopped: stats ${JSON.stringify(outcome.stats)}, in flight ${outcome.inFlight}; GET /consumer refused it (403, unordered) ${consumerRefused} time(s)`);
    const after = await consumerState();
    say(`GET /consumer: ${JSON.stringify(after)}`);

    // Each published message handled once, at its first delivery; nothing else.
    const texts = outcome.handled.map((each) => each.text).sort();
    if (JSON.stringify(texts) !== JSON.stringify([...published].sort())) {
        const counts = new Map();
        for (const text of texts) counts.set(text, (counts.get(text) ?? 0) + 1);
        const twice = [...counts].filter(([, n]) => n > 1).map(([text]) => text);
        const missing = published.filter((text) => !counts.has(text));
        const foreign = texts.filter((text) => !published.includes(text));
        throw new Error(`handled ${texts.length} for ${COUNT} published: twice ${JSON.stringify(twice)}, never ${JSON.stringify(missing)}, not ours ${JSON.stringify(foreign)}`);
    }
    const redelivered = outcome.handled.filter((each) => each.delivered !== 1);
    if (redelivered.length) throw new Error(`handled at a later delivery: ${JSON.stringify(redelivered)}`);
    const { stats } = outcome;
    if (stats.received !== COUNT || stats.acked !== COUNT || stats.naked || stats.termed || stats.reconnects || Object.keys(stats.settleFailures).length) {
        throw new Error(`the worker's stats: ${JSON.stringify(stats)}`);
    }
    if (outcome.inFlight !== 0) throw new Error(`the worker still holds ${outcome.inFlight} leases after stop()`);
    const confirmed = outcome.log.debug.filter((line) => / confirmed \(204\)$/.test(line) && line.includes(": ack of "));
    if (confirmed.length !== COUNT) throw new Error(`${confirmed.length} acks logged as confirmed, not ${COUNT}`);
    if (outcome.log.warn.length || outcome.log.error.length) {
        problems.push(`the worker logged: ${JSON.stringify({ warn: outcome.log.warn, error: outcome.log.error })}`);
    }

    // One WebSocket, opened with a ticket asked for with the token, every ack in band on it.
    if (sockets.length !== 1) throw new Error(`${sockets.length} WebSockets opened, not 1: ${JSON.stringify(sockets.map((each) => each.url))}`);
    const [socket] = sockets;
    const url = new URL(socket.url);
    // The ticket's own `ws` path: the default consumer's route by its names.
    if (url.origin !== wsOrigin || !["/ws", "/streams/ORDERS/consumers/browser/ws"].includes(url.pathname)) {
        throw new Error(`the WebSocket went to ${socket.url}`);
    }
    if (!url.searchParams.get("ticket")) throw new Error(`the WebSocket's URL has no ticket: ${socket.url}`);
    if (socket.url.includes(token)) throw new Error(`the WebSocket's URL carries the token: ${socket.url}`);
    if (url.searchParams.get("max_in_flight") !== String(MAX_IN_FLIGHT)) throw new Error(`the WebSocket's credit is not ${MAX_IN_FLIGHT}: ${socket.url}`);
    if (ticketRequests.length !== 1 || ticketRequests[0] !== `Bearer ${token}`) {
        throw new Error(`POST /stream-tickets asked ${ticketRequests.length} times, Authorization ${JSON.stringify(ticketRequests)}`);
    }
    const ids = outcome.handled.map((each) => each.id).sort();
    if (socket.leases !== COUNT) throw new Error(`${socket.leases} leases came over the WebSocket, not ${COUNT}`);
    if (JSON.stringify([...socket.acked].sort()) !== JSON.stringify(ids)) {
        throw new Error(`acked in band ${socket.acked.length} ids, not each handled lease once`);
    }
    const notDone = socket.settled.filter((result) => result.status !== 204);
    if (socket.settled.length !== COUNT || notDone.length) {
        throw new Error(`${socket.settled.length} settled results, not ${COUNT} of 204: ${JSON.stringify(notDone)}`);
    }

    if (after.num_pending !== 0 || after.num_ack_pending !== 0 || after.leases_in_flight !== 0) {
        throw new Error(`GET /consumer after stop(): ${JSON.stringify(after)}, not all 0`);
    }
    if (problems.length) throw new Error(`the page had problems: ${problems.join("; ")}`);
    say(`passed: ${COUNT} messages handled once and acked in band over a WebSocket opened with a ticket (${url.pathname}?ticket=…)`);
    status = 0;
} catch (error) {
    say(`FAILED: ${error.message}`);
    if (problems.length) say(`problems seen: ${problems.join("; ")}`);
} finally {
    await context.close();
    pageServer.close();
}
process.exit(status);
