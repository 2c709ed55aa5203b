"""The page of ``overlayrec report --html``: one self-contained file (inline CSS and script, the
data embedded as JSON; no network, no external font), rendered from engines.report's data.

The page: a summary line; the timeline (a time axis whose long idle stretches are folded, a lane
per turn and per call beneath their session, a lane for outside actors, one for late writes of
background processes, one for reverts; a mark per change); a diff panel (a click on a mark
shows its file's diff, on a bar or a lane's name the unit's whole diff); the files view (each
file with the units that changed it, in time order); a legend saying what a mark is.
"""
from __future__ import annotations

import html
import json
import re
import unicodedata

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>overlayrec report: __TITLE__</title>
<style>
:root{--ink:#1d2330;--mute:#667085;--line:#e4e7ec;--bg:#f7f8fa;--label:300px;
 --turn:#6b5bd2;--call:#2f6fdf;--err:#d23c3c;--impl:#8a98b3;--out:#d98a00;--late:#12877f;
 --rev:#5f6b7a;--A:#1a9b4b;--M:#2f6fdf;--D:#d23c3c;--R:#8e44ad;--T:#e08a00}
*{box-sizing:border-box}
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:var(--ink);
 background:#fff}
header{padding:16px 24px 8px}
h1{font-size:19px;margin:0 0 4px;font-weight:650}
h1 .ws{font:600 15px ui-monospace,"SFMono-Regular",Menlo,monospace;color:var(--mute)}
h2{font-size:15px;margin:0 0 8px;font-weight:650}
.summary{color:var(--mute)} .summary b{color:var(--ink);font-weight:600}
main{padding:0 24px 24px}
section{margin-top:16px}
#timeline{border:1px solid var(--line);border-radius:8px;overflow:hidden}
.row{display:flex;min-height:26px;border-top:1px solid var(--line)}
.row:first-child{border-top:0}
.label{width:var(--label);flex:none;padding:4px 10px;border-right:1px solid var(--line);
 white-space:nowrap;overflow:hidden;text-overflow:ellipsis;cursor:pointer;background:#fff}
.label .name{font-weight:600} .label .sub{color:var(--mute);margin-left:6px;font-size:12.5px}
.label .count{float:right;color:var(--mute);font-size:12px;margin-left:6px}
.track{position:relative;flex:1;min-width:0}
.axis .label{cursor:default;color:var(--mute);font-size:12px}
.axis .track{height:28px;background:var(--bg)}
.tick{position:absolute;top:0;bottom:0;border-left:1px solid #cfd4dc;font-size:11px;
 color:var(--mute);padding:6px 0 0 4px;white-space:nowrap}
.fold{position:absolute;top:0;bottom:0;background:repeating-linear-gradient(135deg,#eef0f3 0 4px,
 #f8f9fb 4px 8px);border-left:1px dashed #c3c8d0;border-right:1px dashed #c3c8d0}
.axis .fold span{position:absolute;top:7px;left:0;right:0;text-align:center;font-size:10.5px;
 color:var(--mute)}
.lane.k-session{background:var(--bg)} .lane.k-session .label{background:var(--bg);cursor:default}
.lane.k-session .name{font-size:13.5px}
.lane.k-call .label,.lane.k-agent .label{padding-left:28px}
.lane.k-outside .label,.lane.k-late .label,.lane.k-revert .label{background:#fffdf7}
.lane.k-outside,.lane.k-late,.lane.k-revert{background:#fffdf7}
.lane.k-outside{border-top:2px solid var(--line)}
.bar{position:absolute;height:8px;border-radius:4px;cursor:pointer;opacity:.28;min-width:3px}
.k-turn .bar{background:var(--turn)} .k-call .bar{background:var(--call)}
.k-call.implicit .bar{background:var(--impl)} .k-call.error .bar{background:var(--err);opacity:.45}
.k-session .bar{background:var(--ink);height:3px;opacity:.35}
.k-agent .bar{background:var(--turn)}
.bar:hover{opacity:.5}
.mark{position:absolute;width:11px;height:11px;padding:0;border-radius:50%;cursor:pointer;
 border:2px solid #fff;box-shadow:0 0 0 1px rgba(0,0,0,.25);background:var(--M)}
.mark.st-A{background:var(--A)} .mark.st-D{background:#fff;border:3px solid var(--D);
 box-shadow:none} .mark.st-T{background:var(--T)}
.mark.st-R{background:var(--R);border-radius:2px;transform:rotate(45deg) scale(.9)}
.mark:hover,.mark:focus-visible{box-shadow:0 0 0 3px rgba(47,111,223,.35);outline:0;z-index:2}
.mark.sel{box-shadow:0 0 0 3px var(--ink);z-index:3}
.row.sel .label{box-shadow:inset 3px 0 0 var(--call)}
.empty{color:var(--mute);font-size:12px;position:absolute;left:10px;top:5px}
.cols{display:grid;grid-template-columns:minmax(0,2fr) minmax(0,3fr);gap:16px;align-items:start}
@media (max-width:1100px){.cols{grid-template-columns:1fr}}
#detail{position:sticky;top:8px;border:1px solid var(--line);border-radius:8px;padding:12px}
#diff-meta{color:var(--mute);font-size:12.5px;margin:-4px 0 8px}
#diff{margin:0;font:12px/1.45 ui-monospace,"SFMono-Regular",Menlo,Consolas,monospace;
 background:var(--bg);border-radius:6px;padding:8px 0;overflow:auto;max-height:70vh;
 white-space:pre}
#diff span{display:block;padding:0 10px}
#diff .add{background:#e9f7ee;color:#116b35} #diff .del{background:#fdecec;color:#a11f1f}
#diff .hunk{color:#5b4cc4} #diff .file{font-weight:700;background:#eef1f6;margin-top:6px}
#diff .meta{color:var(--mute)}
#files{border:1px solid var(--line);border-radius:8px;padding:12px}
#files table{border-collapse:collapse;width:100%}
#files td{padding:3px 6px;border-top:1px solid var(--line);vertical-align:top}
#files td.path{font:12.5px ui-monospace,Menlo,monospace;overflow-wrap:anywhere;width:38%}
.chip{display:inline-block;margin:1px 4px 1px 0;padding:0 7px;border-radius:10px;
 font-size:12px;border:1px solid var(--line);background:#fff;cursor:pointer;color:var(--ink);
 white-space:nowrap;max-width:100%;overflow:hidden;text-overflow:ellipsis;vertical-align:top}
.chip i{font-style:normal;font-weight:700;margin-right:4px}
.chip.st-A i{color:var(--A)} .chip.st-M i{color:var(--M)} .chip.st-D i{color:var(--D)}
.chip.st-R i{color:var(--R)} .chip.st-T i{color:var(--T)}
.chip.sel{border-color:var(--ink)}
#legend{color:var(--mute);font-size:12.5px;border:1px solid var(--line);border-radius:8px;
 padding:10px 12px}
#legend .key{display:inline-flex;align-items:center;gap:5px;margin-right:14px}
#legend .mark{position:static;display:inline-block;cursor:default}
#legend .sw{display:inline-block;width:22px;height:8px;border-radius:4px;opacity:.5}
#legend p{margin:6px 0 0}
code{font:12px ui-monospace,Menlo,monospace;background:var(--bg);padding:0 3px;border-radius:3px}
</style></head><body>
<header>
<h1>What happened in <span class="ws">__WORKSPACE__</span></h1>
<div class="summary" id="summary"></div>
</header>
<main>
<section><div id="timeline"></div></section>
<section id="legend">
<span class="key"><span class="mark st-A"></span>added</span>
<span class="key"><span class="mark st-M"></span>modified</span>
<span class="key"><span class="mark st-D"></span>deleted</span>
<span class="key"><span class="mark st-R"></span>moved</span>
<span class="key"><span class="mark st-T"></span>kind changed</span>
<span class="key"><span class="sw" style="background:var(--turn)"></span>turn</span>
<span class="key"><span class="sw" style="background:var(--call)"></span>call</span>
<span class="key"><span class="sw" style="background:var(--impl)"></span>implicit call</span>
<span class="key"><span class="sw" style="background:var(--err)"></span>call that failed</span>
<p id="what-a-mark-is"><b>One mark is one change:</b> one file in a unit's diff, a path the unit
left changed (added, modified, deleted, its mode or kind changed) as <code>overlayrec diff</code>
shows it. A file that moved is one change, old name &rarr; new name, so <code>mv tests
testsuite</code> is one mark per file that moved; directories are not changes by themselves.
A unit is a call (up to its end), a turn's own writes outside its calls, an outside process,
the late writes of one call's background processes, or a revert; a file the unit wrote and put
back as it was (a temp file, a same-content rewrite) is no change. Changes under
<code>.git/</code> are not marked: each lane counts them. A mark stands at the unit's last write
to its file. Click a mark for its file's diff, a bar or a lane's name for the unit's whole diff;
long idle stretches of the time axis are folded (hatched).</p>
</section>
<div class="cols">
<section id="files"><h2>Files</h2><div id="files-body"></div></section>
<section id="detail"><h2 id="diff-title">Click a mark or a call to see its diff</h2>
<div id="diff-meta"></div><pre id="diff"></pre></section>
</div>
</main>
<script id="data" type="application/json">__DATA__</script>
<script>
"use strict";
// an invisible or bidi mark (a format character: U+202E turns the rest of a line around)
// anywhere in the record's text is shown as its escape, never obeyed: names, labels, patches
const MARK = /[\p{Cf}\u2028\u2029]/gu;
const escapeMark = ch => { const h = ch.codePointAt(0).toString(16).toUpperCase();
  return h.length > 4 ? "\\u{" + h + "}" : "\\u" + h.padStart(4, "0"); };
const visible = v => typeof v === "string" ? v.replace(MARK, escapeMark)
  : Array.isArray(v) ? v.map(visible)
  : v && typeof v === "object" ? Object.fromEntries(Object.entries(v).map(
      ([k, x]) => [visible(k), visible(x)])) : v;
// a name is shown as the listings show it (views.shown): C-quoted when it holds a control
// character, a double quote, a backslash or bytes that are not UTF-8 (lone surrogates
// U+DC80-U+DCFF in the data), so a tab or a newline in a name is never a space
const ODD = /[\x00-\x1f\x7f"\\\u{DC80}-\u{DCFF}]/u, ODDS = new RegExp(ODD.source, "gu");
const C_ESC = {"\x07": "\\a", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\v": "\\v",
  "\f": "\\f", "\r": "\\r", "\"": "\\\"", "\\": "\\\\"};
const octal = ch => { const n = ch.codePointAt(0);
  return "\\" + (n >= 0xDC80 ? n - 0xDC00 : n).toString(8).padStart(3, "0"); };
const named = p => typeof p !== "string" || !ODD.test(p) ? p :
  "\"" + p.replace(ODDS, ch => C_ESC[ch] || octal(ch)) + "\"";
const namedAll = d => {
  for (const c of d.changes) { c.path = named(c.path); c.old = named(c.old); }
  for (const f of d.files.own) f.path = named(f.path);
  for (const l of d.lanes) if (l.paths) l.paths = l.paths.map(named);
  return d; };
const D = visible(namedAll(JSON.parse(document.getElementById("data").textContent)));
const el = (tag, cls, text) => { const e = document.createElement(tag);
  if (cls) e.className = cls; if (text !== undefined && text !== null) e.textContent = text;
  return e; };
const pad = (n, w) => String(n).padStart(w || 2, "0");
const clock = (ms, fine) => { const d = new Date(ms);
  return pad(d.getHours()) + ":" + pad(d.getMinutes()) + ":" + pad(d.getSeconds()) +
    (fine ? "." + pad(d.getMilliseconds(), 3) : ""); };
const lasting = ms => ms < 1000 ? Math.round(ms) + " ms" : ms < 60e3 ? (ms / 1e3).toFixed(1) +
  " s" : ms < 3600e3 ? Math.round(ms / 60e3) + " min" : (ms / 3600e3).toFixed(1) + " h";
const WORD = {A: "added", M: "modified", D: "deleted", R: "moved", T: "kind changed"};
const plural = (n, one, many) => n + " " + (n === 1 ? one : (many || one + "s"));
const count = lane => plural(lane.files, "change") +
  (lane.git_changes ? " + " + lane.git_changes + " under .git/" : "");

// -- the time axis: linear, with idle stretches longer than GAP folded to FOLD pixels ------------
function scale(width) {
  const ts = [];
  for (const l of D.lanes) for (const t of [l.begin_t, l.end_t]) if (t) ts.push(t);
  for (const c of D.changes) ts.push(c.t);
  ts.sort((a, b) => a - b);
  if (!ts.length) return null;
  const span = ts[ts.length - 1] - ts[0], GAP = Math.max(30e3, span * 0.15), FOLD = 40,
    EDGE = 10;
  const segs = [{t0: ts[0], t1: ts[0]}];
  for (const t of ts) {
    const s = segs[segs.length - 1];
    if (t - s.t1 > GAP) segs.push({t0: t, t1: t}); else s.t1 = t;
  }
  const busy = segs.reduce((n, s) => n + s.t1 - s.t0, 0);
  const room = Math.max(40, width - 2 * EDGE * segs.length - FOLD * (segs.length - 1));
  const k = busy > 0 ? room / busy : 0;
  let x = 0;
  for (const s of segs) { s.x0 = x + EDGE; x = s.x0 + (s.t1 - s.t0) * k + EDGE; s.x1 = x;
    x += FOLD; }
  if (busy === 0) for (const s of segs) s.x0 += room / 2 / segs.length;
  const at = t => {
    for (let i = 0; i < segs.length; i++) {
      const s = segs[i];
      if (t <= s.t1 || i === segs.length - 1)
        return s.x0 + Math.max(0, Math.min(t, s.t1) - s.t0) * k;
      if (t < segs[i + 1].t0) return s.x1 + FOLD / 2;   // inside a fold
    }
  };
  return {at, segs, k, FOLD};
}

function axis(track, sc) {
  const steps = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 10e3, 15e3, 30e3, 60e3,
    120e3, 300e3, 600e3, 900e3, 1800e3, 3600e3, 7200e3, 21600e3, 43200e3, 86400e3];
  const step = sc.k > 0 ? (steps.find(s => s * sc.k >= 90) || 86400e3) : 0;
  sc.segs.forEach((s, i) => {
    if (i > 0) {
      const f = el("div", "fold"); f.style.left = (sc.segs[i - 1].x1) + "px";
      f.style.width = sc.FOLD + "px"; f.appendChild(el("span", "", "⋯ " + lasting(s.t0 -
        sc.segs[i - 1].t1)));
      track.appendChild(f);
    }
    const first = step ? Math.ceil(s.t0 / step) * step : s.t0;
    const ticks = step ? [] : [s.t0];
    for (let t = first; step && t <= s.t1; t += step) ticks.push(t);
    if (!ticks.length || sc.at(ticks[0]) - s.x0 > 100) ticks.unshift(s.t0);
    for (const t of ticks) {
      const d = el("div", "tick", clock(t, step && step < 1000)); d.style.left = sc.at(t) + "px";
      track.appendChild(d);
    }
  });
}

// -- lanes ---------------------------------------------------------------------------------------
let selected = null;
function select(node) {
  for (const n of document.querySelectorAll(".sel")) n.classList.remove("sel");
  for (const n of node ? [].concat(node) : []) if (n) n.classList.add("sel");
}
function showText(text) {
  const box = document.getElementById("diff"); box.textContent = "";
  const frag = document.createDocumentFragment();
  for (const line of text.replace(/\n$/, "").split("\n")) {
    const cls = line.startsWith("diff --git ") ? "file" : line.startsWith("@@") ? "hunk"
      : line.startsWith("+++ ") || line.startsWith("--- ") || line.startsWith("#") ? "meta"
      : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : "";
    frag.appendChild(el("span", cls, line || " "));
  }
  box.appendChild(frag);
}
function reveal() {
  const d = document.getElementById("detail"), r = d.getBoundingClientRect();
  if (r.top > innerHeight || r.bottom < 0) d.scrollIntoView({block: "nearest"});
}
function showChange(id) {
  const c = D.changes[id], lane = D.lanes[c.lane];
  document.getElementById("diff-title").textContent = WORD[c.status] + " " +
    (c.old ? c.old + " → " : "") + c.path;
  const unit = lane.kind === "call" || lane.kind === "turn" ? lane.label + (lane.sub ? " · " +
    lane.sub : "") : c.who;
  document.getElementById("diff-meta").textContent = "by " + unit + " · " + clock(c.t, true) +
    (lane.processes && lane.processes.length ? " · " + lane.processes.join(", ") : "");
  showText(c.sections.map(i => D.patches[c.patch][i]).join("") ||
    "(no textual diff: git shows this change by its name only)");
  select([...document.querySelectorAll('[data-change="' + id + '"]')]);
  selected = {change: id}; reveal();
}
function showLane(i) {
  const lane = D.lanes[i];
  if (lane.patch === null) return;
  document.getElementById("diff-title").textContent = "Diff of " + lane.label +
    (lane.sub ? " · " + lane.sub : "");
  const span = lane.begin_t ? clock(lane.begin_t, true) + (lane.end_t ? " → " +
    clock(lane.end_t, true) : " (still open)") : "";
  document.getElementById("diff-meta").textContent = [span, count(lane),
    lane.status ? "status " + lane.status : "", (lane.processes || []).join(", "),
    lane.late_events ? plural(lane.late_events, "late write") + " included" : "",
    lane.guessed && lane.guessed.length ? plural(lane.guessed.length, "path") +
      (lane.active_with.length ? " placed here by a guess (calls active together: " +
       lane.active_with.join(", ") + "): " : " placed here by time (written while it ran, by " +
       "a process the agent started outside any call): ") + lane.guessed.slice(0, 6).join(", ")
      : ""]
    .filter(Boolean).join(" · ");
  showText(D.patches[lane.patch].join("") || "(no change)");
  select(document.querySelector('.lane[data-lane="' + i + '"]'));
  selected = {lane: i}; reveal();
}

function laneRow(lane, sc, width) {
  const row = el("div", "row lane k-" + lane.kind + (lane.implicit ? " implicit" : "") +
    (lane.status === "error" ? " error" : ""));
  row.dataset.kind = lane.kind; row.dataset.id = lane.id; row.dataset.lane = lane.index;
  const label = el("div", "label");
  label.appendChild(el("span", "name", lane.label));
  if (lane.kind !== "session" && (lane.files || lane.git_changes || lane.patch !== null))
    label.appendChild(el("span", "count", count(lane)));
  if (lane.sub) label.appendChild(el("span", "sub", lane.sub));
  const names = (lane.paths || []).slice(0, 12).concat(lane.paths && lane.paths.length > 12 ?
    ["... " + (lane.paths.length - 12) + " more"] : []).concat(lane.git_changes ?
    ["+ " + lane.git_changes + " under .git/"] : []);
  label.title = lane.label + (lane.sub ? "\n" + lane.sub : "") +
    (lane.processes && lane.processes.length ? "\nprocesses: " + lane.processes.join(", ") : "") +
    (names.length ? "\n\n" + names.join("\n") : "");
  label.addEventListener("click", () => showLane(lane.index));
  row.appendChild(label);
  const track = el("div", "track"); row.appendChild(track);
  if (!sc) return row;
  if (lane.begin_t) {
    const b = el("div", "bar"), x0 = sc.at(lane.begin_t),
      x1 = sc.at(lane.end_t || D.summary.last_t || lane.begin_t);
    b.style.left = x0 + "px"; b.style.width = Math.max(3, x1 - x0) + "px";
    b.title = lane.label + ": " + clock(lane.begin_t, true) + (lane.end_t ? " → " +
      clock(lane.end_t, true) : "");
    b.addEventListener("click", () => showLane(lane.index));
    track.appendChild(b);
  }
  // marks: nearer than a mark's width in one lane go on rows of their own, none hidden
  const SIZE = 13, rows = [];
  for (const id of lane.marks) {
    const c = D.changes[id], x = sc.at(c.t);
    let r = rows.findIndex(end => x - end >= SIZE);
    if (r < 0) { r = rows.length; rows.push(0); }
    rows[r] = x;
    const m = el("button", "mark st-" + c.status);
    m.type = "button";
    m.style.left = (x - 5.5) + "px"; m.style.top = (7 + r * SIZE) + "px";
    m.dataset.change = id; m.dataset.path = c.path;
    m.title = WORD[c.status] + " " + (c.old ? c.old + " → " : "") + c.path + "\n" + c.who +
      " · " + clock(c.t, true);
    m.setAttribute("aria-label", m.title);
    m.addEventListener("click", ev => { ev.stopPropagation(); showChange(id); });
    track.appendChild(m);
  }
  row.style.minHeight = Math.max(26, 14 + rows.length * SIZE) + "px";
  if (lane.begin_t) { const bar = track.querySelector(".bar");
    bar.style.top = (Math.max(26, 14 + rows.length * SIZE) / 2 - 4) + "px"; }
  if (!lane.marks.length && !lane.begin_t && lane.kind !== "session")
    track.appendChild(el("span", "empty", "none"));
  return row;
}

function drawTimeline() {
  const tl = document.getElementById("timeline"); tl.textContent = "";
  const labelW = parseFloat(getComputedStyle(document.documentElement)
    .getPropertyValue("--label")) || 300;
  const width = Math.max(200, tl.clientWidth - labelW - 2);
  const sc = scale(width - 16);
  const head = el("div", "row axis"); head.appendChild(el("div", "label",
    sc ? "time (local)" : "nothing recorded"));
  const track = el("div", "track"); head.appendChild(track); tl.appendChild(head);
  if (sc) axis(track, sc);
  for (const lane of D.lanes) tl.appendChild(laneRow(lane, sc, width));
  if (selected && selected.change !== undefined) select([...document.querySelectorAll(
    '[data-change="' + selected.change + '"]')]);
  else if (selected) select(document.querySelector('.lane[data-lane="' + selected.lane + '"]'));
}

function drawSummary() {
  const s = D.summary, parts = [
    plural(s.sessions, "session"), plural(s.turns, "turn"), plural(s.calls, "call"),
    plural(s.changes, "change") + " to " + plural(s.files, "file"),
    s.outside + " from outside", s.late + " late"];
  if (s.git_changes) parts.push("+ " + s.git_changes + " under .git/");
  if (s.first_t) parts.push(new Date(s.first_t).toLocaleDateString() + " " +
    clock(s.first_t) + " → " + clock(s.last_t) + " (" + lasting(s.last_t - s.first_t) + ")");
  const box = document.getElementById("summary");
  parts.forEach((p, i) => { if (i) box.appendChild(document.createTextNode(" · "));
    box.appendChild(el("b", "", p)); });
}

function drawFiles() {
  const body = document.getElementById("files-body"), t = el("table");
  for (const f of D.files.own) {
    const tr = el("tr"), td = el("td");
    tr.appendChild(el("td", "path", f.path));
    for (const id of f.changes) {
      const c = D.changes[id], lane = D.lanes[c.lane];
      const chip = el("button", "chip st-" + c.status);
      chip.type = "button"; chip.dataset.change = id;
      chip.appendChild(el("i", "", c.status));
      chip.appendChild(document.createTextNode(c.who + (c.old && c.old === f.path ?
        " → " + c.path : c.old ? " ← " + c.old : "")));
      chip.title = WORD[c.status] + " at " + clock(c.t, true) + " (" + lane.label + ")";
      chip.addEventListener("click", () => showChange(id));
      td.appendChild(chip);
    }
    tr.appendChild(td); t.appendChild(tr);
  }
  if (D.files.git.changes) {
    const tr = el("tr"); tr.appendChild(el("td", "path", ".git/"));
    tr.appendChild(el("td", "", plural(D.files.git.changes, "change") + " under .git/, folded" +
      " (by " + D.files.git.units.join(", ") + ")"));
    t.appendChild(tr);
  }
  if (!t.children.length) body.appendChild(el("p", "", "No file changed."));
  else body.appendChild(t);
}

drawSummary(); drawTimeline(); drawFiles();
let resizing = null;
addEventListener("resize", () => { clearTimeout(resizing);
  resizing = setTimeout(drawTimeline, 80); });
const open = location.hash.match(/^#(change|lane)=(\d+)$/);
if (open) (open[1] === "change" ? showChange : showLane)(Number(open[2]));
</script></body></html>
"""


def render(data: dict) -> str:
    """The page for report.report_data's ``data`` (ASCII but for the workspace's name)."""
    # the JSON stays inside its script element: no "</" (nor "<!--") can end or comment it
    blob = json.dumps(data).replace("<", "\\u003c")
    name = _visible(data["workspace"].encode("utf-8", "surrogateescape").decode("utf-8",
                                                                                "replace"))
    fill = {"__TITLE__": html.escape(name), "__WORKSPACE__": html.escape(name), "__DATA__": blob}
    return re.sub("__TITLE__|__WORKSPACE__|__DATA__", lambda m: fill[m.group(0)], PAGE)


def _visible(text: str) -> str:
    """``text`` with each invisible or bidi mark (a format character) as its escape, as the
    page's script shows the record's text (``visible``)."""
    if text.isprintable():
        return text
    return "".join((f"\\u{ord(ch):04X}" if ord(ch) <= 0xFFFF else f"\\u{{{ord(ch):X}}}")
                   if unicodedata.category(ch) == "Cf" or ch in "\u2028\u2029" else ch
                   for ch in text)
