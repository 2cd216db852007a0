// Swagger UI at /docs driven as a person would, in a real headless Chromium (Debian's
// `chromium`, started by playwright-core, which downloads no browser): authorize with a bearer
// token, "Try it out" on POST /fetch and execute it, read the 200 and the lease id from the
// page, then "Try it out" on POST /messages/{id}/ack with that id, execute, read the 204.
// Every step fails loudly: the script stops at the first one that does not go as expected,
// saves a screenshot of the page as it stands, and exits non-zero.
//
//     node swagger-ui.mjs BASE TOKEN EXPECTED_DATA SCREENSHOT PROFILE_DIR
//
// BASE: the gateway (http://127.0.0.1:PORT), with one message published whose `data` is
// EXPECTED_DATA and nothing else waiting; TOKEN: a token with the fetch and settle scopes;
// SCREENSHOT: the PNG of the whole page to write, beside it one per operation
// (`-fetchMessages.png`, `-ackMessage.png`: the request and the page's answer), or, when a step
// fails, `-failed.png`;
// PROFILE_DIR: an empty folder for the browser profile. CHROMIUM_BIN: the browser
// (default /usr/bin/chromium). Started by scripts/browser.sh.
import { executablePath, launch } from "./chromium.mjs";

const [base, token, expectedData, screenshot, profileDir] = process.argv.slice(2);
if (!profileDir) {
    console.error("usage: node swagger-ui.mjs BASE TOKEN EXPECTED_DATA SCREENSHOT PROFILE_DIR");
    process.exit(2);
}
// What one step may take; a fetch answers at once here (a message is waiting).
const STEP_MS = 15_000;

const started = Date.now();
const say = (text) => console.error(`swagger-ui.mjs: ${text} (at ${((Date.now() - started) / 1000).toFixed(1)}s)`);
class StepFailed extends Error {}
const fail = (text) => {
    throw new StepFailed(text);
};

// The page's own problems: an uncaught exception, a console error, or a request to anywhere
// but the gateway (the page must work offline).
const problems = [];
const origin = new URL(base).origin;

const context = await launch(profileDir, {
    viewport: { width: 1280, height: 900 },
});
let page;
try {
    say(`Chromium ${context.browser()?.version() ?? "(version unknown)"} from ${executablePath}`);
    page = context.pages()[0] ?? (await context.newPage());
    page.setDefaultTimeout(STEP_MS);
    page.on("pageerror", (error) => problems.push(`uncaught exception on the page: ${error.message}`));
    page.on("console", (message) => {
        if (message.type() === "error") problems.push(`console error: ${message.text()}`);
    });
    await context.route("**/*", (route) => {
        const url = route.request().url();
        if (url.startsWith(origin + "/") || url.startsWith("data:") || url.startsWith("blob:")) {
            return route.continue();
        }
        problems.push(`the page asked for ${url} (it has to work offline)`);
        return route.abort();
    });

    // 1. The page, with the spec rendered.
    say(`open ${base}/docs`);
    const loaded = await page.goto(`${base}/docs`);
    if (loaded?.status() !== 200) fail(`GET /docs answered ${loaded?.status()}, not 200`);
    await page.locator(".swagger-ui .info .title").waitFor();
    const title = (await page.locator(".swagger-ui .info .title").innerText()).trim();
    say(`the spec is rendered: "${title.split("\n")[0]}"`);

    // 2. Authorize: the lock button, the bearer value, Authorize, Close; the lock then shows
    //    locked.
    say("Authorize with the bearer token");
    await page.locator("button.btn.authorize").first().click();
    const modal = page.locator(".dialog-ux .modal-ux");
    await modal.waitFor();
    // The bearer scheme's form (the stream ticket has one of its own).
    const bearer = modal.locator("form").filter({ hasText: "bearer (http, Bearer)" });
    await bearer.locator('input[aria-label="auth-bearer-value"]').fill(token);
    await bearer.locator('button[aria-label="Apply credentials"]').click();
    await bearer.locator('button[aria-label="Remove authorization"]').waitFor();
    await bearer.locator("button.btn-done").click();
    await modal.waitFor({ state: "detached" });
    if ((await page.locator("button.btn.authorize.locked").count()) === 0) {
        fail("the Authorize button does not show the lock closed after authorizing");
    }

    // A screenshot of one operation from its summary line down to "Server response": the
    // request as sent (curl, URL) and the answer as the page shows it.
    const shots = [];
    async function shootOperation(block, operationId) {
        const top = await block.boundingBox();
        const live = await block.locator(".live-responses-table").boundingBox();
        const scrollY = await page.evaluate(() => window.scrollY);
        const path = screenshot.replace(/\.png$/, "") + `-${operationId}.png`;
        await page.screenshot({
            path,
            fullPage: true,
            clip: { x: top.x, y: top.y + scrollY, width: top.width, height: live.y + live.height - top.y + 8 },
        });
        shots.push(path);
    }

    // Expand an operation, press "Try it out", optionally fill it in, press Execute, and
    // answer the status code and the body text the page shows under "Server response".
    async function tryItOut(operationId, fill) {
        const block = page.locator(`#operations-leases-${operationId}`);
        await block.waitFor();
        await block.locator(".opblock-summary").first().click();
        await block.locator("button.try-out__btn").click();
        await fill(block);
        await block.locator("button.execute").click();
        const status = block.locator(".live-responses-table .response .response-col_status");
        await status.waitFor();
        const code = (await status.innerText()).trim().split(/\s+/)[0];
        const bodies = block.locator(".live-responses-table .response-col_description .highlight-code .microlight");
        const body = (await bodies.count()) ? await bodies.first().innerText() : "";
        say(`${operationId}: the page shows ${code}${body ? ` with ${body.replace(/\s+/g, " ").slice(0, 300)}` : " and no body"}`);
        return { code, body, shoot: () => shootOperation(block, operationId) };
    }

    // 3. POST /fetch: one message, utf8, so the page shows the data that was published.
    say("POST /fetch: Try it out, execute");
    const fetched = await tryItOut("fetchMessages", async (block) => {
        await block.locator("textarea.body-param__text").fill(JSON.stringify({ batch: 1, encoding: "utf8", wait_ms: 5000 }, null, 2));
    });
    await fetched.shoot();
    if (fetched.code !== "200") fail(`POST /fetch: the page shows ${fetched.code}, not 200: ${fetched.body}`);
    let answer;
    try {
        answer = JSON.parse(fetched.body);
    } catch (error) {
        fail(`POST /fetch: the page's response body is not JSON (${error.message}): ${fetched.body}`);
    }
    const messages = answer.messages;
    if (!Array.isArray(messages) || messages.length !== 1) {
        fail(`POST /fetch: expected exactly one message on the page, got ${JSON.stringify(answer)}`);
    }
    const [message] = messages;
    if (message.data !== expectedData) {
        fail(`POST /fetch: the message's data is ${JSON.stringify(message.data)}, not the published ${JSON.stringify(expectedData)}`);
    }
    const id = message.id;
    if (typeof id !== "string" || id.length < 16) fail(`POST /fetch: no lease id in ${JSON.stringify(message)}`);
    say(`POST /fetch: 200, lease id ${id}`);

    // 4. POST /messages/{id}/ack with that id.
    say("POST /messages/{id}/ack: Try it out with the lease id, execute");
    const acked = await tryItOut("ackMessage", async (block) => {
        await block.locator('tr[data-param-name="id"] input').fill(id);
    });
    await acked.shoot();
    if (acked.code !== "204") fail(`POST /messages/{id}/ack: the page shows ${acked.code}, not 204: ${acked.body}`);
    const url = (await page.locator("#operations-leases-ackMessage .request-url pre").innerText()).trim();
    if (!url.endsWith(`/messages/${encodeURIComponent(id)}/ack`)) {
        fail(`POST /messages/{id}/ack: the page called ${url}, not the lease's ack`);
    }
    say("POST /messages/{id}/ack: 204");

    if (problems.length) fail(`the page had problems:\n  ${problems.join("\n  ")}`);

    await page.screenshot({ path: screenshot, fullPage: true });
    say(`screenshots: ${[screenshot, ...shots].join(", ")}`);
} catch (error) {
    const failedShot = screenshot.replace(/\.png$/, "") + "-failed.png";
    if (page) {
        await page.screenshot({ path: failedShot, fullPage: true }).then(
            () => say(`screenshot of the failure: ${failedShot}`),
            (shotError) => say(`no screenshot of the failure: ${shotError.message}`),
        );
    }
    if (problems.length && !(error instanceof StepFailed && error.message.startsWith("the page had problems"))) {
        say(`the page also had problems:\n  ${problems.join("\n  ")}`);
    }
    say(`FAILED: ${error instanceof StepFailed ? error.message : error.stack}`);
    process.exitCode = 1;
} finally {
    await context.close();
}
