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
from flaloop.core import fsutil
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
    """sweep.json (sweep.md and sweep.png are drawn from it: report/sweep.py, report/plots.py)."""
    path = sweep_file(sweep_dir)
    rec.path = str(path)
    fsutil.atomic_write_json(path, rec.to_dict())
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
