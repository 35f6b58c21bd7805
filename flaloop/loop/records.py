"""OPT_LOG.md and dispatch.md: markdown views rendered from the loop's records (report/opt_log.py
draws them; this module writes them and guards them against hand edits).

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
from dataclasses import dataclass
from pathlib import Path

from flaloop.core import clock
from flaloop.core.errors import RuleRefused
from flaloop.core.workspace import Workspace
from flaloop.loop.store import atomic_write

NOTES_HEADING = "## Notes"
NOTES_BODY = ("<!-- Yours: flaloop never rewrites anything from the Notes heading on. Observations, profiler "
              "readings, ideas. -->\n")


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
