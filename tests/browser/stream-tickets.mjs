// A browser's streams, in a real headless Chromium (Debian's `chromium`, started by
// playwright-core): a page of another origin (http://127.0.0.1:PAGE_PORT, served by this
// script) asks the gateway for a stream ticket with its
// bearer token (a CORS request, preflighted), opens an EventSource with the ticket and takes one
// lease; then publishes a second message, opens a WebSocket with a second ticket, takes one
// lease and acks it in band (a `settled` frame with 204), and acks the EventSource's lease over
// HTTP (204). The page's own problems and any request to anywhere but the gateway and the page
// fail the test.
//
//     node stream-tickets.mjs BASE TOKEN PAGE_PORT PROFILE_DIR
//
// The EventSource's lease is acked only once the WebSocket's is settled: acked before, it
// would free the EventSource's credit while the gateway may not yet have seen that stream
// closed (the browser's close and the ack leave at the same moment, in either order), and the
// second message could be leased to the closed stream, written into its dying connection and
// held for ack_wait. Held at 1 live lease, that stream can take nothing.
//
// BASE: the gateway (http://127.0.0.1:PORT), started with --cors-allow-origin
// http://127.0.0.1:PAGE_PORT and with two messages waiting; TOKEN: a token with the fetch and settle
// scopes; PROFILE_DIR: an empty folder for the browser profile. CHROMIUM_BIN: the browser
// (default /usr/bin/chromium). Started by scripts/browser.sh.
import { createServer } from "node:http";
import { launch } from "./chromium.mjs";

const [base, token, pagePort, profileDir] = process.argv.slice(2);
if (!profileDir) {
    console.error("usage: node stream-tickets.mjs BASE TOKEN PAGE_PORT PROFILE_DIR");
    process.exit(2);
}
// The page's own origin, on loopback like the gateway (Chromium asks before a page of a
// public origin may reach a loopback address).
const PAGE = `http://127.0.0.1:${pagePort}`;
const pageServer = createServer((_, response) => {
    response.writeHead(200, { "Content-Type": "text/html" });
    response.end("<!doctype html><title>stream tickets</title><p>app</p>");
});
await new Promise((resolve) => pageServer.listen(Number(pagePort), "127.0.0.1", resolve));
const STEP_MS = 15_000;

const started = Date.now();
const say = (text) => console.error(`stream-tickets.mjs: ${text} (at ${((Date.now() - started) / 1000).toFixed(1)}s)`);

const problems = [];
const gatewayOrigin = new URL(base).origin;
const context = await launch(profileDir);
let status = 1;
try {
    const page = context.pages()[0] ?? (await context.newPage());
    page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
    page.on("console", (message) => {
        if (message.type() === "error") problems.push(`console error: ${message.text()}`);
    });
    page.on("request", (request) => {
        const origin = new URL(request.url()).origin;
        const wsOrigin = gatewayOrigin.replace(/^http/, "ws");
        if (![gatewayOrigin, wsOrigin, PAGE].includes(origin)) {
            problems.push(`a request to elsewhere: ${request.url()}`);
        }
    });
    await page.goto(`${PAGE}/`);
    say(`page at ${PAGE}, gateway at ${base}`);
    const outcome = await page.evaluate(
        async ({ base, token, stepMs }) => {
            const within = (promise, what) =>
                Promise.race([
                    promise,
                    new Promise((_, reject) => setTimeout(() => reject(new Error(`no ${what} within ${stepMs} ms`)), stepMs)),
                ]);
            const auth = { Authorization: `Bearer ${token}` };
            const newTicket = async () => {
                const answer = await fetch(`${base}/stream-tickets`, {
                    method: "POST",
                    headers: { ...auth, "Content-Type": "application/json" },
                    body: "{}",
                });
                if (answer.status !== 200) throw new Error(`POST /stream-tickets: ${answer.status} ${await answer.text()}`);
                return answer.json();
            };
            // EventSource: a lease, acked over HTTP once the WebSocket's is settled.
            const first = await newTicket();
            const source = new EventSource(`${base}${first.events}&encoding=utf8&max_in_flight=1`);
            const lease = await within(
                new Promise((resolve, reject) => {
                    source.addEventListener("message", (event) => resolve(JSON.parse(event.data)));
                    source.onerror = () => reject(new Error("the EventSource failed"));
                }),
                "lease over the EventSource",
            );
            source.close();
            // The second message only now: published while the EventSource was open, it would
            // be its stream's to lease if its credit allowed (it does not: its lease is live).
            const published = await fetch(`${base}/publish`, {
                method: "POST",
                headers: { ...auth, "Content-Type": "application/json" },
                body: JSON.stringify({ subject: "orders.browser", data: "streamed 2" }),
            });
            if (published.status !== 201) throw new Error(`POST /publish: ${published.status} ${await published.text()}`);
            // WebSocket: a lease, acked in band. What happened on the socket, with times, is
            // kept for the error should no `settled` frame come.
            const second = await newTicket();
            const opened = Date.now();
            const seen = [];
            const saw = (what) => seen.push(`${Date.now() - opened}ms ${what}`);
            const socket = new WebSocket(`${base.replace(/^http/, "ws")}${second.ws}&encoding=utf8`);
            const settled = await within(
                new Promise((resolve, reject) => {
                    const failed = (why) => reject(new Error(why));
                    socket.onopen = () => saw("open");
                    socket.onerror = () => failed("the WebSocket failed");
                    socket.onclose = (event) => failed(`the WebSocket closed (${event.code} ${event.reason})`);
                    socket.onmessage = (event) => {
                        const frame = JSON.parse(event.data);
                        saw(`${frame.type} frame${frame.type === "message" ? ` (stream_sequence ${frame.stream_sequence})` : ""}`);
                        if (frame.type === "message") {
                            socket.send(JSON.stringify({ op: "ack", ids: [frame.id] }));
                            saw("ack sent");
                        }
                        if (frame.type === "settled") resolve({ frame, data: frame.results[0].id });
                    };
                }),
                "settled frame over the WebSocket",
            ).catch((error) => {
                throw new Error(`${error.message}; on the socket: ${seen.join(", ") || "nothing"}`);
            });
            socket.onclose = null;
            socket.close();
            const acked = await fetch(`${base}/messages/${lease.id}/ack`, { method: "POST", headers: auth });
            return { sse: { data: lease.data, ackStatus: acked.status }, ws: settled.frame };
        },
        { base, token, stepMs: STEP_MS },
    );
    say(`outcome: ${JSON.stringify(outcome)}`);
    if (outcome.sse.ackStatus !== 204) throw new Error(`the EventSource's lease acked ${outcome.sse.ackStatus}, not 204`);
    if (outcome.ws.results?.[0]?.status !== 204) throw new Error(`the WebSocket's lease settled ${JSON.stringify(outcome.ws)}`);
    if (problems.length) throw new Error(`the page had problems: ${problems.join("; ")}`);
    say("passed: EventSource and WebSocket opened with tickets, a message settled over each");
    status = 0;
} catch (error) {
    say(`FAILED: ${error.message}`);
    if (problems.length) say(`problems seen: ${problems.join("; ")}`);
} finally {
    await context.close();
    pageServer.close();
}
process.exit(status);
