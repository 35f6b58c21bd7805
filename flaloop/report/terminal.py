"""How gate results and bench records look to a person (JSON callers get the dicts themselves)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from flaloop.bench.evidence import contention_line
from flaloop.bench.record import RunRecord
from flaloop.guard.findings import Finding
from flaloop.report import fmt
from flaloop.report.cells import CellView
from flaloop.task import gate as gate_mod


def print_table(console: Console, table: Table, drop: Sequence[str] = ()) -> list[str]:
    """A table that fits where it is printed. In a terminal (or under COLUMNS) it gets the width there
    is: the columns named in `drop` go, least needed first, until the rest fit whole, and a line says
    which went (--json has them all); the names of those that went are returned. Elsewhere (files,
    pipes, CI logs) it prints at its full width."""
    unbounded = console.options.update_width(10**6)  # a measurement the console's width does not clamp
    for col in table.columns:  # rich measures a column by its longest word; a no_wrap one needs its longest cell
        if col.no_wrap:
            col.min_width = max(col.min_width or 0, *(Measurement.get(console, unbounded, x).maximum
                                                      for x in (col.header, *col.cells)))
    if not (console.is_terminal or os.environ.get("COLUMNS", "").isdigit()):
        wide, console.width = console.width, 10**4  # print(width=) may only narrow: widen the console itself
        try:
            console.print(table, crop=False)  # as wide as its content: all of it, uncut
        finally:
            console.width = wide
        return []
    hidden = []
    for name in drop:
        if Measurement.get(console, unbounded, table).minimum <= console.width:
            break
        at = next((i for i, c in enumerate(table.columns) if c.header == name), None)
        if at is not None:
            table.columns.pop(at)
            hidden.append(name)
    console.print(table)
    if hidden:
        console.print(f"({', '.join(hidden)} hidden to fit {console.width} columns; a wider terminal or --json has them)")
    return hidden


def print_gate(r: gate_mod.GateResult, console: Console) -> None:
    label = f"[{fmt.GATE_STYLE[bool(r.green)]}]{'GREEN' if r.green else 'RED'}[/]"
    scope = f"  [yellow](signal only: -k {escape(repr(r.k_expr))})[/]" if r.signal_only else ""
    console.print(f"{label} gate {escape(r.op)}: {escape(r.test_file)}{scope}", markup=True)
    if r.reused_from:
        console.print(f"  reused: the green gate of {r.reused_from} ran on the same tree state, contract, frozen "
                      "hashes, environment and interpreter (--regate runs it again)")
    if r.run:
        n = r.run
        console.print(f"  {n.passed} passed, {n.failed} failed, {n.skipped} skipped, {n.errors} errors; "
                      f"{len(n.selected)} selected, {n.ran} ran; pytest exit {n.exit_code}; "
                      f"{n.junit_time:.1f}s in pytest, {r.wall_s:.1f}s wall")
    if r.oom_retry:
        o = r.oom_retry
        console.print(f"  {len(o['ids'])} test(s) ran out of GPU memory beside {o['workers'] - 1} other workers; "
                      f"run again alone, one at a time: {len(o['passed_alone'])} passed, "
                      f"{len(o['still_failing'])} still failing ({o['wall_s']:.1f}s)")
        for i, why in list(o["still_failing"].items())[:10]:
            console.print(f"      {escape(i)}: {escape(str(why)[:200])}", markup=True)
    if r.baseline:
        how = {"collect": "collected, skip markers evaluated", "full": "full run"}.get(r.baseline.get("kind"), "")
        cached = ", cached" if r.baseline.get("cached") else ""
        console.print(f"  base {r.base_commit[:12]}: {len(r.baseline['selected'])} selected, "
                      f"{r.baseline['skipped']} skipped ({how}{cached})")
    tree = r.tree
    console.print(f"  tree: {tree['head'][:12]}{' + uncommitted ' + str(tree['diff_hash']) if tree['dirty'] else ''}")
    for f in r.findings:
        console.print(f"  [red]x[/] {escape(f.message)}", markup=True)
        if f.detail:
            for line in f.detail.splitlines()[:40]:
                console.print(f"      {line}")
    if r.log_path:
        console.print(f"  log: {r.log_path}")


def tree_label(t) -> str:
    """A side of a measurement as a person names it: the ref, and the commit (HEAD + dirty for a snapshot)."""
    if t.ref == "working tree":
        return fmt.tree_state(t.head or t.commit, t.dirty, t.diff_hash)
    return f"{t.ref} ({t.commit[:12]})" if t.ref and not t.commit.startswith(t.ref) else t.commit[:12]


# what a narrow terminal loses first: the eager latencies, then the timer, the roofline share, the pairs
BENCH_DROP = ("eager base", "eager cand", "timer", "% floor", "pairs", "note")


def unseen_line(u: dict | None) -> str | None:
    """One line (markup) on the shapes nobody times that the warm-up checked (bench/unseen.py)."""
    if not u:
        return None
    if u.get("off"):
        return f"[yellow]unseen shapes: not checked ({escape(str(u['off']))})[/]"
    share = f" ({u['share']:.0%} of the run)" if u.get("share") is not None else ""
    what = "unseen shapes (A/A: the base against itself, compiled for the iterations)" if u.get("aa") else "unseen shapes"
    text = (f"{what}: {u.get('checked', 0)} checked, {u.get('differ', 0)} differ, "
            f"{u.get('seconds', 0.0):.1f} s{share}, seed {u.get('seed')}")
    if u.get("unstable"):
        text += f"; {u['unstable']} unstable (the base differs from itself there: a later finding may be noise)"
    skips = [(f"{shp['name']}/{mode}", v.get("why", "")) for shp in u.get("shapes") or []
             for mode, v in (shp.get("modes") or {}).items() if v.get("status") == "skipped"]
    if skips:
        text += f"; {len(skips)} skipped ({escape(skips[0][0])}: {escape(skips[0][1][:100])})"
    if u.get("on_path_because"):
        n = sum(1 for shp in u.get("shapes") or [] if shp.get("on_path"))
        text += (f"; {n} drawn with the cells' head dims, since {escape(', '.join(u['on_path_because']))} served "
                 f"none of the others")
    if u.get("off_path"):
        text += f"; [yellow]none ran {escape(', '.join(u['off_path']))}, which the cells ran[/]"
    if u.get("stopped"):
        text += f"; stopped early: {escape(u['stopped'])}"
    return f"[bold red]{text}[/]" if u.get("differ") else text


def replay_lines(record: RunRecord) -> list[str]:
    """A line (markup) each on the option combinations and the test's own calls the warm-up replayed
    (bench/options.py, bench/replay.py)."""
    lines = []
    for what, part, items in (("unseen options", (record.unseen or {}).get("options"), "combos"),
                              ("test calls", record.test_calls, "calls")):
        if not part:
            continue
        if part.get("off"):
            lines.append(f"[yellow]{what}: not checked ({escape(str(part['off']))})[/]")
            continue
        share = f" ({part['share']:.0%} of the run)" if part.get("share") is not None else ""
        text = (f"{what}: {part.get('checked', 0)} checked, {part.get('differ', 0)} differ, "
                f"{part.get('seconds', 0.0):.1f} s{share}")
        skips = [x for x in part.get(items) or [] if x.get("status") == "skipped"]
        if skips:
            text += f"; {len(skips)} skipped ({escape(str(skips[0].get('why', ''))[:100])})"
        if part.get("unstable"):
            text += f"; {part['unstable']} unstable (the base differs from itself there)"
        if part.get("stopped"):
            text += f"; stopped early: {escape(part['stopped'])}"
        lines.append(f"[bold red]{text}[/]" if part.get("differ") else text)
    return lines


def print_bench(record: RunRecord, console: Console) -> None:
    env = record.env or {}
    parts = [env.get("device_name") or env.get("device") or "?"]
    parts += [f"{k} {env[key]}" for k, key in (("driver", "driver"), ("CUDA", "cuda"), ("torch", "torch"),
                                               ("triton", "triton")) if env.get(key)]
    parts += [f"base {record.base.commit[:12]}", f"candidate {'A/A' if record.aa else tree_label(record.candidate)}"]
    cand_env = getattr(record.config, "cand_env", None) or {}
    if cand_env:
        parts.append("candidate's environment " + " ".join(f"{k}={v}" for k, v in sorted(cand_env.items())))
    console.print(" | ".join(parts))
    if env.get("nvml") not in (None, "ok", "no GPU"):
        console.print(f"[yellow]no clock evidence: {escape(str(env['nvml']))}[/]", markup=True)
    shared = contention_line(env.get("contention"))
    if shared:
        console.print(f"[yellow]{escape(shared)}[/]", markup=True)
    last = record.last_gate
    if record.unverified and last:
        state = "GREEN" if last["green"] else "RED"
        scope = " (signal only, -k)" if last["signal_only"] else ""
        by = f", by {last['reused_from']}" if str(last.get("reused_from") or "").startswith("iteration") else ""
        console.print(f"gate: not run by this command; the last gate of this exact tree state was {state}{scope} "
                      f"({last['started']}{by})")
    elif record.unverified:
        console.print("[bold red]UNVERIFIED: no correctness gate ran before this benchmark "
                      "(`flaloop verify` runs the gate first)[/]", markup=True)
    table = Table(title=f"{record.op}: candidate vs base (device time per call, ms)")
    for col in ("shape", "mode", "timer", "base", "cand", "speedup", "95% CI", "verdict", "pairs", "eager base",
                "eager cand", "% floor", "note"):
        # a number is shown whole or not at all; the note folds, but keeps room to be read
        table.add_column(col, no_wrap=col != "note", overflow="fold", min_width=14 if col == "note" else None)
    notes: list[tuple[str, str]] = []
    for v in map(CellView.of, record.cells):
        table.add_row(
            v.shape_name, v.mode_label, v.timer or "-", fmt.ms(v.ms("base")), fmt.ms(v.ms("cand")),
            fmt.speedup(v.speedup), fmt.interval(v.ci_low, v.ci_high), v.verdict or "-", v.pairs_label,
            fmt.ms(v.ms("base", eager=True)), fmt.ms(v.ms("cand", eager=True)),
            fmt.floor_share(v.floor.get("pct_of_floor_cand"), v.floor.get("above_100")), v.note)
        if v.note:
            notes.append((v.id, v.note))
    if "note" in print_table(console, table, drop=BENCH_DROP):  # then each cell's note on a line of its own
        for cell, note in notes:
            console.print(f"  {cell}: {note}")
    s = record.summary
    g = s.geomean
    if g:
        console.print(f"geomean speedup {fmt.speedup(g.speedup)}  95% CI {fmt.interval(g.ci_low, g.ci_high)}  "
                      f"worst {g.worst_cell_id} {fmt.speedup(g.worst_speedup)}  regressions {g.n_regressions}  "
                      f"({s.n_measured}/{s.n_cells} cells measured)")
    line = unseen_line(record.unseen)
    if line:
        console.print(line, markup=True)
    for line in replay_lines(record):
        console.print(line, markup=True)
    if record.primed:
        console.print(f"the warm-up compiled or tuned ({record.primed['new_cache_entries']} new Triton cache "
                      "entries): k calibrated afresh by the measuring workers")
    fs = env.get("forkserver") or {}
    if fs.get("used") and fs.get("started"):
        console.print(f"workers forked from a fork server this run started (pid {fs.get('pid')}, "
                      f"{fs.get('start_wait_s')} s to preload); it stays warm for the next run (`flaloop clean` stops it)")
    elif fs.get("used"):
        console.print(f"workers forked from a warm fork server (pid {fs.get('pid')})")
    elif fs.get("left_warm"):
        console.print("workers spawned; a fork server is left warm for the next run (`flaloop clean` stops it)")
    if record.contested:
        console.print(f"{len(record.contested)} cell(s) whose rounds disagreed got extra rounds "
                      f"({len(record.rounds)} rounds in all): {', '.join(record.contested)}")
    differs = [(cell.id, d) for cell in record.cells for d in cell.tuning_differs]
    if differs:
        how = ("each side tuned on its own (--independent-tuning): part of a difference may be tuning noise"
               if record.config.independent_tuning else
               "tuning was shared, so these kernels differ in source between the sides, or their configs "
               "carry pre-hooks, which Triton does not cache")
        console.print(f"[yellow]autotune chose differently on the two sides ({how}):[/]", markup=True)
        for cid, d in differs[:20]:
            console.print(f"  {cid}: {escape(d)}", markup=True)
    print_findings(record.guard.findings, console)
    if record.signal:
        console.print("[yellow]SIGNAL ONLY (--quick): one round, a wide stopping rule; never evidence of a win[/]",
                      markup=True)
    for e in record.errors:
        console.print(f"[red]worker failure:[/] {escape(e)}", markup=True)
    if record.path:
        console.print(f"run record: {record.path}")


def print_findings(findings: list, console: Console, title: str = "guard findings") -> None:
    """One row per finding (a Finding or its dict): rule, severity, where, what was seen, why it
    matters, what to do. A rule's why and fix are written out on its first row only."""
    findings = [f if isinstance(f, Finding) else Finding.from_dict(f) for f in findings]
    findings.sort(key=lambda f: (not f.blocking, f.allowed is not None, f.rule))
    if not findings:
        return
    table = Table(title=title, show_lines=True)
    for col, ratio in (("rule", 1), ("severity", 1), ("where", 2), ("message", 4), ("why", 4), ("fix", 3)):
        table.add_column(col, overflow="fold", ratio=ratio)
    explained: set[str] = set()
    for f in findings:
        if f.allowed is not None:
            sev = Text(f"allowed: {f.allowed}", style=fmt.SEVERITY_STYLE["allowed"])
        elif f.blocking:
            sev = Text("BLOCK", style=fmt.SEVERITY_STYLE["block"])
        else:
            sev = Text(f.severity, style=fmt.SEVERITY_STYLE["warn"])
        seen = f.rule in explained
        explained.add(f.rule)
        table.add_row(f.rule, sev, f.where or "-", f.message, "(as above)" if seen else f.why,
                      "(as above)" if seen else f.fix)
    console.print(table)  # prose: folded to the width there is, never one line per finding
