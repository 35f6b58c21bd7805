"""How the loop's results look to a person: an iteration's verdict, the loop's status."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from flaloop.core.workspace import Workspace
from flaloop.loop import records
from flaloop.loop.store import Iteration
from flaloop.report import fmt, opt_log


def print_iteration(it: Iteration, ws: Workspace, console: Console) -> None:
    style = fmt.status_style(it.status)
    console.print(f"iteration {it.iter}: [{style}]{it.status}[/]  {escape(it.direction)}", markup=True)
    console.print(f"  {escape(it.note)}", markup=True)
    console.print(f"  vs best ({it.best_before[:12]}): {opt_log.comparison_text(it.vs_best, link=False)}")
    console.print(f"  vs base: {opt_log.comparison_text(it.vs_base, link=False)}")
    for f in it.guard["findings"]:
        console.print(f"  [red]guard[/] {escape(f['rule'])} {escape(f.get('where') or '')}: "
                      f"{escape(f['message'])}", markup=True)
    console.print(f"  committed {it.commit[:12]} ({len(it.files)} file(s): {', '.join(it.files[:5])})")
    if it.revert_commit:
        console.print(f"  reverted in {it.revert_commit[:12]}: the tree is back at the best; the attempt stays "
                      f"in `git log`")
    console.print(f"  row: {records.render_row(opt_log.iteration_row(it))}")
    console.print(f"  log: {ws.opt_log}")


def print_status(st: dict, console: Console) -> None:
    console.print(f"[bold]{escape(st['op'])}[/]: phase [bold]{escape(st['phase'])}[/]", markup=True)
    counts = ", ".join(f"{k} {v}" for k, v in st["counts"].items() if v)
    console.print(f"  iterations: {st['iterations']} of {st['max_iters']}" + (f" ({counts})" if counts else ""))
    b = st["best"]
    if b:
        what = "the base" if b["status"] == "baseline" else f"iteration {b['iter']} \"{b['direction']}\""
        console.print(f"  best: {what} ({b['commit'][:12]})" +
                      (f", {fmt.speedup(b['vs_base'])} vs base" if b["vs_base"] else ""))
    t = st["target"]
    if t["met"]:
        console.print(f"  target {t['speedup']:g}x: met")
    else:
        gap = f"{t['remaining']:+.1%} to go" if t["remaining"] is not None else "no kept speedup yet"
        console.print(f"  target {t['speedup']:g}x: {gap}")
    s = st["stall"]
    console.print(f"  stall: {s['count']} of {s['limit']} non-keep iterations in a row"
                  + (" (stalled)" if s["stalled"] else ""))
    g = st["last_gate"]
    if g:
        console.print(f"  last gate: iteration {g['iter']}: {opt_log.gate_text(g)}")
    for cond in st["stop_conditions"]:
        console.print(f"  stop condition: {cond}")
    if st["stopped"]:
        console.print(f"  stopped: {st['stopped']['verdict']} after iteration {st['stopped']['after_iter']}")
    for e in st["opt_log"]["hand_edits"]:
        console.print(f"  [red]OPT_LOG.md hand-edited at {escape(e['where'])}[/]", markup=True)
    usage = (st.get("workspace") or {}).get("usage")
    if usage:
        console.print(f"  workspace: {usage['total'] / 1e6:.1f} MB in {usage['n_runs']} run record(s), "
                      f"triton-cache {usage['triton-cache'] / 1e6:.1f} MB (`flaloop clean {st['op']} --keep N` prunes)")
    console.print(f"  next: {st['next']}")
