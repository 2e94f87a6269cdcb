// The status page's script: reads the admin listener's JSON endpoints and writes the page.
// Every value is set as text (never parsed as HTML): key values and errors may come from clients.
"use strict";

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else if (name.startsWith("data-")) node.setAttribute(name, value);
    else node[name] = value;
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

async function getJson(path, options) {
  const response = await fetch(path, Object.assign({ cache: "no-store" }, options || {}));
  const text = await response.text();
  let body = null;
  try { body = text ? JSON.parse(text) : null; } catch (e) { body = { error: text }; }
  return { ok: response.ok, status: response.status, body };
}

function duration(seconds) {
  seconds = Math.round(seconds);
  const d = Math.floor(seconds / 86400), h = Math.floor(seconds % 86400 / 3600);
  const m = Math.floor(seconds % 3600 / 60), s = seconds % 60;
  return (d ? d + "d " : "") + (d || h ? h + "h " : "") + (d || h || m ? m + "m " : "") + s + "s";
}

function when(unix) {
  return unix ? new Date(unix * 1000).toISOString().replace("T", " ").replace(/\.\d+Z$/, " UTC") : "never";
}

// ---- instance -------------------------------------------------------------------------------
let showKeyValues = false;

async function refreshInstance() {
  const { ok, body } = await getJson("/status/instance");
  if (!ok) return;
  $("version").textContent = "v" + body.version;
  const store = $("store");
  store.textContent = body.store.type + (body.store.ready ? " · ready" : " · unavailable") +
    (body.draining ? " · draining" : "");
  store.className = "pill " + (body.store.ready && !body.draining ? "ok" : "bad");
  $("uptime").textContent = duration(body.uptime_seconds);
  $("config-source").textContent = body.config.source;
  $("config-sha").textContent = body.config.sha256;
  $("config-loaded").textContent = when(body.config.loaded_at_unix);
  const error = body.last_reload.error;
  $("reload").textContent = body.last_reload.attempt_unix
    ? when(body.last_reload.attempt_unix) + (error ? " · failed, the previous config still serves" : " · applied")
    : "none since start";
  $("reload-error").hidden = !error;
  $("reload-error").textContent = error || "";
  showKeyValues = body.show_key_values;
}

// ---- routes and live decisions --------------------------------------------------------------
let routes = [];
let previous = null; // { at, counts: { "route\u0000policy": {allowed, limited, ...} } }

function rate(now, before, label, seconds) {
  if (!before || seconds <= 0) return "–";
  const r = ((now[label] || 0) - (before[label] || 0)) / seconds;
  return r.toFixed(r >= 10 ? 0 : 1);
}

async function refreshRoutes() {
  const { ok, body } = await getJson("/status/routes");
  if (!ok) return;
  const at = performance.now();
  const seconds = previous ? (at - previous.at) / 1000 : 0;
  const counts = {};
  const tbody = $("routes").tBodies[0];
  const rows = [];
  for (const route of body.routes) {
    const extra = [route.action];
    if (route.quota_endpoint) extra.push("quota endpoint " + route.quota_endpoint);
    rows.push(el("tr", { class: "route", "data-route": route.name },
      el("td", {}, route.order), el("td", {}, route.name),
      el("td", { class: "mono", colSpan: 2 }, route.match), el("td", { colSpan: 7 }, extra.join(" · "))));
    for (const p of route.policies) {
      const id = route.name + "\u0000" + p.name;
      counts[id] = p.decisions;
      const before = previous && previous.counts[id];
      const d = p.decisions;
      const failed = { failed: (d.failed_open || 0) + (d.failed_closed || 0) };
      const failedBefore = before && { failed: (before.failed_open || 0) + (before.failed_closed || 0) };
      rows.push(el("tr", { class: "policy", "data-route": route.name, "data-policy": p.name },
        el("td", {}, ""), el("td", {}, p.name + (p.shared ? " (shared)" : "")),
        el("td", {}, p.algorithm + " · " + p.limit + (p.cost !== 1 ? " · cost " + p.cost : "")),
        el("td", { class: "mono" }, p.key.join(" + ")), el("td", {}, p.mode),
        el("td", { class: "num rate-allowed" }, rate(d, before, "allowed", seconds)),
        el("td", { class: "num rate-limited" }, rate(d, before, "limited", seconds)),
        el("td", { class: "num rate-shadow" }, rate(d, before, "shadow", seconds)),
        el("td", { class: "num rate-failed" }, rate(failed, failedBefore, "failed", seconds)),
        el("td", { class: "num total-allowed" }, d.allowed),
        el("td", { class: "num total-limited" }, d.limited)));
    }
  }
  tbody.replaceChildren(...rows);
  previous = { at, counts };
  const changed = JSON.stringify(routes.map((r) => [r.name, r.policies.map((p) => p.name)])) !==
    JSON.stringify(body.routes.map((r) => [r.name, r.policies.map((p) => p.name)]));
  routes = body.routes;
  if (changed) fillRouteSelects();
  $("refreshed").textContent = "updated " + new Date().toLocaleTimeString();
}

// ---- top limited keys -----------------------------------------------------------------------
async function refreshTop() {
  const { ok, body } = await getJson("/debug/top-limited?n=20");
  if (!ok) return;
  const period = body.current;
  $("top-period").textContent = "this period: " + period.limited + " limited in " +
    duration(period.seconds) + (showKeyValues ? "" : " · keys shown as digests");
  const rows = period.keys.map((k) => el("tr", { "data-route": k.route, "data-policy": k.policy },
    el("td", {}, k.route), el("td", {}, k.policy), el("td", { class: "mono" }, k.key),
    el("td", { class: "num" }, k.error ? k.count + " (±" + k.error + ")" : k.count)));
  $("top").tBodies[0].replaceChildren(...rows);
  $("top-empty").hidden = rows.length > 0;
}

// ---- overrides ------------------------------------------------------------------------------
function limitsText(o) {
  if (o.limit !== undefined && o.limit !== null) return "limit " + o.limit;
  return [o.rate ? "rate " + o.rate : "", o.burst ? "burst " + o.burst : ""].filter(Boolean).join(", ");
}

function overridePath(route, policy, key) {
  // The key is the rest of the path, percent-decoded by the API: `/` inside it stays `%2F`.
  return "/overrides/" + encodeURIComponent(route) + "/" + encodeURIComponent(policy) + "/" +
    encodeURIComponent(key);
}

function showOverrideResult(ok, text) {
  $("override-message").hidden = !ok;
  $("override-message").textContent = ok ? text : "";
  $("override-error").hidden = ok;
  $("override-error").textContent = ok ? "" : text;
}

async function refreshOverrides() {
  const { ok, body } = await getJson("/overrides");
  if (!ok) return;
  $("overrides-count").textContent = body.active + " active of at most " + body.max;
  const rows = body.overrides.map((o) => {
    const cells = [el("td", {}, o.route), el("td", {}, o.policy), el("td", { class: "mono" }, o.key),
      el("td", {}, limitsText(o)), el("td", {}, o.source), el("td", {}, o.active ? "yes" : "no")];
    const action = el("td", {});
    if (o.source === "api") {
      const button = el("button", { class: "delete", type: "button", textContent: "Delete" });
      button.addEventListener("click", () => deleteOverride(o));
      action.append(button);
    }
    return el("tr", { class: "override", "data-route": o.route, "data-policy": o.policy, "data-key": o.key },
      ...cells, action);
  });
  $("overrides").tBodies[0].replaceChildren(...rows);
}

async function setOverride(event) {
  event.preventDefault();
  const body = {};
  const limit = $("ov-limit").value.trim(), rateText = $("ov-rate").value.trim();
  const burst = $("ov-burst").value.trim();
  if (limit) body.limit = Number(limit);
  if (rateText) body.rate = rateText;
  if (burst) body.burst = Number(burst);
  const route = $("ov-route").value, policy = $("ov-policy").value, key = $("ov-key").value.trim();
  const { ok, status, body: answer } = await getJson(overridePath(route, policy, key), {
    method: "PUT", headers: { "content-type": "application/json" }, body: JSON.stringify(body),
  });
  showOverrideResult(ok, ok ? "Set " + route + "/" + policy + "/" + key + "." :
    status + ": " + ((answer && (answer.error || answer.message)) || "refused"));
  refreshOverrides();
}

async function deleteOverride(o) {
  const { ok, status, body } = await getJson(overridePath(o.route, o.policy, o.key), { method: "DELETE" });
  showOverrideResult(ok, ok ? "Deleted " + o.route + "/" + o.policy + "/" + o.key + "." :
    status + ": " + ((body && (body.error || body.message)) || "refused"));
  refreshOverrides();
}

// ---- route pickers and the lookup -----------------------------------------------------------
function fillPolicies(select, routeName) {
  const route = routes.find((r) => r.name === routeName);
  select.replaceChildren(...(route ? route.policies : []).map((p) => el("option", { value: p.name, textContent: p.name })));
}

function fillPeekKeys() {
  const route = routes.find((r) => r.name === $("peek-route").value);
  const inputs = (route ? route.policies : []).map((p) => el("label", {}, p.name + " (" + p.key.join(" | ") + ")",
    el("input", { class: "peek-key", "data-policy": p.name, placeholder: p.key.join("|") })));
  $("peek-keys").replaceChildren(...inputs);
}

function fillRouteSelects() {
  for (const id of ["ov-route", "peek-route"]) {
    const select = $(id), current = select.value;
    select.replaceChildren(...routes.map((r) => el("option", { value: r.name, textContent: r.name })));
    if (routes.some((r) => r.name === current)) select.value = current;
  }
  fillPolicies($("ov-policy"), $("ov-route").value);
  fillPeekKeys();
}

async function peek(event) {
  event.preventDefault();
  const keys = {};
  for (const input of document.querySelectorAll("input.peek-key")) {
    if (input.value.trim()) keys[input.dataset.policy] = input.value.trim();
  }
  const { ok, status, body } = await getJson("/status/peek", {
    method: "POST", headers: { "content-type": "application/json" },
    body: JSON.stringify({ route: $("peek-route").value, keys }),
  });
  $("peek-error").hidden = ok;
  $("peek-error").textContent = ok ? "" : status + ": " + ((body && body.error) || "refused");
  $("peek").hidden = !ok;
  if (!ok) return;
  const rows = body.policies.map((p) => el("tr", { class: "peeked", "data-policy": p.policy },
    el("td", {}, p.policy), el("td", {}, p.algorithm), el("td", {}, p.mode),
    ...(p.applies ? [
      el("td", { class: "num limit" }, p.limit + (p.overridden ? " (override)" : "")),
      el("td", { class: "num remaining" }, p.remaining),
      el("td", { class: "num reset" }, p.reset_seconds + "s"),
      el("td", { class: "next" }, p.next_allowed ? "allowed" : "refused, retry in " + p.retry_after_seconds + "s"),
    ] : [el("td", { colSpan: 4, class: "muted" }, "no key value given: not looked up")])));
  $("peek").tBodies[0].replaceChildren(...rows);
}

// ---- start ----------------------------------------------------------------------------------
function every(ms, task) {
  const run = () => task().catch(() => {}).finally(() => setTimeout(run, ms));
  run();
}

document.addEventListener("DOMContentLoaded", () => {
  $("ov-route").addEventListener("change", () => fillPolicies($("ov-policy"), $("ov-route").value));
  $("peek-route").addEventListener("change", fillPeekKeys);
  $("override-form").addEventListener("submit", setOverride);
  $("peek-form").addEventListener("submit", peek);
  every(5000, refreshInstance);
  every(1000, refreshRoutes);
  every(2000, refreshTop);
  every(5000, refreshOverrides);
});
