// difftune web UI: forms generated from /api/schema, runs watched through /api/runs. No build step.
"use strict";

const $ = (sel, el = document) => el.querySelector(sel);
const $$ = (sel, el = document) => [...el.querySelectorAll(sel)];

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
    else if (k === "text") el.textContent = v;
    else if (k === "class") el.className = v;
    else el.setAttribute(k, v === true ? "" : v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) el.append(c instanceof Node ? c : String(c));
  return el;
}

async function api(method, url, body) {
  const opts = { method, headers: { Accept: "application/json" } };
  if (body !== undefined) {
    opts.headers["Content-Type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  const r = await fetch(url, opts);
  let data;
  try { data = await r.json(); } catch { data = { error: `${r.status} ${r.statusText}` }; }
  if (!r.ok) {
    const e = new Error(data.error || r.statusText);
    e.status = r.status; e.data = data;
    throw e;
  }
  return data;
}

const S = { schema: null, roots: [], path: "", config: {}, datasets: [], extra: {}, timer: null, versions: {},
            runId: null, runTimer: null, shownRun: null, galleryKey: "", outputsKey: "" };

function notice(text, bad = false) {
  const n = $("#notice");
  n.textContent = text; n.style.color = bad ? "#ff9b94" : "#ffd27a";
  clearTimeout(notice.t); notice.t = setTimeout(() => { n.textContent = ""; }, 6000);
}

const fmt = (v) => (v === null || v === undefined ? "empty" : typeof v === "object" ? JSON.stringify(v) : String(v));

// ---------------------------------------------------------------- form fields from the schema
function parseScalar(text, kind) {
  const s = text.trim();
  if (s === "") return undefined;
  if (kind === "integer" && /^[+-]?\d+$/.test(s)) return parseInt(s, 10);
  if ((kind === "number" || kind === "integer") && /^[+-]?(\d+\.?\d*|\.\d+)(e[+-]?\d+)?$/i.test(s)) return Number(s);
  return s; // not a number: sent as typed, and the check says what is wrong with it
}

// A boolean as the loader (pydantic) reads it: a SimpleTuner config's "false" or "0" is off, not a ticked box
function asBoolean(value) {
  if (typeof value === "string") return !["0", "off", "f", "false", "n", "no"].includes(value.trim().toLowerCase());
  return !!value;
}

function fieldWidget(spec, obj, onchange, prefix = "") {
  const key = spec.name, path = prefix + key, value = obj[key];
  const wrap = h("div", { class: "field", "data-field": path });
  const id = "f-" + Math.random().toString(36).slice(2);
  wrap.append(h("label", { for: id }, spec.title, spec.required ? h("span", { class: "req" }, " *") : null, h("code", {}, key)));
  const control = h("div", { class: "control" });
  const set = (v) => { if (v === undefined) delete obj[key]; else obj[key] = v; onchange(); };
  let input;
  if (spec.kind === "choice" || (spec.kind === "boolean" && spec.nullable)) {
    const choices = spec.kind === "boolean" ? [true, false] : spec.choices;
    const first = spec.required && !spec.has_default ? "— choose —" : `(default: ${fmt(spec.default)})`;
    input = h("select", { id, name: key }, h("option", { value: "" }, first),
      choices.map((c) => h("option", { value: JSON.stringify(c) }, String(c))));
    if (value !== undefined && !choices.includes(value)) input.append(h("option", { value: JSON.stringify(value) }, String(value)));
    input.value = value === undefined ? "" : JSON.stringify(value);
    input.addEventListener("change", () => set(input.value === "" ? undefined : JSON.parse(input.value)));
  } else if (spec.kind === "boolean") {
    input = h("input", { id, name: key, type: "checkbox" });
    input.checked = value === undefined ? !!spec.default : asBoolean(value);
    input.addEventListener("change", () => set(input.checked === !!spec.default && !(key in S.loadedKeys(obj)) ? undefined : input.checked));
  } else if (spec.kind === "const") {
    input = h("input", { id, name: key, value: fmt(value ?? spec.choices[0]), readonly: true });
  } else if (spec.kind === "object") {
    input = h("input", { id, name: key, type: "checkbox" });
    input.checked = value !== undefined && value !== null;
    const inner = h("div", { class: "fields nested" });
    const draw = () => {
      inner.replaceChildren();
      if (obj[key]) spec.fields.forEach((f) => inner.append(fieldWidget(f, obj[key], onchange, path + ".")));
    };
    input.addEventListener("change", () => { if (input.checked) obj[key] = obj[key] || {}; else delete obj[key]; draw(); onchange(); });
    draw();
    control.append(input, h("span", { class: "hint" }, "set"));
    wrap.append(control, h("small", {}, spec.description), inner, h("div", { class: "error" }));
    return wrap;
  } else if (spec.kind === "json" || spec.kind === "list") {
    const text = value === undefined ? "" : spec.kind === "list" && Array.isArray(value) ? value.join(", ") : JSON.stringify(value);
    input = h("input", { id, name: key, value: text, placeholder: spec.kind === "list" ? "values separated by commas" : "JSON" });
    input.addEventListener("input", () => {
      const s = input.value.trim();
      if (s === "") return set(undefined);
      if (spec.kind === "list") return set(s.split(",").map((p) => parseScalar(p, spec.item)).filter((p) => p !== undefined));
      try { set(JSON.parse(s)); } catch { set(s); }
    });
  } else {
    const long = spec.kind === "string" && /prompt/.test(key);
    input = h(long ? "textarea" : "input", { id, name: key, rows: long ? 2 : null, spellcheck: "false",
      type: spec.secret ? "password" : null, autocomplete: spec.secret ? "new-password" : null, // a credential
      inputmode: spec.kind === "string" ? null : "decimal",
      placeholder: spec.default !== null && spec.default !== undefined ? String(spec.default) : spec.nullable ? "empty" : "" });
    input.value = value === undefined || value === null ? "" : String(value);
    input.addEventListener("input", () => set(spec.kind === "string" ? (input.value === "" ? undefined : input.value) : parseScalar(input.value, spec.kind)));
    if (key === "model_flavour") input.setAttribute("list", "flavour-list");
  }
  control.append(input);
  if (spec.path) {
    control.append(h("button", { type: "button", class: "browse", onclick: async () => {
      const chosen = await pick(spec.path, input.value);
      if (chosen) { input.value = chosen; input.dispatchEvent(new Event("input")); }
    } }, "Browse…"));
  }
  wrap.append(control, h("small", {}, spec.description));
  if (spec.has_default && spec.default !== null && spec.kind !== "const") wrap.append(h("small", { class: "default" }, `default: ${fmt(spec.default)}`));
  wrap.append(h("div", { class: "error" }));
  return wrap;
}

function fieldBlock(specs, obj, onchange, label, openIf) {
  const basic = specs.filter((f) => !f.advanced), adv = specs.filter((f) => f.advanced);
  const out = [h("div", { class: "fields" }, basic.map((f) => fieldWidget(f, obj, onchange)))];
  if (adv.length) {
    const d = h("details", { class: "advanced" }, h("summary", {}, `Advanced ${label} options (${adv.length})`),
      h("div", { class: "fields" }, adv.map((f) => fieldWidget(f, obj, onchange))));
    d.open = adv.some((f) => f.name in obj) || openIf;
    out.push(d);
  }
  return out;
}

// ---------------------------------------------------------------- the configuration
S.original = new WeakMap();
S.loadedKeys = (obj) => S.original.get(obj) || {};

function renderConfig() {
  const root = $("#config-form");
  root.replaceChildren();
  const flavours = h("datalist", { id: "flavour-list" });
  root.append(flavours);
  for (const group of S.schema.groups) {
    const specs = S.schema.train.filter((f) => f.group === group);
    if (!specs.length) continue;
    const fs = h("fieldset", { class: "group", "data-group": group }, h("legend", {}, group), fieldBlock(specs, S.config, changed, group));
    root.append(fs);
    if (group === "data") root.append(S.datasetsSection);
  }
  if (!S.datasetsSection.isConnected) root.append(S.datasetsSection);
  updateFlavours();
  $("#other-keys").value = Object.keys(S.extra).length ? JSON.stringify(S.extra, null, 2) : "";
  $("#other-keys-box").open = Object.keys(S.extra).length > 0;
  renderDatasets();
}

function updateFlavours() {
  const list = $("#flavour-list");
  if (!list) return;
  list.replaceChildren(...(S.schema.flavours[S.config.model_family] || []).map((f) => h("option", { value: f })));
}

function renderDatasets() {
  const box = $("#datasets");
  box.replaceChildren(...S.datasets.map(datasetCard));
  $("#add-dataset").replaceChildren(...Object.keys(S.schema.datasets).map((kind) =>
    h("button", { type: "button", "data-add": kind, onclick: () => addDataset(kind) }, `+ ${kind.replace("_", " ")} entry`)));
}

function datasetCard(entry, index) {
  const card = h("div", { class: "dataset", "data-index": index });
  const remove = h("button", { type: "button", class: "danger", onclick: () => { S.datasets.splice(index, 1); renderDatasets(); changed(); } }, "Remove");
  if (typeof entry !== "object" || entry === null || Array.isArray(entry)) {
    card.append(h("div", { class: "dataset-head" }, h("strong", {}, `entry ${index}`), h("span", { class: "spacer" }), remove),
      h("p", { class: "error" }, `not an object: ${fmt(entry)}`), h("div", { class: "error", "data-card-error": "" }));
    return card;
  }
  const kind = entry.dataset_type || "image", model = S.schema.datasets[kind];
  const kinds = h("select", { name: "dataset_type", "aria-label": "dataset type" }, Object.keys(S.schema.datasets).map((k) => h("option", { value: k }, k)));
  if (!model) kinds.append(h("option", { value: kind }, kind));
  kinds.value = kind;
  kinds.addEventListener("change", () => {
    const fields = new Set(S.schema.datasets[kinds.value].fields.map((f) => f.name));
    for (const k of Object.keys(entry)) if (!fields.has(k)) delete entry[k];
    entry.dataset_type = kinds.value;
    renderDatasets(); changed();
  });
  card.append(h("div", { class: "dataset-head" }, h("strong", {}, entry.id || `entry ${index}`), kinds, h("span", { class: "spacer" }), remove));
  card.dataset.kind = kind;
  if (model) {
    // a source type's keys (aws_*, csv_*, the hub's) only on an entry of that type, or where set; the type choice
    // offers what the web UI trains (a loaded entry's other type is still shown, with the check's problem)
    const fields = model.fields.filter((f) => f.name !== "dataset_type" && (!f.source || f.source === entry.type || f.name in entry))
      .map((f) => (f.name === "type" && f.kind === "choice" ? { ...f, choices: f.choices.filter((c) => S.schema.web_types.includes(c)) } : f));
    card.append(h("small", { class: "hint" }, model.description), ...fieldBlock(fields, entry, changed, kind));
  }
  const known = new Set(model ? model.fields.map((f) => f.name) : []);
  const extra = Object.fromEntries(Object.entries(entry).filter(([k]) => !known.has(k) && k !== "dataset_type"));
  if (Object.keys(extra).length) {
    const ta = h("textarea", { rows: 3, spellcheck: "false" }), said = h("div", { class: "error" });
    ta.value = JSON.stringify(extra, null, 2);
    ta.addEventListener("input", () => {
      let parsed;
      try { parsed = JSON.parse(ta.value || "{}"); } catch (e) { parsed = e; }
      const object = parsed !== null && typeof parsed === "object" && !Array.isArray(parsed) && !(parsed instanceof Error);
      // marked until it parses: collect() sends nothing meanwhile, since a save would write the entry's last keys
      ta.toggleAttribute("data-bad-json", !object);
      said.textContent = object ? "" : `${parsed instanceof Error ? `not valid JSON (${parsed.message})` : "not a JSON object of keys and values"}: fix it or empty it`;
      if (!object) return;
      for (const k of Object.keys(extra)) { delete entry[k]; delete extra[k]; }
      Object.assign(entry, parsed); Object.assign(extra, parsed); changed();
    });
    card.append(h("div", { class: "field", "data-field": "__other" }, h("label", {}, "Other keys of this entry (JSON)"), ta, said));
  }
  card.append(h("div", { class: "error", "data-card-error": "" }));
  return card;
}

function addDataset(kind) {
  const model = S.schema.datasets[kind];
  const ids = new Set(S.datasets.map((d) => d && d.id));
  let id = kind === "text_embeds" ? "text-embeds" : kind, n = 2;
  while (ids.has(id)) id = `${kind}-${n++}`;
  const entry = { id };
  for (const f of model.fields) if (f.kind === "const" && !f.advanced) entry[f.name] = f.choices[0];
  S.datasets.push(entry);
  renderDatasets(); changed();
}

// The form's config; `error` (nothing else) when the "Other keys" box is not a JSON object: a config without
// those keys must never be sent, as a save would write the file without them. The box's keys become S.extra, so
// that a redraw (renderConfig) keeps what was typed there.
function collect() {
  let extra = {}, error = null;
  const text = $("#other-keys").value.trim();
  if (text) {
    try { extra = JSON.parse(text); } catch (e) { error = `not valid JSON (${e.message})`; }
    const object = extra !== null && typeof extra === "object" && !Array.isArray(extra);
    if (!error && !object) error = "not a JSON object of keys and values";
  }
  $('[data-error="other"]').textContent = error ? `${error}: fix it or empty it` : "";
  if (error) return { error: `the "Other keys (JSON)" box: ${error}; fix it first (nothing was sent)` };
  const card = document.querySelector("textarea[data-bad-json]")?.closest(".dataset");
  if (card) return { error: `dataset ${card.querySelector("strong").textContent}: its "Other keys of this entry" box is not a JSON object; fix it first (nothing was sent)` };
  S.extra = extra;
  return { path: $("#config-path").value.trim(), config: { ...S.config, ...extra }, datasets: S.datasets };
}

// SimpleTuner's `--key` spelling is shown and saved as `key` (the loader reads both), so that its form field shows
// it; a key written both ways keeps its dashed one, and the check reports it as `difftune check` does
function undash(obj) {
  const out = {};
  for (const [k, v] of Object.entries(obj)) {
    const plain = k.replace(/^-+/, "");
    out[plain !== k && plain && !(plain in obj) ? plain : k] = v;
  }
  return out;
}

function load(data) {
  const known = new Set(S.schema.train.map((f) => f.name));
  S.config = {}; S.extra = {};
  for (const [k, v] of Object.entries(undash(data.config || {}))) (known.has(k) ? S.config : S.extra)[k] = v;
  S.original.set(S.config, { ...S.config });
  S.datasets = (Array.isArray(data.datasets) ? data.datasets : [])
    .map((d) => (d && typeof d === "object" && !Array.isArray(d) ? undash(d) : d));
  S.datasets.forEach((d) => { if (d && typeof d === "object") S.original.set(d, { ...d }); });
  if (data.path) $("#config-path").value = data.path;
  S.versions = data.versions || {}; // the files as opened: a save replaces only these without asking
  renderConfig();
  showProblems(data.problems ? data : null);
}

function changed() {
  updateFlavours();
  clearTimeout(S.timer);
  S.timer = setTimeout(() => check(false), 700);
}

// scan: also scan the dataset folders (the Check button); the check while typing leaves that out
async function check(scan = false) {
  const body = collect();
  if (body.error) { if (scan) notice(body.error, true); return; }
  if (!body.path) return;
  try { showProblems(await api("POST", "/api/config/check", { ...body, scan })); } catch (e) { notice(e.message, true); }
}

// The memory planner (`difftune plan --gpu-memory`): the cheapest settings that fit, applied on confirmation.
async function planMemory() {
  const body = collect();
  if (body.error) { notice(body.error, true); return; }
  if (!body.path) { notice("give the config a path first", true); return; }
  const answer = window.prompt("GPU memory to fit, in GiB", "24");
  if (answer === null) return;
  const gib = Number(answer);
  if (!(gib > 0)) { notice("give a number of GiB, such as 24", true); return; }
  let result;
  try { result = await api("POST", "/api/config/plan", { ...body, gpu_memory: gib }); } catch (e) { notice(e.message, true); return; }
  if (!result.plan) { showProblems(result); notice("only a config without problems can be planned", true); return; }
  const choice = result.plan.choice, peak = (result.plan.peak_bytes / 2 ** 30).toFixed(1);
  if (!choice.fits) { notice(`predicted peak ${peak} GiB (${result.plan.peak_phase}); ${choice.message}`, true); return; }
  const kept = choice.reserve_gigabytes ? `, keeping ${choice.reserve_gigabytes} GiB free for the CUDA context` : "";
  if (!choice.steps.length) { notice(`predicted peak ${peak} GiB: fits in ${gib} GiB as it is${kept}`); return; }
  const lines = choice.steps.map((s) => `${s.key}: ${JSON.stringify(s.value)} (${s.saving_bytes < 0 ? "costs" : "saves"} ${(Math.abs(s.saving_bytes) / 2 ** 30).toFixed(1)} GiB${s.phase ? ` of ${s.phase} (not the peak)` : ""}; ${s.cost})`);
  if (!window.confirm(`Predicted peak ${peak} GiB. To fit ${gib} GiB${kept}:\n${lines.join("\n")}\nApply these settings?`)) return;
  // onto the form as it is now: collect() above took the Other keys box into S.extra, which the redraw shows again
  const now = collect();
  if (now.error) { notice(now.error, true); return; }
  Object.assign(S.config, choice.settings);
  for (const k of Object.keys(choice.settings)) delete S.extra[k]; // the plan's value, not one typed in the box
  renderConfig();
  changed();
  notice(`applied: predicted peak ${(choice.peak_bytes_after / 2 ** 30).toFixed(1)} GiB`);
}

function showProblems(result) {
  $$(".field.has-error").forEach((f) => f.classList.remove("has-error"));
  $$(".error").forEach((e) => { e.textContent = ""; });
  const box = $("#problems");
  if (!result) { box.hidden = true; return; }
  box.hidden = false;
  $("#datasets-path-line").textContent = result.datasets_path ? `dataset list: ${result.datasets_path}` : "";
  if (result.ok) {
    box.className = "problems ok";
    box.replaceChildren(result.scanned ? "No problems: difftune check accepts this configuration."
      : "No problems in the settings so far; Check, Save and Start run also scan the dataset folders.");
    return;
  }
  box.className = "problems";
  box.replaceChildren(h("strong", {}, `${result.problems.length} problem(s):`), h("ul", {}, result.problems.map((p) => h("li", {}, p.text))));
  for (const p of result.problems) {
    let scope = null;
    if (p.scope === "config") scope = $("#config-form");
    else if (p.scope === "datasets" && p.dataset_index !== null) scope = $(`#datasets .dataset[data-index="${p.dataset_index}"]`);
    let placed = false;
    for (const key of [p.key, ...(p.mentions || [])]) {
      if (!key || !scope) continue;
      const f = findField(scope, key);
      if (f) { addError(f, p.message); placed = true; }
    }
    if (!placed && p.scope === "config") $('[data-error="other"]').textContent += p.message + "\n";
    if (!placed && scope && p.scope === "datasets") $("[data-card-error]", scope).textContent += p.message + "\n";
  }
}

function findField(scope, key) {
  // the datasets section sits inside #config-form: a config key is never placed in a dataset card
  const own = (el) => scope.id !== "config-form" || !el.closest("#datasets-section");
  const q = (k) => [...scope.querySelectorAll(`[data-field="${CSS.escape(k)}"]`)].find(own);
  return q(key) || q(key.split(".")[0]);
}

function addError(field, message) {
  field.classList.add("has-error");
  const err = [...field.children].find((c) => c.classList.contains("error"));
  if (err && !err.textContent.includes(message)) err.textContent += (err.textContent ? "\n" : "") + message;
  const details = field.closest("details");
  if (details) details.open = true;
}

async function openConfig(path) {
  try { load(await api("GET", `/api/config?path=${encodeURIComponent(path)}`)); notice(`opened ${path}`); } catch (e) { notice(e.message, true); }
}

// New proposes file names that do not exist yet (config.json, else config-2.json, ...): a save never replaces a
// file the page did not open without asking
async function newConfig() {
  const root = S.roots[0] || "";
  let taken = new Set();
  try {
    const listing = await api("GET", `/api/browse?files=true&path=${encodeURIComponent(`${root}/config`)}`);
    taken = new Set(listing.entries.map((e) => e.name));
  } catch { /* no config folder yet */ }
  let n = 1;
  const suffix = () => (n === 1 ? "" : `-${n}`);
  while (taken.has(`config${suffix()}.json`) || taken.has(`multidatabackend${suffix()}.json`)) n++;
  $("#config-path").value = `${root}/config/config${suffix()}.json`;
  load({ config: { model_type: "lora", data_backend_config: `${root}/config/multidatabackend${suffix()}.json`, output_dir: `${root}/output` }, datasets: [] });
  addDataset("image");
  if (S.schema.datasets.text_embeds) {
    addDataset("text_embeds");
    S.datasets[S.datasets.length - 1].cache_dir = `${root}/cache/text`;
    S.datasets[S.datasets.length - 1].default = true;
    renderDatasets();
  }
}

async function save() {
  const body = { ...collect(), opened: S.versions };
  if (body.error) { notice(body.error, true); return null; }
  if (!body.path) { notice("give the config file a path first", true); return null; }
  try {
    let result;
    try {
      result = await api("PUT", "/api/config", body);
    } catch (e) {
      // a file this page did not open (or one changed since): replaced only when the user says so
      if (e.status !== 409 || !e.data.conflicts) throw e;
      if (!window.confirm(`${e.data.error}.\n\nReplace?`)) { notice("not saved", true); return null; }
      result = await api("PUT", "/api/config", { ...body, overwrite: true });
    }
    S.versions = result.versions || {};
    showProblems(result);
    notice(`saved ${result.saved.join(" and ")}`);
    return result;
  } catch (e) { notice(e.message, true); return null; }
}

async function startRun() {
  const saved = await save();
  if (!saved) return;
  try {
    const run = await api("POST", "/api/runs", { path: saved.config_path });
    showTab("runs"); showRun(run.id); refreshRuns();
  } catch (e) {
    notice(e.message, true);
    if (e.data && e.data.problems) showProblems(e.data);
  }
}

// ---------------------------------------------------------------- folder and file picker
function pick(kind, start) {
  const dialog = $("#picker");
  $("#picker-title").textContent = kind === "folder" ? "Choose a folder" : "Choose a file";
  $("#picker-choose").hidden = kind !== "folder";
  $("#picker-new-row").hidden = true;
  return new Promise((resolve) => {
    let current = null;
    const go = async (path) => {
      try {
        const data = await api("GET", `/api/browse?files=${kind !== "folder"}${path ? "&path=" + encodeURIComponent(path) : ""}`);
        current = data.path;
        $("#picker-where").textContent = data.path || "(roots)";
        $("#picker-up").disabled = !data.path;
        $("#picker-up").onclick = () => go(data.parent || "");
        $("#picker-list").replaceChildren(...data.entries.map((e) => h("li", { class: e.kind, onclick: () => {
          if (e.kind === "folder") go(e.path); else { dialog.close(); resolve(e.path); }
        } }, e.name)));
        if (data.path && kind === "folder") $("#picker-choose").textContent = `Choose this folder${data.images ? ` (${data.images} images)` : data.clips ? ` (${data.clips} clips)` : ""}`;
      } catch (e) { notice(e.message, true); if (path) go(""); }
    };
    $("#picker-choose").onclick = () => { if (current) { dialog.close(); resolve(current); } };
    dialog.onclose = () => resolve(null);
    const startDir = start && kind === "folder" ? start : start ? start.replace(/\/[^/]*$/, "") : S.roots.length === 1 ? S.roots[0] : "";
    go(startDir);
    dialog.showModal();
  });
}

// ---------------------------------------------------------------- runs
function showTab(name) {
  $$(".tab").forEach((t) => t.classList.toggle("active", t.dataset.tab === name));
  $("#tab-configure").hidden = name !== "configure";
  $("#tab-runs").hidden = name !== "runs";
  if (name === "runs") refreshRuns();
}

const ACTIVE = ["starting", "running", "stopping"];
const duration = (s) => {
  if (s === null || s === undefined || !isFinite(s)) return "–";
  s = Math.round(s);
  const hh = Math.floor(s / 3600), mm = Math.floor((s % 3600) / 60), ss = s % 60;
  return (hh ? `${hh}:${String(mm).padStart(2, "0")}` : `${mm}`) + `:${String(ss).padStart(2, "0")}`;
};
const num = (v, d = 4) => (v === null || v === undefined ? "–" : Number(v).toPrecision(d));
const fileUrl = (id, rel) => `/api/runs/${encodeURIComponent(id)}/file?path=${encodeURIComponent(rel)}`;

async function refreshRuns() {
  try {
    const { runs } = await api("GET", "/api/runs");
    $("#run-list").replaceChildren(...runs.map((r) => h("li", { "data-run": r.id, class: r.id === S.runId ? "selected" : null, onclick: () => showRun(r.id) },
      h("span", { class: `badge ${r.status}` }, r.status), " ", h("strong", {}, r.id),
      h("div", { class: "sub" }, `${r.step || 0}/${r.total_steps ?? "?"} steps · ${r.config_path}`))));
    if (!S.runId && runs.length) showRun(runs[0].id);
  } catch (e) { notice(e.message, true); }
  clearTimeout(refreshRuns.t);
  if (!$("#tab-runs").hidden) refreshRuns.t = setTimeout(refreshRuns, 3000);
}

function showRun(id) {
  S.runId = id;
  history.replaceState(null, "", `#run=${encodeURIComponent(id)}`);
  $$("#run-list li").forEach((li) => li.classList.toggle("selected", li.dataset.run === id));
  clearTimeout(S.runTimer);
  pollRun();
}

async function pollRun() {
  const id = S.runId;
  let active = false;
  try { const run = await api("GET", `/api/runs/${encodeURIComponent(id)}`); renderRun(run); active = ACTIVE.includes(run.status); } catch (e) { notice(e.message, true); }
  if (S.runId === id) S.runTimer = setTimeout(pollRun, active ? 1000 : 5000);
}

async function sendCommand(command) {
  try { renderRun(await api("POST", `/api/runs/${encodeURIComponent(S.runId)}/command`, { command })); notice(`${command} sent`); } catch (e) { notice(e.message, true); }
}

function runSkeleton(run) {
  const stat = (name, label) => h("div", { class: "stat" }, h("div", { class: "label" }, label), h("div", { class: "value", "data-stat": name }, "–"));
  const btn = (cmd, label, cls) => h("button", { type: "button", "data-command": cmd, class: cls, onclick: () => sendCommand(cmd) }, label);
  return h("div", { "data-run-detail": run.id },
    h("div", { class: "card" },
      h("div", { class: "run-head" }, h("h2", {}, run.id), h("span", { class: "badge", id: "run-status" }), h("span", { class: "spacer" }),
        btn("sample", "Sample now"), btn("save", "Save now"), btn("stop", "Stop", "danger"), btn("kill", "Kill", "danger")),
      h("div", { class: "hint", id: "run-where" }, `${run.config_path} → ${run.output_dir}`),
      h("div", { class: "progress" }, h("div", { id: "run-progress", style: "width:0%" })),
      h("div", { class: "stats" }, stat("step", "step"), stat("loss", "loss"), stat("lr", "learning rate"), stat("its", "it/s"), stat("eta", "ETA"), stat("elapsed", "elapsed"),
        stat("tokens_per_s", "tokens/s"), stat("tflops", "TFLOP/s"), stat("mfu", "MFU"), stat("peak_memory_gib", "peak memory"))),
    h("div", { class: "card failure", id: "run-failure", hidden: true }, h("h3", {}, "This run failed"), h("p", { id: "run-error" }),
      h("pre", { id: "run-traceback", hidden: true }), h("div", { class: "hint" }, "Last lines of its log:"), h("pre", { id: "run-log" })),
    h("div", { class: "card" }, h("h3", {}, "Loss"), svgEl("svg", { class: "curve", id: "run-curve", viewBox: "0 0 800 220", preserveAspectRatio: "none" })),
    h("div", { class: "card", id: "run-eval-card", hidden: true }, h("h3", {}, "CLIP score"), svgEl("svg", { class: "curve", id: "run-eval-curve", viewBox: "0 0 800 220", preserveAspectRatio: "none" })),
    h("div", { class: "card", id: "run-evalloss-card", hidden: true }, h("h3", {}, "Evaluation loss (held-out data)"), svgEl("svg", { class: "curve", id: "run-evalloss-curve", viewBox: "0 0 800 220", preserveAspectRatio: "none" })),
    h("div", { class: "card" }, h("h3", {}, "Validation samples"), h("div", { class: "gallery", id: "run-samples" }, h("p", { class: "hint" }, "None yet."))),
    h("div", { class: "card" }, h("h3", {}, "Saved LoRA and checkpoints"), h("ul", { id: "run-saves" }, h("li", { class: "hint" }, "None yet."))),
    h("div", { class: "card" }, h("h3", {}, "Outputs"), h("ul", { id: "run-outputs" })),
    h("details", { class: "card" }, h("summary", {}, "Messages and log"), h("pre", { id: "run-messages" }), h("pre", { id: "run-log-all" })));
}

function renderRun(run) {
  const box = $("#run-detail");
  if (S.shownRun !== run.id) {
    box.replaceChildren(runSkeleton(run));
    S.shownRun = run.id; S.galleryKey = ""; S.outputsKey = ""; S.savesKey = "";
  }
  const status = $("#run-status");
  status.textContent = run.status + (run.message && run.status !== "failed" ? ` (${run.message})` : "");
  status.className = `badge ${run.status}`;
  const active = ACTIVE.includes(run.status);
  $$("[data-command]").forEach((b) => { b.disabled = !active; b.hidden = b.dataset.command === "kill" && run.status !== "stopping"; });
  const total = run.total_steps || 0;
  $("#run-progress").style.width = total ? `${Math.min(100, (100 * run.step) / total)}%` : "0%";
  const set = (k, v) => { $(`[data-stat="${k}"]`).textContent = v; };
  set("step", `${run.step ?? 0} / ${total || "?"}`);
  set("loss", num(run.loss)); set("lr", num(run.lr, 3)); set("its", num(run.its, 3));
  set("eta", active ? duration(run.eta_s) : "–");
  set("elapsed", duration((run.ended || Date.now() / 1000) - run.started));
  // the last step's throughput (train/throughput.py); MFU only where the device's peak is known
  set("tokens_per_s", run.tokens_per_s == null ? "–" : Math.round(run.tokens_per_s).toLocaleString("en-US"));
  set("tflops", num(run.tflops, 3));
  set("mfu", run.mfu == null ? "–" : `${(100 * run.mfu).toFixed(1)}%`);
  set("peak_memory_gib", run.peak_memory_gib == null ? "–" : `${run.peak_memory_gib.toFixed(2)} GiB`);
  const failed = run.status === "failed";
  $("#run-failure").hidden = !failed;
  if (failed) {
    $("#run-error").textContent = run.message || "failed";
    $("#run-traceback").hidden = !run.traceback;
    $("#run-traceback").textContent = run.traceback || "";
    const log = $("#run-log");
    log.textContent = (run.log_tail || []).slice(-25).join("\n") || "(the log is empty)";
    log.scrollTop = log.scrollHeight; // the last lines say what went wrong
  }
  const li = $(`#run-list li[data-run="${CSS.escape(run.id)}"]`);
  if (li) {
    li.querySelector(".badge").className = `badge ${run.status}`;
    li.querySelector(".badge").textContent = run.status;
    li.querySelector(".sub").textContent = `${run.step || 0}/${run.total_steps ?? "?"} steps · ${run.config_path}`;
  }
  drawCurve(run.losses || []);
  $("#run-eval-card").hidden = !(run.evaluations || []).length; // evaluation_type clip
  drawCurve(run.evaluations || [], "#run-eval-curve");
  $("#run-evalloss-card").hidden = !(run.eval_losses || []).length; // dataset_type eval
  drawCurve(run.eval_losses || [], "#run-evalloss-curve");
  const key = (run.samples || []).map((s) => s.path).join("|");
  if (key !== S.galleryKey) {
    S.galleryKey = key;
    // a video's contact sheet (the PNG beside its MP4) is not shown twice
    const videos = new Set((run.samples || []).filter((s) => /\.mp4$/i.test(s.path)).map((s) => s.path.replace(/\.mp4$/i, "")));
    const items = [...(run.samples || [])].reverse().filter((s) => !(/\.png$/i.test(s.path) && videos.has(s.path.replace(/\.png$/i, ""))));
    $("#run-samples").replaceChildren(...(items.length ? items.map((s) => h("figure", {},
      /\.(mp4|webm)$/i.test(s.path) ? h("video", { src: fileUrl(run.id, s.path), controls: true, loop: true, muted: true }) : h("img", { src: fileUrl(run.id, s.path), alt: s.text || s.prompt || "sample" }),
      // the prompt's text (its name where there is none: unconditional, runs from before the text was logged),
      // then what tells a step's samples apart: size, image number, EMA
      h("figcaption", {}, [`step ${s.step}`, s.text || s.prompt || "", s.size, s.image, s.ema ? "EMA" : ""]
        .filter(Boolean).join(" · ")))) : [h("p", { class: "hint" }, "None yet.")]));
  }
  const saves = [...(run.adapter ? [h("li", {}, "LoRA: ", h("a", { href: fileUrl(run.id, run.adapter), target: "_blank" }, run.adapter))] : []),
    ...[...(run.checkpoints || [])].reverse().map((c) => h("li", {}, `step ${c.step}: `, h("code", {}, c.path || "(outside the output folder)")))];
  const skey = saves.map((li) => li.textContent).join("|");
  if (skey !== S.savesKey) {
    S.savesKey = skey;
    $("#run-saves").replaceChildren(...(saves.length ? saves : [h("li", { class: "hint" }, "None yet.")]));
  }
  const okey = (run.outputs || []).map((o) => o.path + o.size).join("|");
  if (okey !== S.outputsKey) {
    S.outputsKey = okey;
    $("#run-outputs").replaceChildren(...(run.outputs || []).map((o) => h("li", {}, h("a", { href: fileUrl(run.id, o.path), target: "_blank" }, o.path), ` (${(o.size / 1024).toFixed(1)} KiB)`)));
  }
  $("#run-messages").textContent = (run.messages || []).map((m) => `${m.event}: ${m.message}`).join("\n");
  $("#run-log-all").textContent = (run.log_tail || []).join("\n");
}

function svgEl(tag, attrs = {}) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  return el;
}

function drawCurve(points, id = "#run-curve") {
  const svg = $(id);
  svg.replaceChildren();
  const W = 800, H = 220, L = 50, B = 20, T = 10, R = 10;
  svg.append(svgEl("line", { class: "axis", x1: L, y1: H - B, x2: W - R, y2: H - B }), svgEl("line", { class: "axis", x1: L, y1: T, x2: L, y2: H - B }));
  if (points.length < 1) return;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]).filter(Number.isFinite);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1), y0 = Math.min(...ys), y1 = Math.max(...ys, y0 + 1e-9);
  const X = (x) => L + ((x - x0) / (x1 - x0)) * (W - L - R), Y = (y) => H - B - ((y - y0) / (y1 - y0)) * (H - B - T);
  const d = points.filter((p) => Number.isFinite(p[1])).map((p) => `${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`).join(" ");
  svg.append(svgEl("polyline", { class: "line", points: d }));
  const text = (x, y, s, anchor = "end") => { const t = svgEl("text", { x, y, "text-anchor": anchor }); t.textContent = s; svg.append(t); };
  text(L - 4, T + 10, num(y1, 3)); text(L - 4, H - B, num(y0, 3)); text(L, H - 4, `step ${x0}`, "start"); text(W - R, H - 4, `step ${x1}`);
}

// ---------------------------------------------------------------- start
async function main() {
  S.datasetsSection = $("#datasets-section");
  $$(".tab").forEach((t) => t.addEventListener("click", () => showTab(t.dataset.tab)));
  $("#btn-new").onclick = () => newConfig();
  $("#btn-save").onclick = save;
  $("#btn-check").onclick = () => check(true);
  $("#btn-plan").onclick = planMemory;
  $("#btn-start").onclick = startRun;
  $("#btn-open").onclick = async () => { const p = await pick("file", $("#config-path").value); if (p) openConfig(p); };
  $("#other-keys").addEventListener("input", changed);
  try {
    [S.schema, { roots: S.roots }] = await Promise.all([api("GET", "/api/schema"), api("GET", "/api/roots")]);
  } catch (e) { notice(e.message, true); return; }
  await newConfig();
  showProblems(null);
  const m = location.hash.match(/^#run=(.+)$/);
  if (m) { showTab("runs"); showRun(decodeURIComponent(m[1])); }
  document.body.dataset.ready = "1";
}
main();
