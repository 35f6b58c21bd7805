"""How a sweep (sweep/record.SweepRecord) looks to a person: its ranked table (the terminal's and
sweep.md's) and sweep.md itself. The pull-request comment of a sweep is report/markdown.py's, its
plot report/plots.py's."""

from __future__ import annotations

from pathlib import Path

from flaloop.report import fmt
from flaloop.report.cells import CellView
from flaloop.sweep.record import SweepRecord

HEADERS = ["rank", "candidate", "status", "verdict", "geomean vs base (95% CI)", "worst cell", "gate", "note"]


def table_headers(rec: SweepRecord) -> list[str]:
    """The table's columns: a sweep of candidates names each candidate, a sweep of ops each op."""
    return HEADERS if rec.kind == "candidates" else ["rank", "op", *HEADERS[2:]]


def table_rows(rec: SweepRecord) -> list[list[str]]:
    out = []
    for r in rec.rows:
        gate = "-" if r.gate is None else ("green" if r.gate.get("green") else "RED") + (
            " (reused)" if r.gate.get("reused_from") else "")
        out.append([str(r.rank or "-"), r.ref if rec.kind == "candidates" else r.op, r.status,
                    r.verdict or "-", fmt.geomean(r.geomean), fmt.worst(r.worst_cell), gate,
                    r.reason if r.status != "ok" else ("SLOWER: " + ", ".join(r.slower) if r.slower else "")])
    return out


def render_markdown(rec: SweepRecord) -> str:
    """sweep.md: the ranked table, the model check's ranking where it ranked, each row's cells."""
    what = "candidates of " + rec.ops[0] if rec.kind == "candidates" else "ops touched by the change"
    lines = [f"# Sweep: {what}", "",
             f"Base `{rec.base.commit}`" + (f" (`{rec.base.ref}`)" if rec.base.ref else "") + f"; {len(rec.rows)} row(s); executor "
             f"{rec.executor.get('kind', '?')} ({rec.executor.get('slots', '?')} at a time); {rec.wall_s:.0f} s.",
             f"Margin ±{rec.margin:.1%}. A sweep ranks; it promotes nothing: `flaloop iter OP --from-sweep "
             f"{Path(rec.path).parent if rec.path else 'SWEEP'} REF` gates and measures a candidate again as one "
             "iteration.", "",
             *fmt.table(table_headers(rec), table_rows(rec))]
    lines.append("")
    if rec.rank_by == "model":
        lines += ["Ranked by the model check's step-time speedup (`flaloop model`), not the op's geomean:", ""]
        for r in rec.rows:
            m = r.model or {}
            got = m.get("error") or (f"{m['speedup']:.4f}x [{m.get('ci_low') or 0:.4f}, {m.get('ci_high') or 0:.4f}] "
                                     f"{m.get('verdict')}" if m.get("speedup") else "not checked")
            lines.append(f"- {r.ref}: {got}" + (" (trajectory left the band)" if m.get("blocked") else ""))
        lines.append("")
    for r in rec.rows:
        if not r.cells:
            continue
        lines += [f"## {r.ref if rec.kind == 'candidates' else r.op} ({r.status})", "",
                  f"Commit `{r.commit}`; run record `{r.record}`; {r.host or '?'}"
                  + (f", GPU {r.gpu}" if r.gpu is not None else "") + f"; {r.wall_s:.0f} s.", ""]
        lines += fmt.table(["cell", "speedup", "95% CI", "verdict"], [
            [v.id, fmt.speedup(v.speedup), fmt.interval(v.ci_low, v.ci_high), v.verdict or "-"]
            for v in map(CellView.from_dict, r.cells)])
        lines.append("")
    if rec.interrupted:
        lines.append("**Interrupted**: the rows without a result were withdrawn.")
    return "\n".join(lines) + "\n"
