"""The sweep record: one row per candidate (or per op of a pull-request check), ranked, as
`sweep.json` beside `sweep.md` and `sweep.png` in the sweep's directory. Each measured row links its
full run record (bench/record.RunRecord) and gate result; the record is the single source of
truth for the table, the JSON and the plot, which are all rendered from it.

Ranking: the measured (`ok`) rows by geomean speedup against the base, highest first (ties: the
higher lower CI bound); with `--rank-by model`, by the step-time speedup of each candidate's model
check (`flaloop model`), a candidate whose trajectory left the band blocked. A sweep's ranking is a signal: a candidate is promoted through `flaloop
iter --from-sweep`, which gates and measures it again as one iteration.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flaloop.bench.record import TreeRef
from flaloop.core import files as fsutil
from flaloop.core.errors import UsageError
from flaloop.core.workspace import sweep_file

SCHEMA = 1
STATUSES = ("ok", "blocked", "failed")


@dataclass
class SweepRow:
    key: str
    op: str
    ref: str
    kind: str = "ref"                  # ref | patch | head
    commit: str | None = None
    tree: str | None = None
    status: str = "failed"             # ok | blocked | failed
    verdict: str | None = None         # the geomean's: FASTER | SLOWER | SAME | UNSURE; BLOCKED / FAILED
    rank: int | None = None
    geomean: dict | None = None        # {speedup, ci_low, ci_high, worst_cell_id, worst_speedup, ...}
    worst_cell: dict | None = None     # {id, speedup, verdict}
    slower: list[str] = field(default_factory=list)  # cells SLOWER beyond the margin
    cells: list[dict] = field(default_factory=list)  # {id, speedup, ci_low, ci_high, verdict}
    reason: str = ""
    invalid: bool = False              # bad input (an unknown ref, a patch that does not apply, ...)
    gate: dict | None = None           # {green, counts, reused_from, log_path}
    guard: dict | None = None          # {blocked, rules}
    record: str | None = None          # its run record, relative to the sweep directory
    host: str | None = None
    gpu: str | None = None
    attempts: int = 0
    wall_s: float = 0.0
    # with `--rank-by model`: the candidate's model check (modelcheck.run.sweep_entry)
    model: dict | None = None

    def to_json(self) -> dict:
        """The row as `--json` gives it."""
        return {"ref": self.ref, "op": self.op, "rank": self.rank, "status": self.status, "verdict": self.verdict,
                "geomean": self.geomean, "worst_cell": self.worst_cell, "slower": self.slower,
                "reason": self.reason, "invalid": self.invalid, "commit": self.commit, "key": self.key,
                "kind": self.kind, "gate": self.gate, "guard": self.guard, "record": self.record,
                "host": self.host, "gpu": self.gpu, "attempts": self.attempts, "wall_s": self.wall_s,
                "cells": self.cells, "model": self.model}


@dataclass
class SweepRecord:
    kind: str                          # "candidates" (one op) or "ops" (head against base per op)
    created: str
    base: TreeRef
    ops: list[str]
    rows: list[SweepRow] = field(default_factory=list)
    executor: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the bench's config (BenchConfig.to_dict) shared by all
    command: str = ""
    margin: float = 0.005
    wall_s: float = 0.0
    interrupted: bool = False
    path: str | None = None
    schema: int = SCHEMA
    rank_by: str = "geomean"  # or "model": the model check's step-time speedup (`sweep --rank-by model`)

    def rank(self) -> None:
        for r in self.rows:  # ranked again (by the model after the geomean): no rank left from before
            r.rank = None
        if self.rank_by == "model":
            ok = [r for r in self.rows if r.status == "ok" and (r.model or {}).get("speedup")]
            ok.sort(key=lambda r: (-r.model["speedup"], -(r.model.get("ci_low") or 0)))
        else:
            ok = [r for r in self.rows if r.status == "ok" and r.geomean]
            ok.sort(key=lambda r: (-r.geomean["speedup"], -r.geomean["ci_low"]))
        for i, r in enumerate(ok, 1):
            r.rank = i
        order = {id(r): i for i, r in enumerate(ok)}
        rest = [r for r in self.rows if id(r) not in order]
        self.rows = ok + sorted(rest, key=lambda r: (STATUSES.index(r.status), r.key))

    def row(self, name: str) -> SweepRow:
        """The row a user names: its ref as given, its key, or a prefix of its commit."""
        for test in (lambda r: r.ref == name, lambda r: r.key == name, lambda r: r.op == name and self.kind == "ops",
                     lambda r: bool(r.commit) and len(name) >= 7 and r.commit.startswith(name)):
            hits = [r for r in self.rows if test(r)]
            if len(hits) == 1:
                return hits[0]
        known = ", ".join(r.ref for r in self.rows)
        raise UsageError(f"the sweep {self.path or ''} has no candidate {name!r}", f"its candidates: {known}")

    def to_dict(self) -> dict:
        return {"kind": self.kind, "schema": self.schema, "created": self.created, "base": asdict(self.base),
                "ops": self.ops, "rows": [asdict(r) for r in self.rows], "executor": self.executor,
                "config": self.config, "command": self.command, "margin": self.margin, "wall_s": self.wall_s,
                "interrupted": self.interrupted, "path": self.path, "rank_by": self.rank_by}

    def to_json(self) -> dict:
        """What `flaloop sweep --json` prints."""
        return {"kind": "sweep", "sweep": self.kind, "created": self.created, "base": asdict(self.base),
                "ops": self.ops, "candidates": [r.to_json() for r in self.rows], "executor": self.executor,
                "margin": self.margin, "wall_s": self.wall_s, "interrupted": self.interrupted, "path": self.path,
                "rank_by": self.rank_by}

    @classmethod
    def from_dict(cls, d: dict) -> SweepRecord:
        if d.get("schema") != SCHEMA:
            raise ValueError(f"sweep record schema {d.get('schema')!r}; this flaloop reads {SCHEMA}")
        rows = [SweepRow(**{k: v for k, v in r.items() if k in SweepRow.__dataclass_fields__}) for r in d["rows"]]
        names = set(cls.__dataclass_fields__) - {"base", "rows"}
        return cls(base=TreeRef.from_dict(d["base"]), rows=rows, **{k: v for k, v in d.items() if k in names})


def write(sweep_dir: Path, rec: SweepRecord) -> Path:
    path = sweep_file(sweep_dir)
    rec.path = str(path)
    fsutil.atomic_write_json(path, rec.to_dict())
    fsutil.atomic_write_text(sweep_dir / "sweep.md", render_markdown(rec))
    return path


def read(where: Path) -> SweepRecord:
    """A sweep by its directory or its sweep.json; UsageError naming what is wrong."""
    path = sweep_file(where) if where.is_dir() else where
    try:
        rec = SweepRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is not a readable sweep record: {exc}",
                         "name a sweep directory under profile/<op>-opt/sweeps/ (its sweep.json)") from exc
    rec.path = str(path)
    return rec


# -- renderings -----------------------------------------------------------------------------------

def fmt_geo(g: dict | None) -> str:
    return "-" if not g else f"{g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}]"


def fmt_worst(w: dict | None) -> str:
    return "-" if not w else f"{w['id']} {w['speedup']:.4f}x {w.get('verdict') or ''}".strip()


def table_rows(rec: SweepRecord) -> list[list[str]]:
    out = []
    for r in rec.rows:
        gate = "-" if r.gate is None else ("green" if r.gate.get("green") else "RED") + (
            " (reused)" if r.gate.get("reused_from") else "")
        out.append([str(r.rank or "-"), r.ref if rec.kind == "candidates" else r.op, r.status,
                    r.verdict or "-", fmt_geo(r.geomean), fmt_worst(r.worst_cell), gate,
                    r.reason if r.status != "ok" else ("SLOWER: " + ", ".join(r.slower) if r.slower else "")])
    return out


HEADERS = ["rank", "candidate", "status", "verdict", "geomean vs base (95% CI)", "worst cell", "gate", "note"]


def render_markdown(rec: SweepRecord) -> str:
    what = "candidates of " + rec.ops[0] if rec.kind == "candidates" else "ops touched by the change"
    headers = HEADERS if rec.kind == "candidates" else ["rank", "op", *HEADERS[2:]]
    lines = [f"# Sweep: {what}", "",
             f"Base `{rec.base.commit}`" + (f" (`{rec.base.ref}`)" if rec.base.ref else "") + f"; {len(rec.rows)} row(s); executor "
             f"{rec.executor.get('kind', '?')} ({rec.executor.get('slots', '?')} at a time); {rec.wall_s:.0f} s.",
             f"Margin ±{rec.margin:.1%}. A sweep ranks; it promotes nothing: `flaloop iter OP --from-sweep "
             f"{Path(rec.path).parent if rec.path else 'SWEEP'} REF` gates and measures a candidate again as one "
             "iteration.", "",
             "| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    for row in table_rows(rec):
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
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
                  + (f", GPU {r.gpu}" if r.gpu is not None else "") + f"; {r.wall_s:.0f} s.", "",
                  "| cell | speedup | 95% CI | verdict |", "| --- | --- | --- | --- |"]
        for c in r.cells:
            sp = "-" if c.get("speedup") is None else f"{c['speedup']:.4f}x"
            ci = "-" if c.get("ci_low") is None else f"[{c['ci_low']:.4f}, {c['ci_high']:.4f}]"
            lines.append(f"| {c['id']} | {sp} | {ci} | {c.get('verdict') or '-'} |")
        lines.append("")
    if rec.interrupted:
        lines.append("**Interrupted**: the rows without a result were withdrawn.")
    return "\n".join(lines) + "\n"


def plot(rec: SweepRecord, path: Path) -> Path | None:
    """Each measured row's geomean with its CI; blocked and failed rows named, without a point."""
    rows = rec.rows
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"FASTER": "#1a7f37", "SLOWER": "#cf222e", "SAME": "#57606a", "UNSURE": "#bf8700"}
    fig, ax = plt.subplots(figsize=(8, 0.5 * len(rows) + 1.6))
    labels = []
    for i, r in enumerate(rows):
        y = len(rows) - 1 - i
        name = r.ref if rec.kind == "candidates" else r.op
        labels.append((y, name if len(name) <= 40 else "..." + name[-37:]))
        g = r.geomean
        if r.status == "ok" and g:
            ax.errorbar([g["speedup"]], [y], xerr=[[g["speedup"] - g["ci_low"]], [g["ci_high"] - g["speedup"]]],
                        fmt="o", color=colors.get(r.verdict or "", "#57606a"), capsize=4)
        else:
            ax.text(1.0, y, f"  {r.status.upper()}", va="center", color="#cf222e" if r.status == "blocked" else "#6e7781")
    ax.axvline(1.0, color="black", lw=0.8)
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.set_yticks([y for y, _ in labels], [n for _, n in labels])
    ax.set_xlabel("geomean speedup vs base (base / candidate device time), 95% CI")
    ax.set_title(f"sweep of {', '.join(rec.ops)[:60]} against {rec.base.commit[:12]}")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
