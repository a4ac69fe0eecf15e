// The status page: every worker from GET /v1/status (read every POLL_MS), its rates and
// latency over the last minute from the differences between reads, and a fill-in-the-
// middle playground that streams llama.cpp's native /infill (or /completion, for a model
// without FIM) into place. Plain script, no build step, nothing fetched from elsewhere.
"use strict";

const POLL_MS = 1500;
const MAX_POLL_MS = 30000;    // reads that fail wait twice as long each time, to this
const WINDOW_MS = 60000;
const history = [];           // [{t, workers: {name: worker}}], the last WINDOW_MS
let models = {};

const $ = (id) => document.getElementById(id);

function keyHeaders(key = $("key").value.trim()) {
  return key ? { Authorization: "Bearer " + key } : {};
}

// -- status ---------------------------------------------------------------------------
// The status reads send the key field's value once it is applied (Enter, or leaving the
// field), never while it is typed: every read sent the key typed so far, and a refused
// read is logged. A read refused for its key stops the reads until the key changes;
// one that fails otherwise waits twice as long each time.
let statusKey = "";
let pollDelay = POLL_MS;
let refused = false;
let reading = false;
let timer = null;

function schedule(ms) {
  clearTimeout(timer);
  timer = setTimeout(poll, ms);
}

async function poll() {
  timer = null;
  if (reading) return;                 // (one read at a time)
  reading = true;
  const key = statusKey;
  try {
    const response = await fetch("/v1/status", { cache: "no-store", headers: keyHeaders(key) });
    const status = await response.json();
    if (key !== statusKey) return;     // the key changed meanwhile: read again with it
    if (response.status === 401 || response.status === 403) {
      refused = true;
      $("summary").textContent = "status needs a key: " +
        (status.error ? status.error.message : response.status) +
        " (type it above and press Enter)";
      return;
    }
    if (!response.ok) throw new Error(status.error ? status.error.message : response.status);
    pollDelay = POLL_MS;
    record(status);
    render(status);
  } catch (err) {
    if (key === statusKey) {
      pollDelay = Math.min(2 * pollDelay, MAX_POLL_MS);
      $("summary").textContent = "status unavailable: " + err.message;
    }
  } finally {
    reading = false;
    if (key !== statusKey) schedule(0);
    else if (!refused) schedule(pollDelay);
  }
}

$("key").addEventListener("change", () => {
  const key = $("key").value.trim();
  if (key === statusKey) return;
  statusKey = key;
  refused = false;
  pollDelay = POLL_MS;
  if (!reading) schedule(0);           // (a read in flight reads again when it ends)
});

function record(status) {
  const now = status.time * 1000;
  const workers = {};
  for (const w of status.workers) workers[w.name] = w;
  history.push({ t: now, workers });
  while (history.length > 2 && now - history[0].t > WINDOW_MS) history.shift();
  models = status.models || {};
}

// The value of `field` per second between two reads of a worker (null: not both there)
function rate(older, newer, name, field) {
  const a = older.workers[name], b = newer.workers[name];
  if (!a || !b || newer.t <= older.t) return null;
  return Math.max(0, b[field] - a[field]) / ((newer.t - older.t) / 1000);
}

// A quantile of the time to first token from the difference of two histograms (bucket
// counts, the last one +Inf), interpolated within its bucket as Prometheus does.
function quantile(older, newer, q) {
  if (!newer || !newer.counts) return null;
  let counts = newer.counts.map((c, i) => c - (older && older.counts ? older.counts[i] : 0));
  // (a count that went down: the dispatcher restarted between the reads, its histogram
  // begun again; the newer read alone is the window's)
  if (counts.some((c) => c < 0)) counts = newer.counts.slice();
  const total = counts.reduce((a, b) => a + b, 0);
  if (total <= 0) return null;
  let seen = 0;
  for (let i = 0; i < counts.length; i++) {
    if (seen + counts[i] >= q * total && counts[i] > 0) {
      const low = i === 0 ? 0 : newer.buckets[i - 1];
      const high = i < newer.buckets.length ? newer.buckets[i] : low;
      return low + (high - low) * ((q * total - seen) / counts[i]);
    }
    seen += counts[i];
  }
  return newer.buckets[newer.buckets.length - 1];
}

function spark(series, cls) {
  const values = series.filter((v) => v !== null);
  if (values.length < 2) return "";
  const max = Math.max(...values, 1e-9);
  const points = series.map((v, i) => v === null ? null :
    `${(i / (series.length - 1)) * 120},${24 - (v / max) * 22 - 1}`).filter(Boolean);
  return `<polyline class="${cls}" points="${points.join(" ")}"/>`;
}

// A worker being started again says why it was lost (stuck: the watchdog; lost: it died
// or stopped answering), from its last loss
function stateOf(w) {
  if ((w.state === "restarting" || w.state === "starting") && w.last_lost) {
    return `${w.state} (${w.last_lost.code === "worker_stuck" ? "stuck" : "lost"})`;
  }
  return w.state;
}

function text(value, digits, unit) {
  return value === null || value === undefined ? "–" : value.toFixed(digits) + unit;
}

function render(status) {
  const first = history[0], last = history[history.length - 1];
  const tbody = $("workers").querySelector("tbody");
  tbody.textContent = "";
  const restarts = [];
  for (const w of status.workers) {
    const tokens = history.slice(1).map((h, i) => rate(history[i], h, w.name, "generated_tokens"));
    const p50s = history.map((h) => quantile(first.workers[w.name] && first.workers[w.name].ttft,
      h.workers[w.name] && h.workers[w.name].ttft, 0.5));
    const p95s = history.map((h) => quantile(first.workers[w.name] && first.workers[w.name].ttft,
      h.workers[w.name] && h.workers[w.name].ttft, 0.95));
    const perSecond = rate(first, last, w.name, "generated_tokens");
    const old = first.workers[w.name] || w;
    const drafted = w.drafted_tokens - (old.drafted_tokens || 0);
    const kept = w.accepted_tokens - (old.accepted_tokens || 0);
    const row = document.createElement("tr");
    row.dataset.worker = w.name;
    row.innerHTML = `
      <td class="name"></td><td class="device"></td><td class="model"></td>
      <td class="state ${w.state}">${stateOf(w)}</td>
      <td class="slots">${w.busy} / ${w.slots}</td>
      <td class="queue">${(status.queue || {})[w.model] || 0}</td>
      <td><span class="figure tokens">${text(perSecond, 1, "")}</span>
          <svg class="spark" viewBox="0 0 120 24">${spark(tokens, "")}</svg></td>
      <td><span class="figure ttft">${text(p50s[p50s.length - 1], 3, " s")} /
          ${text(p95s[p95s.length - 1], 3, " s")}</span>
          <svg class="spark" viewBox="0 0 120 24">${spark(p50s, "")}${spark(p95s, "p95")}</svg></td>
      <td class="drafts">${drafted > 0 ? `${kept} of ${drafted}` : "–"}</td>
      <td class="restarts">${w.restarts}</td>`;
    row.querySelector(".name").textContent = w.name;         // (names: text, not markup)
    row.querySelector(".device").textContent = w.device || "";
    row.querySelector(".model").textContent = w.model || "";
    tbody.appendChild(row);
    if (w.last_lost) restarts.push(`${w.name}: ${w.last_lost.reason}` +
      (w.last_lost.code ? ` (${w.last_lost.code})` : "") + `, ${w.last_lost.ago_s} s ago`);
  }
  const list = $("restarts");
  list.textContent = "";
  for (const line of restarts.length ? restarts : ["none"]) {
    const item = document.createElement("li");
    item.textContent = line;
    if (!restarts.length) item.className = "none";
    list.appendChild(item);
  }
  const ready = status.workers.filter((w) => w.state === "idle" || w.state === "busy").length;
  $("summary").textContent = `${ready} of ${status.workers.length} workers ready, ` +
    `${status.frontends} front end(s), updated ${new Date(status.time * 1000).toLocaleTimeString()}`;
  const select = $("model");
  const names = Object.keys(models);
  if (select.options.length !== names.length) {
    select.textContent = "";
    for (const name of names) select.add(new Option(name, name));
  }
}

// -- playground -----------------------------------------------------------------------
async function complete() {
  const model = $("model").value;
  const fim = models[model] && models[model].fim;
  const prefix = $("prefix").value, suffix = $("suffix").value;
  const common = { model, n_predict: Number($("max-tokens").value),
                   temperature: Number($("temperature").value), stream: true };
  const route = fim ? "/infill" : "/completion";
  const body = fim ? { ...common, input_prefix: prefix, input_suffix: suffix }
                   : { ...common, prompt: prefix };
  const result = $("result");
  result.querySelector(".before").textContent = prefix;
  result.querySelector(".after").textContent = fim ? suffix : "";
  $("middle").textContent = "";
  $("error").textContent = "";
  $("figures").textContent = "";
  $("note").textContent = fim ? "" : "This model has no fill-in-the-middle tokens (and " +
    "no --fim-template): the text before the cursor is completed alone.";
  $("raw-request").textContent = `POST ${route}\n` + JSON.stringify(body, null, 2);
  $("raw-events").textContent = "";
  $("complete").disabled = true;
  const started = performance.now();
  let first = null, pieces = 0;
  try {
    const response = await fetch(route, { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json", ...keyHeaders() } });
    if (!response.ok) {
      const answer = await response.json().catch(() => ({}));
      throw new Error(answer.error ? answer.error.message : `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const frame = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!frame.startsWith("data: ")) continue;
        $("raw-events").textContent += frame + "\n\n";
        const event = JSON.parse(frame.slice(6));
        if (event.error) throw new Error(event.error.message);
        if (event.content) {
          if (first === null) first = performance.now();
          pieces += 1;
          $("middle").textContent += event.content;
        }
        if (event.stop && event.timings) {
          const t = event.timings;
          $("figures").textContent =
            `TTFT ${first === null ? "–" : ((first - started) / 1000).toFixed(3) + " s"}, ` +
            `${(t.predicted_per_second || 0).toFixed(1)} tokens/s, ` +
            `${t.predicted_n} tokens, drafted ${t.draft_n || 0}, accepted ${t.draft_n_accepted || 0}`;
        }
      }
    }
  } catch (err) {
    $("error").textContent = err.message;
  } finally {
    $("complete").disabled = false;
  }
}

$("complete").addEventListener("click", complete);
poll();
