// The console (GET /console) in a real headless Chromium (Debian's `chromium`, started by
// playwright-core), with tokens on: it asks for a token; its consumers' table shows a
// message published meanwhile without a reload; a consumer's page draws its chart; a
// terminated message is shown in the dead letters with its payload, and sent back by the
// redrive buttons (dry run, then the run by a double click that asks once, followed to
// `done`). No request may leave the gateway's origin, and axe-core (pinned in package.json)
// finds no serious or critical violation on any of the three pages. The last page is the
// screenshot of docs/operations.md.
//
//     node console.mjs BASE NATS_PORT TOKEN ADMIN_TOKEN SCREENSHOT PROFILE_DIR
//
// BASE: the gateway (stream ORDERS, consumer `browser`, dead letters to dlq.orders); TOKEN:
// fetch, settle and publish; ADMIN_TOKEN: admin. The dead-letter stream (dlq.>) is made
// here, through nats-server's JetStream API on NATS_PORT. Started by scripts/browser.sh,
// after the other browser tests (it settles whatever the consumer still holds).
import { readFile } from "node:fs/promises";
import { createRequire } from "node:module";
import { connect } from "node:net";
import { launch } from "./chromium.mjs";

const [base, natsPort, token, adminToken, screenshot, profileDir] = process.argv.slice(2);
if (!profileDir) {
    console.error("usage: node console.mjs BASE NATS_PORT TOKEN ADMIN_TOKEN SCREENSHOT PROFILE_DIR");
    process.exit(2);
}
const STEP_MS = 15_000;
const started = Date.now();
const say = (text) => console.error(`console.mjs: ${text} (at ${((Date.now() - started) / 1000).toFixed(1)}s)`);

// ---- arranging, outside the browser ------------------------------------------------------

/// A JetStream API request over the NATS protocol itself: its JSON answer.
const jetstream = (subject, body) =>
    new Promise((resolve, reject) => {
        const socket = connect(Number(natsPort), "127.0.0.1");
        const inbox = `_INBOX.console${Date.now()}`;
        const payload = JSON.stringify(body);
        let buffer = "";
        const timer = setTimeout(() => {
            socket.destroy();
            reject(new Error(`no answer to ${subject}`));
        }, STEP_MS);
        socket.on("error", reject);
        socket.on("data", (chunk) => {
            buffer += chunk.toString("utf8");
            if (buffer.startsWith("INFO") && !socket.sent) {
                socket.sent = true;
                socket.write(`CONNECT {"verbose":false,"pedantic":false}\r\nSUB ${inbox} 1\r\n`);
                socket.write(`PUB ${subject} ${inbox} ${Buffer.byteLength(payload)}\r\n${payload}\r\n`);
            }
            const at = buffer.indexOf(`MSG ${inbox}`);
            if (at >= 0) {
                const lines = buffer.slice(at).split("\r\n");
                if (lines.length >= 3) {
                    clearTimeout(timer);
                    socket.destroy();
                    resolve(JSON.parse(lines[1]));
                }
            }
            if (buffer.includes("PING\r\n")) socket.write("PONG\r\n");
        });
    });

const call = async (method, path, body, bearer = token) => {
    const response = await fetch(`${base}${path}`, {
        method,
        headers: { Authorization: `Bearer ${bearer}`, "Content-Type": "application/json" },
        body: body === undefined ? undefined : JSON.stringify(body),
    });
    const text = await response.text();
    return { status: response.status, body: text ? JSON.parse(text) : null, headers: response.headers };
};

const until = async (what, probe) => {
    const deadline = Date.now() + STEP_MS;
    for (;;) {
        const value = await probe();
        if (value) return value;
        if (Date.now() > deadline) throw new Error(`no ${what} within ${STEP_MS} ms`);
        await new Promise((resolve) => setTimeout(resolve, 100));
    }
};

const made = await jetstream("$JS.API.STREAM.CREATE.DLQ", { name: "DLQ", subjects: ["dlq.>"] });
if (made.error) throw new Error(`making the dead-letter stream: ${JSON.stringify(made.error)}`);
const marker = `console ${Date.now()}`;
const published = await call("POST", "/publish", { subject: "orders.console", data: marker });
if (published.status !== 201) throw new Error(`publish: ${published.status}`);
// Whatever the consumer still holds from the other browser tests is acked; ours terminated.
await until("the message to terminate", async () => {
    const fetched = await call("POST", "/fetch", { batch: 100, wait_ms: 500, encoding: "utf8" });
    let found = false;
    for (const message of fetched.body.messages) {
        if (message.data === marker) {
            found = true;
            const termed = await call("POST", `/messages/${message.id}/term`, { reason: "malformed: console check" });
            if (termed.status !== 204) throw new Error(`term: ${termed.status}`);
        } else {
            await call("POST", `/messages/${message.id}/ack`);
        }
    }
    return found;
});
const letter = await until("the dead letter", async () => {
    const listed = await call("GET", "/dead-letters?consumer=browser&reason=terminated", undefined, adminToken);
    return listed.body.dead_letters.find((letter) => letter.term_reason === "malformed: console check");
});
say(`dead letter ${letter.id} made`);
const served = await fetch(`${base}/console`);
const policy = served.headers.get("content-security-policy") || "";
if (!policy.includes("default-src 'none'") || !policy.includes("connect-src 'self'")) {
    throw new Error(`the console's Content-Security-Policy is ${JSON.stringify(policy)}`);
}
if (served.headers.get("x-content-type-options") !== "nosniff" || served.headers.get("referrer-policy") !== "no-referrer") {
    throw new Error(`the console's nosniff/no-referrer headers: ${served.headers.get("x-content-type-options")}, ${served.headers.get("referrer-policy")}`);
}
const pageBytes = (await served.arrayBuffer()).byteLength;

// ---- the page ------------------------------------------------------------------------------

const axeSource = await readFile(createRequire(import.meta.url).resolve("axe-core/axe.min.js"), "utf8");
const problems = [];
const origin = new URL(base).origin;
// bypassCSP: only so that axe-core can be put into the page; the policy is checked above.
const context = await launch(profileDir, { bypassCSP: true });
let status = 1;
try {
    const page = context.pages()[0] ?? (await context.newPage());
    page.setDefaultTimeout(STEP_MS);
    page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
    let transferred = 0;
    let redrivesAsked = 0;
    page.on("request", (request) => {
        if (new URL(request.url()).origin !== origin) problems.push(`a request to elsewhere: ${request.url()}`);
        if (request.method() === "POST" && new URL(request.url()).pathname === "/dead-letters/redrive"
            && !JSON.parse(request.postData() || "{}").dry_run) redrivesAsked += 1;
    });
    page.on("response", async (response) => {
        const path = new URL(response.url()).pathname;
        if (path.startsWith("/console")) transferred += (await response.body().catch(() => Buffer.alloc(0))).length;
    });
    const accessible = async (where) => {
        await page.evaluate(axeSource);
        const violations = await page.evaluate(async () => (await window.axe.run(document)).violations
            .filter((violation) => ["serious", "critical"].includes(violation.impact))
            .map((violation) => `${violation.id} (${violation.impact}): ${violation.nodes.map((node) => node.target.join(" ")).join("; ")}`));
        if (violations.length) problems.push(`axe-core on ${where}: ${violations.join(" | ")}`);
        say(`axe-core on ${where}: ${violations.length} serious or critical`);
    };

    await page.goto(`${base}/console`);
    // Tokens are on: the page asks for one.
    await page.locator("#token-dialog").waitFor({ state: "visible" });
    await accessible("the token dialog");
    await page.fill("#token-input", adminToken);
    await page.click("#token-form button");
    // Closed, and not opened again by a poll that was sent before the token.
    await page.locator("#token-dialog").waitFor({ state: "hidden" });
    const row = page.locator('tr[data-consumer="ORDERS/browser"]');
    await row.waitFor();
    const pending = async () => Number((await row.locator("td").nth(3).innerText()).replace(/\D/g, "") || "0");
    const before = await pending();
    const another = await call("POST", "/publish", { subject: "orders.console", data: "live update" });
    if (another.status !== 201) throw new Error(`publish: ${another.status}`);
    await until("the consumers' table to show the publish", async () => (await pending()) === before + 1);
    say(`pending ${before} → ${before + 1} without a reload`);
    await accessible("the consumers");

    if (await page.locator("#token-dialog").isVisible()) throw new Error("the token dialog opened again");
    await page.click('tr[data-consumer="ORDERS/browser"] a');
    await page.locator("figure.chart svg polyline").first().waitFor();
    // The CSP (bypassed here for axe-core) would drop style attributes: there must be none,
    // and each legend swatch takes its colour from the stylesheet.
    const inline = await page.evaluate(() => [...document.querySelectorAll("[style]")].map((element) => element.outerHTML.slice(0, 80)));
    if (inline.length) problems.push(`style attributes, which the console's CSP refuses: ${inline.join(" | ")}`);
    const swatches = await page.evaluate(() => [...document.querySelectorAll("figure.chart .legend .swatch")].map((swatch) => getComputedStyle(swatch).backgroundColor));
    if (swatches.length !== 4 || swatches.some((colour) => colour === "rgba(0, 0, 0, 0)" || colour === "transparent")) {
        problems.push(`legend swatches without a colour: ${JSON.stringify(swatches)}`);
    }
    await page.locator("#seek-form").waitFor();
    await accessible("a consumer");

    await page.click('a[href="#/dead-letters"]');
    await page.getByRole("button", { name: `Show ${letter.id}` }).click();
    await until("the payload", async () => (await page.locator("#dead-letter-payload").innerText().catch(() => "")) === marker);
    await page.fill('#dead-letter-filters input[name="consumer"]', "browser");
    await page.selectOption('#dead-letter-filters select[name="reason"]', "terminated");
    await page.fill('#dead-letter-filters input[name="term_reason"]', "malformed*");
    await page.click("#dead-letter-filters button");
    await page.click('#redrive-form button[value="dry"]');
    await until("the dry run", async () => (await page.locator("#redrive-result").innerText()).startsWith("Would send back 1"));
    // A double click asks once: the buttons are disabled while the request is out.
    await page.dblclick('#redrive-form button[value="run"]');
    await until("the redrive to end", async () => / done, 1 of 1 published, 1 removed/.test(await page.locator("#redrive-result").innerText()));
    say(await page.locator("#redrive-result").innerText());
    if (redrivesAsked !== 1) problems.push(`a double click on Redrive sent ${redrivesAsked} redrives`);
    await accessible("the dead letters");
    await page.screenshot({ path: screenshot, fullPage: true });

    const left = await call("GET", "/dead-letters?consumer=browser&reason=terminated", undefined, adminToken);
    if (left.body.dead_letters.some((each) => each.id === letter.id)) problems.push(`${letter.id} is still a dead letter after the redrive`);
    say(`the page: ${pageBytes} bytes, its three files ${transferred} bytes`);
    if (transferred > 200_000) problems.push(`the console's files are ${transferred} bytes (more than 200 KB)`);
    status = problems.length ? 1 : 0;
} catch (error) {
    problems.push(`${error.stack || error}`);
} finally {
    await context.close();
}
for (const problem of problems) console.error(`console.mjs: ${problem}`);
process.exit(status);
