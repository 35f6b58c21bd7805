"""OPT_LOG.md and dispatch.md as flaloop draws them from the loop's records (loop/records.py writes
them above the user's notes and finds hand edits), and the loop's lines that read the same: an
iteration's row, a comparison against the best or the base, a gate.
"""

from __future__ import annotations

import math

from flaloop.loop import rules
from flaloop.loop.records import NOTES_HEADING, render_table
from flaloop.loop.store import DispatchRow, Iteration
from flaloop.report import fmt
from flaloop.report.cells import LAUNCH_BOUND

OPT_LOG_COLUMNS = ("iter", "commit", "direction", "gate", "vs best", "vs base (geomean, 95% CI)", "worst cell",
                   "status", "note")
DISPATCH_COLUMNS = ("#", "condition", "entry point", "shapes", "latency base -> cand (geomean ms)",
                    "speedup vs base (95% CI)", "reason", "measured")


# -- OPT_LOG.md ---------------------------------------------------------------------------------

def comparison_text(cmp: dict | None, link: bool = True) -> str:
    """`1.0831x [1.0712, 1.0950] FASTER`, the speedup linked to its run record."""
    if not cmp:
        return "-"
    g = cmp.get("geomean")
    if not g:
        return "not measured" + (f" ([record]({cmp['record']}))" if link and cmp.get("record") else "")
    head = fmt.speedup(g["speedup"])
    if link and cmp.get("record"):
        head = f"[{head}]({cmp['record']})"
    tail = "" if cmp.get("complete") else " (incomplete)"
    return f"{head} {fmt.interval(g['ci_low'], g['ci_high'])} {cmp.get('verdict') or '-'}{tail}"


def gate_text(gate: dict | None) -> str:
    """A gate as a row reads it: `green 12/12 passed`, `signal (-k fwd) red 3/4 passed`."""
    if not gate:
        return "-"
    c = gate.get("counts") or {}
    counts = f" {c.get('passed', 0)}/{c.get('selected', 0)} passed" if c else ""
    label = "green" if gate.get("green") else "red"
    if gate.get("signal_only"):
        label = f"signal (-k {gate.get('k_expr')}) {label}"
    return label + counts


def iteration_row(it: Iteration) -> list[str]:
    if it.status == "baseline":
        aa = (it.baseline or {}).get("aa")
        vs_base = f"A/A {comparison_text(aa)}" if aa else "-"
        return [str(it.iter), it.commit[:12], it.direction, gate_text(it.gate), "-", vs_base, "-", it.status,
                it.note]
    same = it.vs_base is not None and it.vs_best is not None and it.vs_base.get("record") == it.vs_best.get("record")
    worst = "-" if not it.worst_cell else f"{it.worst_cell['id']} {fmt.speedup(it.worst_cell['speedup'])}"
    note = it.note
    if it.revert_commit:
        note = f"{note}; reverted in {it.revert_commit[:12]}".lstrip("; ")
    return [str(it.iter), it.commit[:12], it.direction, gate_text(it.gate), comparison_text(it.vs_best),
            "same bench (best = base)" if same else comparison_text(it.vs_base), worst, it.status, note]


def env_line(env: dict | None, commit: str) -> str:
    e = env or {}
    device = e.get("device_name") or "-"
    kind = "GPU" if e.get("device") == "cuda" else (e.get("device") or "device").upper()
    return (f"{kind} {device} | driver {e.get('driver') or '-'} | CUDA {e.get('cuda') or '-'} | "
            f"PyTorch {e.get('torch') or '-'} | Triton {e.get('triton') or '-'} | commit {commit[:12]}")


def render_opt_log(contract, iters: list[Iteration], decisions: list, dispatch: list[DispatchRow]) -> str:
    c = contract
    base = rules.baseline_of(iters)
    out = [f"# Optimization log: `{c.op}`", "",
           "> Rendered by flaloop from the records in `iters/` (one JSON per iteration) and `decisions/`.",
           f"> Everything above '{NOTES_HEADING}' is recomputed on every change, and a hand edit there is",
           "> reported, never overwritten. Your own notes go under it and are kept as they are.", "",
           f"- Op: `{c.op}` (`{c.import_path}.{c.func_name}` in `{c.entry_file}`); base `{c.base_ref}` = "
           f"`{c.base_commit[:12]}`",
           f"- Contract target: **{c.target_speedup:g}x**, equal-weight geomean over {', '.join(c.shapes)} "
           f"({', '.join(c.modes)}); iteration cap {c.max_iters}"]
    if base and base.baseline:
        b = base.baseline
        out += [f"- Environment: {env_line(b.get('env'), base.commit)}",
                f"- Baseline: iteration 0, run record [{b.get('record')}]({b.get('record')}); the A/A check "
                f"(base against itself) read {comparison_text(b.get('aa'), link=False)}", "",
                *render_table(("cell", "timer", "device ms (median)", "eager ms (median)", "note"), [
                    [x["id"], x.get("timer") or "-", fmt.ms(x.get("device_ms")), fmt.ms(x.get("eager_ms")),
                     LAUNCH_BOUND if x.get("launch_bound") else ""]
                    for x in b.get("cells", [])])]
    else:
        out.append("- Baseline: not recorded yet (`flaloop baseline`)")
    out += ["", "## Iterations", "", *render_table(OPT_LOG_COLUMNS, [iteration_row(i) for i in iters])]
    reassess = [d for d in decisions if d.kind == "reassess"]
    if reassess:
        out += ["", "## Re-assessments"]
        for d in reassess:
            x = d.data
            tried = "; ".join(f"#{t['iter']} {t['direction']} ({t['status']})" for t in x.get("directions", []))
            out += ["", f"### R{d.n} after iteration {d.after_iter} ({d.created})",
                    f"- Re-profiled: {x.get('profiled')}", f"- The log's directions: {tried or '-'}",
                    f"- Axes tried: {x.get('tried')}", f"- Next: {x.get('next')}", f"- Why: {x.get('why')}"]
    stops = [d for d in decisions if d.kind == "stop"]
    if stops:
        out += ["", "## Verdict"]
        for d in stops:
            x = d.data
            line = f"- {d.created}, after iteration {d.after_iter}: **{x.get('verdict')}**"
            if x.get("verdict") == "go":
                line += f"; iteration {x.get('iter')} at {fmt.speedup(x.get('speedup'))} vs base (target {x.get('target'):g}x)"
            else:
                line += f"; bound: {x.get('bound')}"
            if x.get("conditions"):
                line += f"; stop conditions: {'; '.join(x['conditions'])}"
            out.append(line)
    if dispatch:
        out += ["", f"Dispatch: {len(dispatch)} measured row(s) in [dispatch.md](dispatch.md)."]
    return "\n".join(out) + "\n"


# -- dispatch.md --------------------------------------------------------------------------------

def _geo_ms(values: list[float | None]) -> float | None:
    vals = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def dispatch_row(d: DispatchRow) -> list[str]:
    base = _geo_ms([x.get("base_ms") for x in d.latency])
    cand = _geo_ms([x.get("cand_ms") for x in d.latency])
    tree = d.tree or {}
    measured = f"{(tree.get('head') or '')[:12]}{' + diff ' + str(tree.get('diff_hash')) if tree.get('dirty') else ''}"
    if d.cand_env:
        measured += " with " + " ".join(f"{k}={v}" for k, v in sorted(d.cand_env.items()))
    return [str(d.n), d.condition, d.entry, ", ".join(d.shapes), f"{fmt.ms(base)} -> {fmt.ms(cand)}",
            comparison_text(d.vs_base), d.why, f"{measured}, {d.created}"]


def render_dispatch(contract, rows: list[DispatchRow]) -> str:
    out = [f"# Dispatch: `{contract.op}`", "",
           "> Rendered by flaloop from `dispatch/NNN.json`: each row is a shape bucket routed to a specialized",
           "> entry point, with the paired measurement of that bucket against the base that earned it.",
           f"> A row cannot be typed in: `flaloop dispatch {contract.op} add --when ... --entry ... --why ...`.", "",
           *render_table(DISPATCH_COLUMNS, [dispatch_row(d) for d in rows])]
    for d in rows:
        out += ["", f"Row {d.n} per cell (median ms, base -> cand): " + "; ".join(
            f"{x['id']} {fmt.ms(x.get('base_ms'))} -> {fmt.ms(x.get('cand_ms'))}" for x in d.latency)]
    return "\n".join(out) + "\n"
