"""A self-contained HTML timeline of recorded sessions: turns, their calls, the processes each
call ran and the files each wrote, outside actors in a lane of their own, each call's diff a
click away.  One file, no network, no build step: the data is embedded as JSON."""
from __future__ import annotations

import html
import json

from ..journal import Journal
from ..views import call_rows, turn_rows, command_name, unit_listing
from .diff import file_events, net_of


def report_data(j: Journal, diff_of, states=None) -> dict:
    """``diff_of(call_row, side)`` gives a call's patch text (``side``: the call's Side, None
    without ``states``).  With ``states``, every unit names only the paths it left changed
    (net; ``touched``: all it wrote), the workspace's own first, those under .git/ counted."""
    sides: dict = {}
    net = net_of(states) if states is not None else None
    calls = call_rows(j, net=net, sides=sides)
    turns = turn_rows(j, net=net)
    sessions = {}
    for t in turns:
        sessions.setdefault(t["session"], {"id": t["session"], "turns": [], "calls": []})
        sessions[t["session"]]["turns"].append(t)
    for c in calls:
        s = sessions.setdefault(c["session"], {"id": c["session"], "turns": [], "calls": []})
        s["calls"].append({k: c[k] for k in ("id", "tool", "summary", "turn", "begin_t", "end_t",
                                              "status", "paths", "files", "git_changes",
                                              "touched", "processes", "late_events",
                                              "implicit")}
                          | {"diff": diff_of(c, sides.get((c["session"], c["id"])))})
    outside: dict[str, dict] = {}
    by_actor: dict[str, list[dict]] = {}
    for e in file_events(j):
        unit = e.get("unit") or "outside:" + e["actor"]
        if not unit.startswith("outside:"):
            continue
        by_actor.setdefault(e["actor"], []).append(e)
        o = outside.setdefault(e["actor"], {"actor": e["actor"], "first_t": e["t"]})
        if o.get("name") is None:
            a = j.actor(e["actor"])
            o["name"] = f"{command_name(a)}[{a['pid'] if a else '?'}]"
        o["last_t"] = e["t"]
    for key, o in outside.items():
        o.update(unit_listing(net, by_actor[key])[0])
    return {"sessions": list(sessions.values()), "outside": list(outside.values())}


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>overlayrec report</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em} h2{font-size:1.1em;margin-top:1.5em}
.lane{display:flex;flex-wrap:wrap;gap:.4em;align-items:flex-start;margin:.3em 0 .8em 0}
.turn{border-left:3px solid #36c;padding-left:.6em;margin:.6em 0}
.turn .prompt{color:#555;font-style:italic}
.call{border:1px solid #bbb;border-radius:4px;padding:.3em .5em;cursor:pointer;background:#f7f9ff;max-width:22em}
.call:hover{background:#e6eeff} .call.error{border-color:#c33}
.call .tool{font-weight:600} .call .meta{font-size:.85em;color:#555}
.outside{border:1px dashed #a70;background:#fff8ec;border-radius:4px;padding:.3em .5em}
#diff{white-space:pre;font:12px ui-monospace,monospace;background:#fafafa;border:1px solid #ddd;
padding:.6em;margin-top:1em;overflow:auto;max-height:60vh}
.add{color:#070}.del{color:#a00}.hunk{color:#36c}
</style></head><body>
<h1>overlayrec: what happened in __WORKSPACE__</h1>
<div id="timeline"></div>
<h2 id="diff-title">Click a call to see its diff</h2>
<div id="diff"></div>
<script id="data" type="application/json">__DATA__</script>
<script>
const data = JSON.parse(document.getElementById('data').textContent);
const el = (tag, cls, text) => { const e = document.createElement(tag);
  if (cls) e.className = cls; if (text !== undefined) e.textContent = text; return e; };
const when = ns => new Date(ns / 1e6).toLocaleTimeString();
// a unit's net changes: the workspace's own files, then those under .git/ as a count
const files = u => u.files + ' file(s)' + (u.git_changes ? ' + ' + u.git_changes + ' under .git/' : '');
const own = u => u.paths.slice(0, u.files);
function showDiff(call) {
  document.getElementById('diff-title').textContent = 'Diff of ' + call.tool + ' ' + call.id;
  const box = document.getElementById('diff'); box.textContent = '';
  for (const line of (call.diff || '(no change)').split('\\n')) {
    const cls = line.startsWith('+') && !line.startsWith('+++') ? 'add'
      : line.startsWith('-') && !line.startsWith('---') ? 'del' : line.startsWith('@@') ? 'hunk' : '';
    box.appendChild(el('div', cls, line));
  }
}
function callBox(call) {
  const b = el('div', 'call' + (call.status === 'error' ? ' error' : ''));
  b.id = 'call-' + call.id;
  b.appendChild(el('div', 'tool', call.tool + (call.implicit ? ' (implicit)' : '')));
  if (call.summary) b.appendChild(el('div', 'summary', call.summary));
  b.appendChild(el('div', 'meta', when(call.begin_t) + ' · ' + files(call) +
    (call.late_events ? ' · ' + call.late_events + ' late write(s)' : '')));
  b.appendChild(el('div', 'meta', call.processes.join(', ')));
  b.title = own(call).concat(call.git_changes ? ['+ ' + call.git_changes + ' under .git/'] : [])
    .join('\\n');
  b.addEventListener('click', () => showDiff(call));
  return b;
}
const tl = document.getElementById('timeline');
for (const s of data.sessions) {
  tl.appendChild(el('h2', '', 'Session ' + s.id));
  const byTurn = {};
  for (const c of s.calls) (byTurn[c.turn] = byTurn[c.turn] || []).push(c);
  const turns = s.turns.length ? s.turns
    : [{index: null, prompt: null, begin_t: 0, files: 0, git_changes: 0, paths: []}];
  for (const t of turns) {
    const d = el('div', 'turn');
    d.id = 'turn-' + s.id + '-' + t.index;
    d.appendChild(el('div', '', (t.index === null ? 'Calls' : 'Turn ' + t.index + ' · ' +
      when(t.begin_t) + ' · ' + files(t)) + (t.others && t.others.length ?
      ' · shared with ' + t.others.join(', ') : '')));
    if (t.prompt) d.appendChild(el('div', 'prompt', t.prompt.split('\\n')[0]));
    const lane = el('div', 'lane');
    for (const c of byTurn[t.index] || []) lane.appendChild(callBox(c));
    d.appendChild(lane); tl.appendChild(d);
  }
}
if (data.outside.length) {
  tl.appendChild(el('h2', '', 'Outside the sessions'));
  const lane = el('div', 'lane'); lane.id = 'outside';
  for (const o of data.outside) lane.appendChild(el('div', 'outside',
    o.name + ': ' + own(o).slice(0, 5).join(', ') + (o.files > 5 ? ' …' : '') +
    (o.git_changes ? ' + ' + o.git_changes + ' under .git/' : '')));
  tl.appendChild(lane);
}
const m = location.hash.match(/^#open=(.+)$/);
if (m) { const b = document.getElementById(decodeURIComponent(m[1])); if (b) b.click(); }
</script></body></html>
"""


def render(data: dict, workspace: str) -> str:
    blob = json.dumps(data).replace("</", "<\\\\/")  # keep the JSON inside its script element
    return PAGE.replace("__WORKSPACE__", html.escape(workspace)).replace("__DATA__", blob)
