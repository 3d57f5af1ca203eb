// trainguard dashboard: a hash router over the read-only JSON routes, redrawn every
// POLL_MS without reloading. Values a test compares carry data-k (key) and data-v (raw
// value); text is built with textContent only (names come from users: never as HTML).
"use strict";
const POLL_MS = 2000;
const ROWS = 12; // checkpoint rows on the run page (the API has them all)
const view = document.getElementById("view");
let timer = null;
let generation = 0; // a newer route cancels the older one's pending redraw

// The token set in the footer goes with every read too: a service with
// TRAINGUARD_READ_TOKEN answers its read routes only to that token or the admin token.
async function getJSON(path) {
  const headers = { Accept: "application/json" };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const r = await fetch(path, { headers });
  const body = await r.json();
  if (r.status === 401 || r.status === 403) {
    throw new Error(`${(body.error && body.error.message) || r.statusText}: this service needs ` +
      "its read token (or the admin token) for every page; set it with \"set token\" below");
  }
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

// ------------------------------------------------------------------ pages

async function overview() {
  const [ds, runs, health, quarantined] = await Promise.all([getJSON("/admin/datasets"),
    getJSON("/admin/runs"), getJSON("/admin/health"), getJSON("/admin/nodes")]);
  const pillClass = (s) => (s === "OK" ? "ok" : s === "WARN" ? "warn" : "bad");
  return [
    h("h1", {}, "Overview"),
    card("GPU health", health.nodes.length ? table(["node", "status", "GPUs", "problems"],
      health.nodes.map((n) => h("tr", { "data-node": n.node }, h("td", {}, n.node),
        h("td", {}, h("span", { class: "pill " + pillClass(n.status), "data-k": "node_status",
          "data-v": n.status }, n.status)),
        h("td", {}, n.gpus.map((g) => h("span", { class: "pill " + pillClass(g.status),
          "data-k": `gpu_status:${g.gpu}`, "data-v": g.status,
          title: Object.entries(g.readings).map(([k, v]) => `${k}=${v}`).join(" ") },
        `gpu ${g.gpu} ${g.status}` + ("temperature_celsius" in g.readings
          ? ` ${g.readings.temperature_celsius}°C` : "")))),
        h("td", {}, n.gpus.flatMap((g) => g.problems.map((p) => `gpu ${g.gpu} ${p}`)).join("; ")
          || n.reason || "–"))))
      : h("p", { class: "muted" }, "no probes configured (TRAINGUARD_PROBES=node=http://host:port)")),
    card("Quarantined nodes", quarantined.nodes.length ? table(
      ["node", "source", "reason", "since", "expires in", ""],
      quarantined.nodes.map((n) => h("tr", { "data-quarantined": n.node }, h("td", {}, n.node),
        cell("source", n.source, n.source), cell("reason", n.reason, n.reason),
        cell("created_at", n.created_at, fmtAgo(n.created_at)),
        cell("remaining_s", n.remaining_s, fmtS(n.remaining_s)),
        h("td", {}, h("button", { type: "button", onclick: () => clearNode(n.node) }, "clear")))))
      : h("p", { class: "muted" }, "no quarantined nodes")),
    card("Datasets", ds.datasets.length ? table(
      ["dataset", "format", "partitions", "records", "paused", "dead letters", "groups"],
      ds.datasets.map((d) => h("tr", { "data-dataset": d.name },
        h("td", {}, h("a", { href: `#/dataset/${encodeURIComponent(d.name)}` }, d.name)),
        h("td", {}, d.spec ? d.spec.format : "?"),
        cell("partitions", d.partitions), cell("length", d.length), cell("paused", d.paused),
        cell("dead_letters", d.dead_letters), h("td", {}, (d.groups || []).join(", ")))))
      : h("p", { class: "muted" }, "no datasets")),
    card("Runs", runs.runs.length ? table(
      ["run", "dataset", "store", "last step", "last commit", "gen", "restarts", "rollbacks",
        "lag", "interval now", "recommended"],
      runs.runs.map((r) => h("tr", { "data-run": r.run, "data-dataset": r.dataset },
        h("td", {}, h("a", { href: `#/run/${encodeURIComponent(r.run)}?dataset=${encodeURIComponent(r.dataset)}` }, r.run)),
        h("td", {}, r.dataset), h("td", {}, r.store || "–"),
        cell("last_step", r.last_step), cell("last_commit_at", r.last_commit_at, fmtAgo(r.last_commit_at)),
        cell("generation", r.generation), cell("restarts", r.restarts), cell("rollbacks", r.rollbacks),
        cell("lag", r.lag), cell("current_s", r.current_s, fmtS(r.current_s)),
        cell("recommended_s", r.recommended_s, fmtS(r.recommended_s)))))
      : h("p", { class: "muted" }, "no runs"),
      // /admin/runs is paged: the overview shows the first page and says so.
      runs.total > runs.runs.length
        ? h("p", { class: "muted" }, `showing ${runs.runs.length} of ${runs.total} runs`) : "",
      ...Object.entries(runs.store_errors || {}).map(([store, why]) =>
        h("p", { class: "pill bad", "data-store-error": store }, `store ${store}: ${why}`))),
  ];
}

const COLORS = ["#2563eb", "#16a34a", "#9333ea", "#0891b2", "#d97706", "#db2777"];

async function datasetPage(name) {
  const d = await getJSON(`/admin/datasets/${encodeURIComponent(name)}/detail`);
  const groups = d.groups;
  const lagBars = groups.map((g, gi) => card(`Lag of ${g.group} per partition`,
    h("div", { class: "stats" }, stat("group_lag", g.lag, undefined, "entries not yet delivered")),
    bars(g.partitions.map((p) => ({ label: `p${p.partition}`, value: p.lag || 0,
      color: COLORS[gi % COLORS.length], title: `partition ${p.partition}: lag ${fmtInt(p.lag)}` })),
    { label: `lag of ${g.group}`, fmt: fmtInt })));
  const tp = d.throughput;
  const series = [{ name: "produced", color: "#111827",
    points: tp.map((s) => [s.at, s.produced_per_s]) }].concat(groups.map((g, i) => ({
    name: g.group, color: COLORS[i % COLORS.length],
    points: tp.map((s) => [s.at, (s.read_per_s[g.group] || 0)]) })));
  return [
    h("h1", {}, `Dataset ${d.name}`),
    h("section", { class: "card stats" },
      stat("length", d.length, undefined, "records in Redis"),
      stat("partitions", d.partitions.length, undefined, "partitions"),
      stat("paused", d.paused, undefined, "paused (backpressure)"),
      stat("dead_letters", d.dead_letters.count, undefined, "dead letters"),
      stat("finished", d.producer.finished ? 1 : 0, d.producer.finished ? "yes" : "no", "producer finished")),
    h("div", { class: "grid" }, lagBars,
      card("Throughput (records/s)", lineChart(series, { label: "throughput", fmt: fmtNum }),
        h("div", { class: "legend" }, series.map((s) => [swatch(s.color), s.name])))),
    card("Partitions", table(
      ["partition", "length", "produced", "newest record", "paused", "kept from"].concat(
        groups.flatMap((g) => [`committed (${g.group})`, `lag (${g.group})`])),
      d.partitions.map((p) => h("tr", { "data-partition": p.partition },
        cell("partition", p.partition), cell("length", p.length),
        cell("produced", p.producer_position ? p.producer_position.records : null,
          p.producer_position ? `epoch ${p.producer_position.epoch}: ${p.producer_position.records}` : "–"),
        cell("last_id", p.last_id, fmtId(p.last_id)),
        cell("paused", p.paused ? 1 : 0, p.paused ? "paused" : ""),
        cell("retention_floor", p.retention_floor, fmtId(p.retention_floor)),
        groups.flatMap((g) => {
          const gp = g.partitions.find((x) => x.partition === p.partition) || {};
          return [cell(`committed:${g.group}`, gp.committed, fmtId(gp.committed)), cell(`lag:${g.group}`, gp.lag)];
        }))))),
    card(`Dead letters (newest ${d.dead_letters.newest.length} of ${d.dead_letters.count})`,
      d.dead_letters.newest.length ? table(["when", "reason", "position", "bytes"],
        d.dead_letters.newest.map((x) => h("tr", {}, cell("dl_id", x.id, fmtAgo(Number(String(x.id).split("-")[0]) / 1000)), h("td", {}, x.reason),
          h("td", {}, x.position), cell("size", x.size))))
        : h("p", { class: "muted" }, "none")),
  ];
}

function token() { return sessionStorage.getItem("trainguard-token"); }

async function pin(store, step, pinned) {
  const t = token();
  if (!t) { alert("Set the admin token first (footer)."); return; }
  const r = await fetch(`/admin/checkpoints/${encodeURIComponent(store)}/${step}/${pinned ? "pin" : "unpin"}`,
    { method: "POST", headers: { Authorization: `Bearer ${t}` } });
  if (!r.ok) { const b = await r.json(); alert(b.error ? b.error.message : r.statusText); }
  refresh();
}

async function clearNode(node) {
  const t = token();
  if (!t) { alert("Set the admin token first (footer)."); return; }
  const r = await fetch(`/admin/nodes/${encodeURIComponent(node)}/clear`,
    { method: "POST", headers: { Authorization: `Bearer ${t}` } });
  if (!r.ok) { const b = await r.json(); alert(b.error ? b.error.message : r.statusText); }
  refresh();
}

// The interval advice in words (the formula stays in the API and the docs).
function adviceText(a) {
  const rec = fmtS(a.recommended_s), cur = fmtS(a.current_s);
  const basis = ` This assumes a failure about every ${fmtS(a.mtbf_s)} (${a.failures} restart${a.failures === 1 ? "" : "s"} in ${fmtS(a.observed_s)} of training)`
    + (a.bound ? `, and the interval is held at its ${a.bound} limit.` : ".");
  if (a.current_s === null || a.current_s === undefined)
    return `Checkpoint about every ${rec}: a failure then costs about ${fmtS(a.lost_recommended_s)} of training.` + basis;
  if (a.current_s > 1.5 * a.recommended_s)
    return `Checkpoint more often: every ${rec} instead of every ${cur}. A failure would then cost about ${fmtS(a.lost_recommended_s)} of training instead of ${fmtS(a.lost_current_s)}.` + basis;
  if (a.current_s < a.recommended_s / 1.5)
    return `You can checkpoint less often: every ${rec} instead of every ${cur} spends less time saving; a failure would cost about ${fmtS(a.lost_recommended_s)} instead of ${fmtS(a.lost_current_s)}.` + basis;
  return `The interval is right: you checkpoint every ${cur}, close to the recommended ${rec}; a failure costs about ${fmtS(a.lost_current_s)} of training.` + basis;
}

// What the loop reported (session.log): loss, steps/s, ETA, and its heartbeat.
function trainingCard(t) {
  t = t || { values: {}, points: [], heartbeat: { status: "unknown", advice: "" } };
  const hb = t.heartbeat;
  const cls = { training: "ok", finished: "", unknown: "warn" }[hb.status];
  const loss = t.values.loss === undefined ? null : t.values.loss;
  const pts = t.points.filter((p) => p.values.loss !== undefined && p.values.loss !== null)
    .map((p) => [p.at, p.values.loss]);
  return card("Training",
    h("div", { class: "stats" },
      stat("loss", loss, fmtNum(loss), "loss"),
      stat("train_step", t.step, undefined, "step"),
      stat("steps_per_s", t.steps_per_s, fmtNum(t.steps_per_s), "steps/s"),
      stat("eta_s", t.eta_s, fmtS(t.eta_s), "time left (ETA)"),
      h("div", { class: "stat" },
        h("b", {}, h("span", { class: `pill ${cls === undefined ? "bad" : cls}`, "data-k": "heartbeat",
          "data-v": hb.status }, hb.status)),
        h("span", {}, hb.last_progress_at ? `last progress ${fmtAgo(hb.last_progress_at)}` : "heartbeat"))),
    h("p", { class: "muted", "data-k": "heartbeat_advice", "data-v": hb.status }, hb.advice),
    h("div", { class: "chart" },
      lineChart([{ name: "loss", color: "#2563eb", points: pts }], { label: "loss over time", fmt: fmtNum, fromMin: true })));
}

async function runPage(name, dataset) {
  const q = dataset ? `?dataset=${encodeURIComponent(dataset)}` : "";
  const r = await getJSON(`/admin/runs/${encodeURIComponent(name)}${q}`);
  const cps = r.checkpoints, a = r.advice;
  const last = cps.length ? cps[cps.length - 1] : null;
  const incs = r.incidents || [];
  const marks = r.restarts.map((x) => ({ x: x.at, kind: "restart", color: "#dc2626",
    label: `restart → g${x.generation}`, title: `restart: resumed at step ${x.resumed_step}` }))
    .concat(r.rollbacks.map((x) => ({ x: x.at, kind: "rollback", color: "#d97706",
      label: "rollback", title: `rollback to step ${x.to_step}` })))
    .concat(incs.map((x) => ({ x: x.detected_at, kind: "incident", color: "#7c3aed",
      label: x.cause, title: `${x.cause} at step ${x.step} (${x.detected_by})` })));
  const timeline = lineChart([{ name: "checkpoints", color: "#2563eb",
    points: cps.map((c) => [c.created_at, c.step, `step ${c.step} (gen ${c.generation})`]) }],
  { label: "checkpoint timeline", fmt: fmtInt, dots: true, marks });
  const timed = cps.filter((c) => c.blocked_s !== null);
  return [
    h("h1", {}, `Run ${r.run}`),
    h("section", { class: "card stats" },
      stat("dataset", r.dataset, r.dataset, "dataset"),
      stat("store", r.store, r.store || "–", "checkpoint store"),
      stat("checkpoints", cps.length, undefined, "checkpoints kept"),
      stat("last_step", last ? last.step : null, undefined, "last committed step"),
      stat("last_commit_at", last ? last.created_at : null, fmtAgo(last && last.created_at), "last commit"),
      stat("generation", last ? last.generation : null, undefined, "generation"),
      stat("restarts", r.totals.failures, undefined, "restarts"),
      stat("rollbacks", r.rollbacks.length, undefined, "rollbacks"),
      stat("lag", r.group.lag, undefined, "lag (entries)")),
    trainingCard(r.training),
    h("div", { class: "grid" },
      card("Checkpoint timeline (step over time; restarts red, rollbacks amber, incidents violet)", timeline),
      card("Save time per checkpoint (blocked / durable)",
        bars(timed.flatMap((c) => [
          { label: String(c.step), value: c.blocked_s, color: "#2563eb", title: `step ${c.step}: blocked ${fmtS(c.blocked_s)}` },
          { label: "", value: c.durable_s || 0, color: "#93c5fd", title: `step ${c.step}: durable ${fmtS(c.durable_s)}` }]),
        { label: "save times", fmt: fmtS }),
        h("div", { class: "legend" }, swatch("#2563eb"), "blocked", swatch("#93c5fd"), "durable"))),
    card("Checkpoint interval", a ? h("div", {},
      h("div", { class: "stats" },
        stat("recommended_s", a.recommended_s, fmtS(a.recommended_s), "recommended interval"),
        stat("current_s", a.current_s, fmtS(a.current_s), "current interval"),
        stat("lost_recommended_s", a.lost_recommended_s, fmtS(a.lost_recommended_s), "lost per failure (recommended)"),
        stat("lost_current_s", a.lost_current_s, fmtS(a.lost_current_s), "lost per failure (current)"),
        stat("mtbf_s", a.mtbf_s, fmtS(a.mtbf_s), "MTBF estimate"),
        stat("blocked_s", a.blocked_s, fmtS(a.blocked_s), "save blocks"),
        stat("durable_s", a.durable_s, fmtS(a.durable_s), "save durable after")),
      h("p", { "data-k": "advice_text", "data-v": a.recommended_s }, adviceText(a)))
      : h("p", { class: "muted" }, "no measured save yet")),
    card("Restarts", r.restarts.length ? table(["at", "generation", "cause", "resumed at step", "last committed", "steps redone"],
      r.restarts.map((x) => h("tr", { "data-restart": x.generation },
        h("td", {}, fmtAgo(x.at)), cell("generation", x.generation), cell("cause", x.cause || "", x.cause || "–"),
        cell("resumed_step", x.resumed_step),
        cell("last_committed_step", x.last_committed_step),
        cell("steps_redone", x.steps_redone, x.steps_redone === null || x.steps_redone === undefined ? "–"
          : (x.steps_redone_exact ? "" : "≥ ") + x.steps_redone))))
      : h("p", { class: "muted" }, "none")),
    incs.length ? card("Incidents", table(["detected", "cause", "step", "detected by", "latency",
      "remedy", "redone steps / records", "to the next step"],
      incs.map((x) => {
        const rec = x.recovery || {};
        const phases = Object.entries(rec.phases_s || {}).filter(([, v]) => v !== null);
        return h("tr", { "data-incident": x.attempt },
          h("td", {}, fmtAgo(x.detected_at)), cell("cause", x.cause, x.cause), cell("step", x.step),
          h("td", {}, x.detected_by || "–"),
          cell("detection_latency_s", x.detection_latency_s, fmtS(x.detection_latency_s)),
          h("td", {}, (x.remedy && x.remedy.action) || "–"),
          h("td", {}, `${rec.steps_redone ?? "–"} / ${rec.records_redone ?? "–"}`),
          h("td", {}, phases.map(([k, v]) => `${k} ${fmtS(v)}`).join(", ") || "–"));
      }))) : null,
    r.world.length > 1 ? card("World size changes", table(["at", "from step", "ranks", "workers per rank"],
      r.world.map((x) => h("tr", {}, h("td", {}, fmtAgo(x.at)), cell("step", x.step),
        cell("world_size", x.world_size), cell("num_workers", x.num_workers))))) : null,
    r.rollbacks.length ? card("Rollbacks", table(["at", "to step", "from step", "skipped batches"],
      r.rollbacks.map((x) => h("tr", {}, h("td", {}, fmtAgo(x.at)), cell("to_step", x.to_step),
        cell("last_step", x.last_step), h("td", {}, x.skipped.join(", ") || "–"))))) : null,
    card(cps.length > ROWS ? `Checkpoints (newest ${ROWS} of ${cps.length})` : "Checkpoints",
      table(["step", "committed", "gen", "bytes", "blocked", "durable", "world", "status", "tiers", ""],
      cps.slice(-ROWS).reverse().map((c) => h("tr", { "data-step": c.step },
        cell("step", c.step), h("td", {}, fmtAgo(c.created_at)), cell("generation", c.generation),
        cell("nbytes", c.nbytes, fmtBytes(c.nbytes)), cell("blocked_s", c.blocked_s, fmtS(c.blocked_s)),
        cell("durable_s", c.durable_s, fmtS(c.durable_s)), h("td", {}, `${c.world_size}×${c.num_workers}`),
        h("td", {}, (c.status || []).join(", ")),
        cell("tiers", (c.tiers || []).join(" "), (c.tiers || []).join(", ") || "–"),
        h("td", {}, r.store ? h("button", { type: "button",
          onclick: () => pin(r.store, c.step, !(c.status || []).includes("pinned")) },
        (c.status || []).includes("pinned") ? "unpin" : "pin") : null))))),
  ];
}

// ------------------------------------------------------------------ router

function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query] = hash.split("?");
  const params = new URLSearchParams(query || "");
  const parts = path.split("/").filter(Boolean).map(decodeURIComponent);
  if (parts[0] === "dataset" && parts[1]) return () => datasetPage(parts[1]);
  if (parts[0] === "run" && parts[1]) return () => runPage(parts[1], params.get("dataset"));
  return overview;
}

async function health() {
  const el = document.getElementById("health");
  try {
    const r = await fetch("/readyz");
    const b = await r.json();
    el.textContent = b.ready ? "ready" : "not ready";
    el.className = "pill " + (b.ready ? "ok" : "bad");
    el.title = b.reason || "";
  } catch (e) {
    el.textContent = "unreachable"; el.className = "pill bad";
  }
}

async function refresh() {
  const mine = ++generation;
  clearTimeout(timer);
  try {
    const [content] = await Promise.all([route()(), health()]);
    if (mine !== generation) return;
    view.replaceChildren(...content.flat().filter(Boolean));
    document.getElementById("updated").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = String(mine);
  } catch (e) {
    if (mine !== generation) return;
    view.replaceChildren(h("section", { class: "card" }, h("h2", {}, "Cannot show this page"),
      h("p", { "data-k": "error" }, e.message)));
  }
  if (mine === generation) timer = setTimeout(refresh, POLL_MS);
}

document.getElementById("token-btn").addEventListener("click", () => {
  const t = prompt("Read or admin token (kept in this tab's sessionStorage only):", "");
  if (t === null) return;
  if (t) sessionStorage.setItem("trainguard-token", t); else sessionStorage.removeItem("trainguard-token");
  refresh();
});
window.addEventListener("hashchange", refresh);
refresh();
