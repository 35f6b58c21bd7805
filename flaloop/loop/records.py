"""OPT_LOG.md and dispatch.md: markdown views rendered from the loop's records.

A rendered document has two parts. Everything above the `## Notes` heading is flaloop's: it is
rendered from the JSON records on every change, and a copy of what was written is kept under
`.rendered/`. Everything from `## Notes` on belongs to the user and is carried over as it is.

Before writing, the file's generated part is compared with that copy. A difference is a hand
edit of something flaloop computed (a row's status typed over, a speedup "rounded"): it is
reported with the row named (`HandEdited`, exit 1) and nothing is overwritten. `flaloop log OP
--restore` saves the edited file aside and renders the rows again from the records.

Tables round-trip: `parse_row(render_row(cells)) == cells` for any text (pipes escaped,
newlines folded), so a row can always be read back and named.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from pathlib import Path

from flaloop.core import clock
from flaloop.core.errors import RuleRefused
from flaloop.core.workspace import Workspace
from flaloop.loop import rules
from flaloop.loop.store import DispatchRow, Iteration, atomic_write

NOTES_HEADING = "## Notes"
NOTES_BODY = ("<!-- Yours: flaloop never rewrites anything from the Notes heading on. Observations, profiler "
              "readings, ideas. -->\n")
OPT_LOG_COLUMNS = ("iter", "commit", "direction", "gate", "vs best", "vs base (geomean, 95% CI)", "worst cell",
                   "status", "note")
DISPATCH_COLUMNS = ("#", "condition", "entry point", "shapes", "latency base -> cand (geomean ms)",
                    "speedup vs base (95% CI)", "reason", "measured")


# -- tables that round-trip ---------------------------------------------------------------------

def _cell(text: object) -> str:
    s = " ".join(str(text).split())  # a row is one line
    return s.replace("\\", "\\\\").replace("|", "\\|")


def render_row(cells: list[str] | tuple[str, ...]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def parse_row(line: str) -> list[str] | None:
    """The cells of a markdown table row, unescaped; None when the line is not a row."""
    s = line.strip()
    if not (s.startswith("|") and s.endswith("|")) or len(s) < 2:
        return None
    cells, cur, i = [], [], 1
    while i < len(s) - 1:
        ch = s[i]
        if ch == "\\" and i + 1 < len(s) - 1:
            cur.append(s[i + 1])
            i += 2
            continue
        if ch == "|":
            cells.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    cells.append("".join(cur).strip())
    return cells


def render_table(columns: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    return [render_row(columns), "|" + "|".join(" --- " for _ in columns) + "|", *(render_row(r) for r in rows)]


# -- documents with a generated part and the user's notes ---------------------------------------

@dataclass(frozen=True)
class Edit:
    where: str  # "row 3", "line 12"
    found: str  # what the file has ("" when a generated line was deleted)
    expected: str  # what flaloop wrote ("" when a line was added)

    def to_dict(self) -> dict:
        return {"where": self.where, "found": self.found, "expected": self.expected}


class HandEdited(RuleRefused):
    """A generated part of OPT_LOG.md or dispatch.md differs from what flaloop wrote (exit 1)."""

    def __init__(self, doc: Path, op: str, edits: list[Edit]):
        shown = "\n".join(f"  {e.where}:\n    flaloop wrote: {e.expected or '(nothing)'}\n"
                          f"    the file has:  {e.found or '(deleted)'}" for e in edits[:6])
        super().__init__(
            f"{doc.name} was edited by hand where flaloop renders it from the records "
            f"({', '.join(e.where for e in edits[:6])}):\n{shown}",
            f"put remarks under '{NOTES_HEADING}' (kept as they are); then `flaloop log {op} --restore` renders "
            f"the rows from the records again and saves your edited file beside it")
        self.doc, self.edits = doc, edits


def split_notes(text: str) -> tuple[str, str | None]:
    """(generated part, notes part from the heading on, or None when the heading is gone)."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == NOTES_HEADING:
            return "".join(lines[:i]), "".join(lines[i:])
    return text, None


def _where(line: str, lineno: int) -> str:
    cells = parse_row(line)
    if cells and cells[0].isdigit():
        return f"row {cells[0]}"
    return f"line {lineno}"


def find_edits(current: str, rendered: str) -> list[Edit]:
    """Lines of the generated part that differ from what flaloop last rendered, each named."""
    have = [ln.rstrip() for ln in current.splitlines()]
    want = [ln.rstrip() for ln in rendered.splitlines()]
    while have and not have[-1]:
        have.pop()
    while want and not want[-1]:
        want.pop()
    edits: list[Edit] = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=want, b=have, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        olds, news = want[i1:i2], have[j1:j2]
        for k in range(max(len(olds), len(news))):
            old = olds[k] if k < len(olds) else ""
            new = news[k] if k < len(news) else ""
            where = _where(old, i1 + k + 1) if old else _where(new, j1 + k + 1)
            if not old:
                where += " (added)"
            edits.append(Edit(where, new, old))
    return edits


def check_doc(ws: Workspace, doc: Path) -> list[Edit]:
    if not doc.exists() or not ws.rendered_copy(doc).exists():
        return []
    generated, notes = split_notes(doc.read_text())
    edits = find_edits(generated, ws.rendered_copy(doc).read_text())
    if notes is None:
        edits.append(Edit(f"the '{NOTES_HEADING}' heading", "(deleted)", NOTES_HEADING))
    return edits


def write_doc(ws: Workspace, doc: Path, generated: str, op: str, *, restore: bool = False) -> Path | None:
    """Render `generated` above the file's notes. Refuses (HandEdited) when a generated line was edited
    by hand; with `restore`, saves the edited file beside it first and renders over the edit.
    Returns the path of the saved copy, if one was made."""
    saved = None
    edits = check_doc(ws, doc)
    if edits and not restore:
        raise HandEdited(doc, op, edits)
    notes = None
    if doc.exists():
        text = doc.read_text()
        notes = split_notes(text)[1]
        if edits:
            saved = doc.with_name(f"{doc.name}.edited-{clock.name_safe(clock.now_iso())}")
            atomic_write(saved, text)
    if notes is None:
        notes = f"{NOTES_HEADING}\n\n{NOTES_BODY}"
    generated = generated.rstrip("\n") + "\n\n"
    atomic_write(doc, generated + notes)
    atomic_write(ws.rendered_copy(doc), generated)
    return saved


# -- OPT_LOG.md ---------------------------------------------------------------------------------

def fmt_x(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}x"


def fmt_cmp(cmp: dict | None, link: bool = True) -> str:
    """`1.0831x [1.0712, 1.0950] FASTER`, the speedup linked to its run record."""
    if not cmp:
        return "-"
    g = cmp.get("geomean")
    if not g:
        return "not measured" + (f" ([record]({cmp['record']}))" if link and cmp.get("record") else "")
    head = fmt_x(g["speedup"])
    if link and cmp.get("record"):
        head = f"[{head}]({cmp['record']})"
    tail = "" if cmp.get("complete") else " (incomplete)"
    return f"{head} [{g['ci_low']:.4f}, {g['ci_high']:.4f}] {cmp.get('verdict') or '-'}{tail}"


def fmt_gate(gate: dict | None) -> str:
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
        vs_base = f"A/A {fmt_cmp(aa)}" if aa else "-"
        return [str(it.iter), it.commit[:12], it.direction, fmt_gate(it.gate), "-", vs_base, "-", it.status,
                it.note]
    same = it.vs_base is not None and it.vs_best is not None and it.vs_base.get("record") == it.vs_best.get("record")
    worst = "-" if not it.worst_cell else f"{it.worst_cell['id']} {fmt_x(it.worst_cell['speedup'])}"
    note = it.note
    if it.revert_commit:
        note = f"{note}; reverted in {it.revert_commit[:12]}".lstrip("; ")
    return [str(it.iter), it.commit[:12], it.direction, fmt_gate(it.gate), fmt_cmp(it.vs_best),
            "same bench (best = base)" if same else fmt_cmp(it.vs_base), worst, it.status, note]


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
                f"(base against itself) read {fmt_cmp(b.get('aa'), link=False)}", "",
                *render_table(("cell", "timer", "device ms (median)", "eager ms (median)", "note"), [
                    [x["id"], x.get("timer") or "-", fmt_ms(x.get("device_ms")), fmt_ms(x.get("eager_ms")),
                     "launch-bound (host > device)" if x.get("launch_bound") else ""]
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
                line += f"; iteration {x.get('iter')} at {fmt_x(x.get('speedup'))} vs base (target {x.get('target'):g}x)"
            else:
                line += f"; bound: {x.get('bound')}"
            if x.get("conditions"):
                line += f"; stop conditions: {'; '.join(x['conditions'])}"
            out.append(line)
    if dispatch:
        out += ["", f"Dispatch: {len(dispatch)} measured row(s) in [dispatch.md](dispatch.md)."]
    return "\n".join(out) + "\n"


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


# -- dispatch.md --------------------------------------------------------------------------------

def geo_ms(values: list[float | None]) -> float | None:
    vals = [v for v in values if v]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def dispatch_row(d: DispatchRow) -> list[str]:
    base = geo_ms([x.get("base_ms") for x in d.latency])
    cand = geo_ms([x.get("cand_ms") for x in d.latency])
    tree = d.tree or {}
    measured = f"{(tree.get('head') or '')[:12]}{' + diff ' + str(tree.get('diff_hash')) if tree.get('dirty') else ''}"
    if d.cand_env:
        measured += " with " + " ".join(f"{k}={v}" for k, v in sorted(d.cand_env.items()))
    return [str(d.n), d.condition, d.entry, ", ".join(d.shapes), f"{fmt_ms(base)} -> {fmt_ms(cand)}",
            fmt_cmp(d.vs_base), d.why, f"{measured}, {d.created}"]


def render_dispatch(contract, rows: list[DispatchRow]) -> str:
    out = [f"# Dispatch: `{contract.op}`", "",
           "> Rendered by flaloop from `dispatch/NNN.json`: each row is a shape bucket routed to a specialized",
           "> entry point, with the paired measurement of that bucket against the base that earned it.",
           f"> A row cannot be typed in: `flaloop dispatch {contract.op} add --when ... --entry ... --why ...`.", "",
           *render_table(DISPATCH_COLUMNS, [dispatch_row(d) for d in rows])]
    for d in rows:
        out += ["", f"Row {d.n} per cell (median ms, base -> cand): " + "; ".join(
            f"{x['id']} {fmt_ms(x.get('base_ms'))} -> {fmt_ms(x.get('cand_ms'))}" for x in d.latency)]
    return "\n".join(out) + "\n"
