"""``dapo-lightning inspect RUN``: the samples a run wrote (``SampleLog``'s JSONL files,
docs/samples.md) as one self-contained HTML page: no server, no network, opened from a
``file://`` URL. Steps -> groups -> samples, with filters (kept / dropped groups, right / wrong
samples, truncated ones) and the validations beside the rollouts.

The page's state can be given in its URL's fragment, which the filters also write:
``samples.html#source=validation&step=4&show=wrong`` (``show``: ``kept``, ``dropped``,
``right``, ``wrong``, ``truncated``, comma-separated).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

Row = dict[str, Any]

#: The columns the page shows (the files hold more).
ROLLOUT_FIELDS = (
    "step", "group", "sample", "prompt_id", "prompt", "response", "reward", "score", "acc",
    "advantage", "filter", "trained", "truncated", "length", "staleness",
)  # fmt: skip
VALIDATION_FIELDS = (
    "step", "group", "sample", "prompt_id", "prompt", "response", "score", "acc", "truncated",
    "length",
)  # fmt: skip


def sample_files(run_dir: str | Path, kind: str) -> list[Path]:
    """A run's ``kind`` files (``rollouts`` or ``validation``), every rank's, under
    ``RUN_DIR/samples`` or ``RUN_DIR`` itself."""
    run = Path(run_dir)
    for folder in (run / "samples", run):
        found = sorted(folder.glob(f"{kind}-rank*.jsonl"))
        if found:
            return found
    return []


def read_samples(paths: Iterable[Path], fields: Iterable[str]) -> list[Row]:
    """The rows of ``paths`` with only ``fields`` (a torn last line skipped)."""
    keep = tuple(fields)
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                rows.append({k: row.get(k) for k in keep})
    return rows


def render_page(rollouts: list[Row], validation: list[Row], title: str) -> str:
    """The HTML page of these rows (the data inline as JSON, the script inline)."""
    data = json.dumps({"rollouts": rollouts, "validation": validation}, ensure_ascii=False)
    data = data.replace("</", "<\\/")  # never closes the script element early
    safe_title = title.replace("&", "&amp;").replace("<", "&lt;")
    return PAGE.replace("__TITLE__", safe_title).replace("__DATA__", data)


def write_page(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``RUN_DIR``'s sample page (default ``RUN_DIR/samples.html``); returns its path.

    Raises:
        FileNotFoundError: no sample file under ``run_dir``.
    """
    rollout_paths = sample_files(run_dir, "rollouts")
    validation_paths = sample_files(run_dir, "validation")
    if not rollout_paths and not validation_paths:
        raise FileNotFoundError(
            f"no sample files (samples/rollouts-rank*.jsonl) under {run_dir}: run the fit with "
            "the SampleLog callback (docs/samples.md) and point inspect at its run directory."
        )
    page = render_page(
        read_samples(rollout_paths, ROLLOUT_FIELDS),
        read_samples(validation_paths, VALIDATION_FIELDS),
        f"samples of {Path(run_dir).resolve().name}",
    )
    path = Path(out) if out is not None else Path(run_dir) / "samples.html"
    path.write_text(page, encoding="utf-8")
    return path


def inspect_main(argv: list[str]) -> None:
    """``dapo-lightning inspect RUN_DIR [--out HTML]``: prints the page's path. No sample file
    is one ``error:`` line, exit status 2."""
    parser = argparse.ArgumentParser(prog="dapo-lightning inspect", description=__doc__)
    parser.add_argument("run_dir", help="run directory of a fit with SampleLog")
    parser.add_argument("--out", default=None, help="HTML path (default RUN_DIR/samples.html)")
    args = parser.parse_args(argv)
    try:
        path = write_page(args.run_dir, args.out)
    except FileNotFoundError as err:
        parser.exit(2, f"dapo-lightning inspect: error: {err}\n")
    print(path)


PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:system-ui,sans-serif;margin:0;display:flex;height:100vh;color:#222}
nav{width:210px;overflow-y:auto;border-right:1px solid #ccc;padding:8px;background:#f6f6f6}
nav button{display:block;width:100%;text-align:left;margin:2px 0;border:0;padding:4px;
 background:none;cursor:pointer;font:inherit}
nav button.on{background:#dde8ff}
main{flex:1;overflow-y:auto;padding:10px 16px}
.bar label{margin-right:12px}
.group{border:1px solid #ccc;border-radius:6px;margin:10px 0;padding:6px 10px}
.group.dropped{background:#fafafa;border-style:dashed}
.head{font-weight:600;margin-bottom:4px}
.sample{display:flex;gap:10px;border-top:1px solid #eee;padding:3px 0;font-size:14px}
.sample .text{flex:1;white-space:pre-wrap;font-family:ui-monospace,monospace}
.right{border-left:4px solid #2a2}.wrong{border-left:4px solid #c33}
.num{width:115px;white-space:nowrap;color:#555;text-align:right}
.tag{font-size:12px;color:#fff;background:#888;border-radius:3px;padding:0 4px}
</style></head><body>
<nav><b>__TITLE__</b><div id="sources"></div><div id="steps"></div></nav>
<main><div class="bar">
<label><input type="checkbox" id="kept" checked> kept groups</label>
<label><input type="checkbox" id="dropped" checked> dropped groups</label>
<label><input type="checkbox" id="right" checked> right</label>
<label><input type="checkbox" id="wrong" checked> wrong</label>
<label><input type="checkbox" id="truncated"> truncated only</label>
<span><span id="count">0</span> samples shown</span></div>
<div id="groups"></div></main>
<script type="application/json" id="data">__DATA__</script>
<script>
const D = JSON.parse(document.getElementById("data").textContent);
const S = {source: D.rollouts.length ? "rollouts" : "validation", step: null};
const F = ["kept", "dropped", "right", "wrong", "truncated"];
function el(tag, cls, text) {
  const e = document.createElement(tag); if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text; return e;
}
function fmt(v) { return v === null || v === undefined ? "-" : (typeof v === "number" ?
  (Number.isInteger(v) ? String(v) : v.toFixed(3)) : String(v)); }
function readHash() {
  const p = new URLSearchParams(location.hash.slice(1));
  if (p.get("source")) S.source = p.get("source");
  if (p.get("step")) S.step = Number(p.get("step"));
  if (p.get("show")) {
    const show = p.get("show").split(",");
    const only = (a, b) => { if (show.includes(a) && !show.includes(b)) byId(b).checked = false; };
    only("kept", "dropped"); only("dropped", "kept"); only("right", "wrong"); only("wrong", "right");
    byId("truncated").checked = show.includes("truncated");
  }
}
function byId(id) { return document.getElementById(id); }
function rows() { return D[S.source] || []; }
function isKept(r) { return r.filter === undefined || r.filter === null || r.filter === "kept"; }
function shown(r) {
  if (isKept(r) ? !byId("kept").checked : !byId("dropped").checked) return false;
  if (r.acc > 0 ? !byId("right").checked : !byId("wrong").checked) return false;
  return !byId("truncated").checked || r.truncated;
}
function renderNav() {
  const src = byId("sources"); src.innerHTML = "";
  for (const name of ["rollouts", "validation"]) {
    const b = el("button", name === S.source ? "on" : "", name + " (" + D[name].length + ")");
    b.onclick = () => { S.source = name; S.step = null; render(); }; src.appendChild(b);
  }
  const steps = [...new Set(rows().map(r => r.step))].sort((a, b) => a - b);
  if (S.step === null || !steps.includes(S.step)) S.step = steps.length ? steps[steps.length - 1] : null;
  const nav = byId("steps"); nav.innerHTML = "";
  for (const s of steps) {
    const mine = rows().filter(r => r.step === s);
    const acc = mine.reduce((a, r) => a + (r.acc || 0), 0) / mine.length;
    const b = el("button", s === S.step ? "on" : "", "step " + s + "  acc " + acc.toFixed(2));
    b.onclick = () => { S.step = s; render(); }; nav.appendChild(b);
  }
}
function renderGroups() {
  const box = byId("groups"); box.innerHTML = ""; let count = 0;
  const groups = new Map();
  for (const r of rows().filter(r => r.step === S.step)) {
    if (!groups.has(r.group)) groups.set(r.group, []); groups.get(r.group).push(r);
  }
  for (const [g, members] of groups) {
    const show = members.filter(shown); if (!show.length) continue;
    const first = members[0], mean = members.reduce((a, r) => a + (r.acc || 0), 0) / members.length;
    const card = el("div", "group" + (isKept(first) ? "" : " dropped"));
    card.appendChild(el("div", "head", "group " + g + " | " + (first.prompt_id || "") + " | " +
      (first.filter || "validation") + " | acc " + mean.toFixed(2) + " | " + first.prompt));
    for (const r of show) {
      const row = el("div", "sample " + (r.acc > 0 ? "right" : "wrong"));
      row.appendChild(el("span", "text", r.response));
      if (r.truncated) row.appendChild(el("span", "tag", "truncated"));
      for (const k of ["reward", "acc", "advantage", "length"])
        if (k in r) row.appendChild(el("span", "num", k + " " + fmt(r[k])));
      card.appendChild(row); count++;
    }
    box.appendChild(card);
  }
  byId("count").textContent = String(count);
}
function writeHash() {
  const show = F.filter(f => byId(f).checked);
  try { history.replaceState(null, "", "#source=" + S.source + "&step=" + S.step + "&show=" +
    show.join(",")); } catch (e) { /* a browser that refuses it on file:// */ }
}
function render() { renderNav(); renderGroups(); writeHash(); }
for (const f of F) byId(f).onchange = render;
readHash(); render();
</script></body></html>
"""
