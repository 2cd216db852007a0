// The console: a thin client of the gateway's documented API, served from the binary. It
// reads the consumers (every second), a consumer's activity and the dead letters, and calls
// redrive and seek as any client would. With authentication on it asks for a token and keeps
// it in this page's memory only. Every value from the API is put into the page as text.
"use strict";

const POLL_MS = 1000;
const MAX_ROWS = 100;
let token = null;
let pollTimer = null;
let view = null;

const main = document.getElementById("main");
const statusLine = document.getElementById("status");

// ---- the API --------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, problem) {
    super((problem && (problem.detail || problem.title)) || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(method, path, body) {
  const headers = { Accept: "application/json" };
  const sentWith = token;
  if (sentWith) headers.Authorization = `Bearer ${sentWith}`;
  const init = { method, headers };
  if (body !== undefined) {
    headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const response = await fetch(path, init);
  const text = await response.text();
  let json = null;
  try {
    json = text ? JSON.parse(text) : null;
  } catch (_) {
    json = null;
  }
  // A 401 to an earlier token (a poll sent before one was entered) asks nothing.
  if (response.status === 401 && sentWith === token) askForToken();
  if (!response.ok) throw new ApiError(response.status, json);
  return json;
}

function askForToken() {
  const dialog = document.getElementById("token-dialog");
  if (!dialog.open) dialog.showModal();
}

document.getElementById("token-form").addEventListener("submit", () => {
  const input = document.getElementById("token-input");
  token = input.value.trim() || null;
  input.value = "";
  render();
});

// ---- building the page ----------------------------------------------------------------

// An element with attributes (`on…` are listeners) and children (strings become text).
function h(tag, attributes, ...children) {
  const element = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) element.addEventListener(name.slice(2), value);
    else element.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null) continue;
    element.append(child instanceof Node ? child : String(child));
  }
  return element;
}

function svg(tag, attributes, ...children) {
  const element = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes || {})) element.setAttribute(name, String(value));
  for (const child of children.flat()) element.append(child instanceof Node ? child : String(child));
  return element;
}

function say(text, isError) {
  statusLine.textContent = text;
  statusLine.className = isError ? "error" : "";
}

function errorText(error) {
  return error instanceof ApiError ? `${error.status}: ${error.message}` : String(error.message || error);
}

function number(value) {
  return value === undefined || value === null ? "—" : Number(value).toLocaleString("en");
}

function field(label, input) {
  return h("label", {}, label, input);
}

function formValues(form) {
  const values = {};
  for (const [name, value] of new FormData(form).entries()) {
    if (typeof value === "string" && value.trim() !== "") values[name] = value.trim();
  }
  return values;
}

function consumerPath(stream, consumer) {
  return `/streams/${encodeURIComponent(stream)}/consumers/${encodeURIComponent(consumer)}`;
}

// ---- views ----------------------------------------------------------------------------

// A view draws its frame once and refreshes its live parts every second.
function render() {
  if (pollTimer) clearInterval(pollTimer);
  const route = location.hash.replace(/^#/, "") || "/";
  const parts = route.split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "dead-letters") view = deadLettersView();
  else if (parts[0] === "consumers" && parts.length === 3) view = consumerView(parts[1], parts[2]);
  else view = consumersView();
  main.replaceChildren(...view.frame);
  const refresh = async () => {
    try {
      await view.refresh();
      say(`Updated ${new Date().toLocaleTimeString("en")}`);
    } catch (error) {
      say(errorText(error), true);
    }
  };
  refresh();
  pollTimer = setInterval(refresh, POLL_MS);
}

function consumersView() {
  const body = h("tbody");
  const columns = ["Stream", "Consumer", "Source", "Pending", "Ack pending", "Redelivered", "Leases in flight", "Dead letters (15 min)", "Push"];
  const numeric = new Set(["Pending", "Ack pending", "Redelivered", "Leases in flight", "Dead letters (15 min)"]);
  const table = h("table", { id: "consumers" },
    h("caption", { class: "visually-hidden" }, "Consumers served by this gateway"),
    h("thead", {}, h("tr", {}, columns.map((name) => h("th", { scope: "col", class: numeric.has(name) ? "number" : null }, name)))),
    body);
  return {
    frame: [h("h2", {}, "Consumers"), table],
    async refresh() {
      const listing = await api("GET", "/consumers");
      // Each row asks two questions a second: the first hundred consumers get them.
      const shown = listing.consumers.slice(0, MAX_ROWS);
      const rows = await Promise.all(shown.map(async (served) => {
        const path = consumerPath(served.stream, served.name);
        let state = null;
        let deadLetters = null;
        if (served.bound) {
          [state, deadLetters] = await Promise.all([
            api("GET", path).catch(() => null),
            api("GET", `${path}/history`)
              .then((history) => history.buckets.reduce((sum, bucket) => sum + bucket.dead_lettered, 0))
              .catch(() => null),
          ]);
        }
        const cells = [
          served.stream,
          h("a", { href: `#/consumers/${encodeURIComponent(served.stream)}/${encodeURIComponent(served.name)}` }, served.name),
          served.source,
          state ? state.num_pending : null,
          state ? state.num_ack_pending : null,
          state ? state.num_redelivered : null,
          served.leases_in_flight,
          deadLetters,
          state && state.push ? state.push.state : "—",
        ];
        return h("tr", { "data-consumer": `${served.stream}/${served.name}` },
          cells.map((cell, at) => numeric.has(columns[at]) ? h("td", { class: "number" }, number(cell)) : h("td", {}, cell ?? "—")));
      }));
      if (listing.consumers.length > shown.length) {
        rows.push(h("tr", {}, h("td", { colspan: columns.length }, `… and ${listing.consumers.length - shown.length} more (GET /consumers lists them all).`)));
      }
      body.replaceChildren(...rows);
    },
  };
}

// Each series' colour: the line's stroke here, its legend swatch a class in console.css
// (`.swatch-<key>`; the page's CSP forbids style attributes). Keep the two the same.
const SERIES = [
  ["delivered", "Deliveries", "#0b4f9c"],
  ["acked", "Acks", "#1d5f2a"],
  ["naked", "Naks", "#8a5a00"],
  ["dead_lettered", "Dead letters", "#9b1c1c"],
];

function chart(history) {
  const width = 760;
  const height = 180;
  const pad = 28;
  const buckets = history.buckets;
  const top = Math.max(1, ...buckets.flatMap((bucket) => SERIES.map(([key]) => bucket[key])));
  const x = (at) => pad + (at * (width - 2 * pad)) / Math.max(1, 89);
  const y = (value) => height - pad - (value * (height - 2 * pad)) / top;
  const totals = SERIES.map(([key, label]) => `${label}: ${buckets.reduce((sum, bucket) => sum + bucket[key], 0)}`);
  const start = 90 - buckets.length;
  return h("figure", { class: "chart" },
    svg("svg", { viewBox: `0 0 ${width} ${height}`, role: "img", "aria-label": `Last 15 minutes in 10-second buckets. ${totals.join(", ")}.` },
      svg("line", { x1: pad, y1: height - pad, x2: width - pad, y2: height - pad, stroke: "#767676" }),
      svg("text", { x: 2, y: pad, "font-size": 11, fill: "#1b1b1b" }, String(top)),
      svg("text", { x: pad, y: height - 8, "font-size": 11, fill: "#1b1b1b" }, "−15 min"),
      svg("text", { x: width - pad - 24, y: height - 8, "font-size": 11, fill: "#1b1b1b" }, "now"),
      SERIES.map(([key, , colour]) => svg("polyline", {
        fill: "none",
        stroke: colour,
        "stroke-width": 2,
        points: buckets.map((bucket, at) => `${x(start + at).toFixed(1)},${y(bucket[key]).toFixed(1)}`).join(" "),
      }))),
    h("figcaption", {}, h("ul", { class: "legend" }, SERIES.map(([key], at) =>
      h("li", { "data-series": key }, h("span", { class: `swatch swatch-${key}` }), totals[at])))));
}

function consumerView(stream, consumer) {
  const path = consumerPath(stream, consumer);
  const stats = h("dl", { class: "stats" });
  const chartBox = h("div", {});
  const pushBox = h("div", {});
  const durabilityBox = h("section", { "aria-label": "Durability" });
  const seekResult = h("output", { id: "seek-result", "aria-live": "polite" });
  const seekForm = h("form", { class: "row", id: "seek-form" },
    field("Move to", h("select", { name: "kind" },
      h("option", { value: "sequence" }, "a stream sequence"),
      h("option", { value: "time" }, "a time (RFC 3339)"),
      h("option", { value: "beginning" }, "the stream's beginning"),
      h("option", { value: "end" }, "the stream's end"))),
    field("Sequence or time", h("input", { name: "value", placeholder: "1204 or 2026-12-02T03:00:00Z" })),
    h("button", { type: "submit", class: "secondary", value: "dry" }, "Dry run"),
    h("button", { type: "submit", value: "seek" }, "Seek"));
  seekForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const values = formValues(seekForm);
    const body = { dry_run: event.submitter && event.submitter.value === "dry" };
    if (values.kind === "sequence") body.sequence = Number(values.value);
    else if (values.kind === "time") body.time = values.value;
    else body.position = values.kind;
    try {
      const moved = await api("POST", `${path}/seek`, body);
      seekResult.className = "ok";
      seekResult.textContent = `${moved.dry_run ? "Would move" : "Moved"} to sequence ${moved.sequence}: delivers ${moved.redelivers} again, skips ${moved.skips}.`;
    } catch (error) {
      seekResult.className = "error";
      seekResult.textContent = errorText(error);
    }
  });
  const pushAction = async (action) => {
    try {
      await api("POST", `${path}/push/${action}`);
      say(`Push ${action}d`);
    } catch (error) {
      say(errorText(error), true);
    }
  };
  return {
    frame: [
      h("h2", {}, `${stream} / ${consumer}`),
      stats,
      h("h3", {}, "Last 15 minutes at this replica"),
      durabilityBox,
      chartBox,
      pushBox,
      h("h3", {}, "Rewind or fast-forward"),
      h("p", {}, "A seek voids the consumer's live leases; a dry run only says what it would do."),
      seekForm,
      seekResult,
      h("p", {}, h("a", { href: `#/dead-letters?consumer=${encodeURIComponent(consumer)}` }, "This consumer's dead letters")),
    ],
    async refresh() {
      const [state, history] = await Promise.all([api("GET", path), api("GET", `${path}/history`)]);
      const entries = [
        ["Pending", state.num_pending],
        ["Ack pending", state.num_ack_pending],
        ["Redelivered", state.num_redelivered],
        ["Leases in flight", state.leases_in_flight],
        ["Waiting pulls", state.num_waiting],
        ["Replicas", state.replicas.length],
        ["ack_wait", state.config.ack_wait],
        ["max_ack_pending", state.config.max_ack_pending],
      ];
      stats.replaceChildren(...entries.map(([label, value]) =>
        h("div", {}, h("dt", {}, label), h("dd", {}, typeof value === "number" ? number(value) : String(value ?? "—")))));
      const durability = state.durability;
      durabilityBox.replaceChildren(
        h("h3", {}, `Durability: ${durability.promise}`),
        h("p", {}, `stream R${durability.stream_replicas}, consumer R${durability.consumer_replicas}, ` +
          `${durability.storage} storage, server sync ${durability.server_sync}, settled records R${durability.settled_record_replicas}`),
        h("ul", {}, ...durability.warnings.map((warning) => h("li", {}, warning))));
      chartBox.replaceChildren(chart(history));
      if (state.push) {
        const push = state.push;
        pushBox.replaceChildren(
          h("h3", {}, "Push"),
          h("p", {}, `${push.url} — ${push.state}, window ${push.window}, ${push.in_flight} in flight` +
            (push.last_failure ? `; last failure ${push.last_failure.at}: ${push.last_failure.status ?? push.last_failure.error}` : "")),
          h("button", { type: "button", class: "secondary", onclick: () => pushAction("pause") }, "Pause"),
          " ",
          h("button", { type: "button", class: "secondary", onclick: () => pushAction("resume") }, "Resume"));
      } else {
        pushBox.replaceChildren();
      }
    },
  };
}

const FILTERS = ["stream", "consumer", "reason", "term_reason", "since", "until"];

function deadLettersView() {
  const preset = new URLSearchParams(location.hash.split("?")[1] || "");
  const input = (name, label, placeholder) => field(label, h("input", { name, value: preset.get(name) || "", placeholder }));
  const filterForm = h("form", { class: "row", id: "dead-letter-filters" },
    input("stream", "Stream"),
    input("consumer", "Consumer"),
    field("Reason", h("select", { name: "reason" },
      h("option", { value: "" }, "any"),
      h("option", { value: "max_deliveries" }, "max_deliveries"),
      h("option", { value: "terminated" }, "terminated"))),
    input("term_reason", "Term reason", "malformed*"),
    input("since", "Since (RFC 3339)"),
    input("until", "Until (RFC 3339)"),
    field("Order", h("select", { name: "order" }, h("option", { value: "newest" }, "newest first"), h("option", { value: "oldest" }, "oldest first"))),
    h("button", { type: "submit" }, "List"));
  const list = h("tbody");
  const more = h("p", {});
  const detail = h("section", { "aria-label": "The dead letter shown" });
  const redriveForm = h("form", { class: "row", id: "redrive-form" },
    field("To subject (empty: its own)", h("input", { name: "to_subject" })),
    field("Rate (messages/s)", h("input", { name: "rate", type: "number", min: 1, max: 10000, value: 1000 })),
    h("button", { type: "submit", class: "secondary", value: "dry" }, "Dry run"),
    h("button", { type: "submit", value: "run" }, "Redrive"));
  const redriveResult = h("output", { id: "redrive-result", "aria-live": "polite" });
  const task = { id: null, state: null };
  let cursor = null;

  const filters = () => {
    const values = formValues(filterForm);
    const chosen = {};
    for (const name of FILTERS) if (values[name]) chosen[name] = values[name];
    return { chosen, order: values.order || "newest" };
  };

  const show = async (id) => {
    try {
      const letter = await api("GET", `/dead-letters/${encodeURIComponent(id)}?encoding=utf8`);
      detail.replaceChildren(
        h("h3", {}, `Dead letter ${letter.id}`),
        h("p", {}, `${letter.stream} / ${letter.consumer}, stream sequence ${letter.stream_sequence}, subject ${letter.subject}, ${letter.deliveries} deliveries, ${letter.reason}${letter.term_reason ? ` (${letter.term_reason})` : ""}`),
        h("h4", {}, `Payload (${letter.encoding})`),
        h("pre", { id: "dead-letter-payload" }, letter.data),
        h("h4", {}, "Headers"),
        h("pre", {}, JSON.stringify(letter.headers, null, 2)));
    } catch (error) {
      detail.replaceChildren(h("p", { class: "error" }, errorText(error)));
    }
  };

  const load = async (from) => {
    const { chosen, order } = filters();
    const query = new URLSearchParams({ ...chosen, order, limit: "50" });
    if (from) query.set("cursor", from);
    const page = await api("GET", `/dead-letters?${query}`);
    const rows = page.dead_letters.map((letter) => h("tr", {},
      h("td", {}, h("button", { type: "button", class: "secondary", onclick: () => show(letter.id), "aria-label": `Show ${letter.id}` }, letter.id)),
      h("td", {}, `${letter.stream} / ${letter.consumer}`),
      h("td", {}, letter.reason),
      h("td", {}, letter.term_reason ?? "—"),
      h("td", {}, letter.subject),
      h("td", {}, letter.dead_lettered_at)));
    if (from) list.append(...rows);
    else list.replaceChildren(...rows);
    cursor = page.next;
    more.replaceChildren(cursor ? h("button", { type: "button", class: "secondary", onclick: () => load(cursor).catch((error) => say(errorText(error), true)) }, "More") : "No more.");
    if (!from && rows.length === 0) list.replaceChildren(h("tr", {}, h("td", { colspan: 6 }, "No dead letters match.")));
  };

  filterForm.addEventListener("submit", (event) => {
    event.preventDefault();
    load(null).catch((error) => say(errorText(error), true));
  });

  const cancelButton = h("button", { type: "button", class: "secondary", hidden: true, onclick: async () => {
    try {
      await api("DELETE", `/dead-letters/redrive/${encodeURIComponent(task.id)}`);
    } catch (error) {
      say(errorText(error), true);
    }
  } }, "Cancel the redrive");

  redriveForm.addEventListener("submit", async (event) => {
    event.preventDefault();
    const values = formValues(redriveForm);
    const body = { ...filters().chosen, rate: Number(values.rate || 1000), dry_run: event.submitter && event.submitter.value === "dry" };
    if (values.to_subject) body.to_subject = values.to_subject;
    // One request at a time: a double click must not ask for the same redrive twice.
    const buttons = [...redriveForm.querySelectorAll("button")];
    for (const button of buttons) button.disabled = true;
    try {
      const answer = await api("POST", "/dead-letters/redrive", body);
      if (body.dry_run) {
        redriveResult.className = "ok";
        redriveResult.textContent = `Would send back ${answer.matched}` +
          (answer.dead_letters.length ? `, first: ${answer.dead_letters.map((letter) => letter.id).join(", ")}` : "") + ".";
      } else {
        task.id = answer.task;
        task.state = "running";
        redriveResult.className = "ok";
        redriveResult.textContent = `Task ${answer.task}: ${answer.matched} to send back …`;
        cancelButton.hidden = false;
      }
    } catch (error) {
      redriveResult.className = "error";
      redriveResult.textContent = errorText(error);
    } finally {
      for (const button of buttons) button.disabled = false;
    }
  });

  return {
    frame: [
      h("h2", {}, "Dead letters"),
      filterForm,
      h("table", { id: "dead-letters" },
        h("caption", { class: "visually-hidden" }, "Dead letters matching the filters"),
        h("thead", {}, h("tr", {}, ["Id", "Consumer", "Reason", "Term reason", "Subject", "Dead-lettered at"].map((name) => h("th", { scope: "col" }, name)))),
        list),
      more,
      detail,
      h("h3", {}, "Send them back"),
      h("p", {}, "A redrive takes the dead letters the filters above match (all of them when none is set), publishes each back once, and removes it after its publish was confirmed."),
      redriveForm,
      redriveResult,
      cancelButton,
    ],
    first: true,
    async refresh() {
      if (this.first) {
        this.first = false;
        await load(null);
      }
      if (task.id && task.state === "running") {
        const now = await api("GET", `/dead-letters/redrive/${encodeURIComponent(task.id)}`);
        task.state = now.state;
        redriveResult.className = now.state === "failed" ? "error" : "ok";
        redriveResult.textContent = `Task ${now.task}: ${now.state}, ${now.published} of ${now.matched} published, ${now.removed} removed, ${now.failed} failed` +
          (now.last_error ? ` (last error: ${now.last_error})` : "") + ".";
        if (now.state !== "running") {
          cancelButton.hidden = true;
          await load(null);
        }
      }
    },
  };
}

window.addEventListener("hashchange", render);
render();
