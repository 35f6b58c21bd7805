"""The loop's records on disk: one JSON file per iteration, decision and dispatch row.

Where they are is the workspace's (core/workspace.py); under `profile/<op>-opt/` (paths inside
records are relative to that directory):

    iters/0000.json        the baseline (iteration 0); iters/NNNN.json one per `flaloop iter`
    decisions/NNN-KIND.json  re-assessments (`flaloop reassess`) and verdicts (`flaloop stop`)
    dispatch/NNN.json      one measured row of dispatch.md (`flaloop dispatch add OP`)
    OPT_LOG.md, dispatch.md  rendered from the records above (see records.py)
    TRAPS.md               the trap catalogue, seeded by `flaloop baseline`
    .rendered/             what flaloop last wrote into the rendered files (to spot hand edits)

The records are the source of truth; the markdown is a view of them. Every write goes through
`atomic_write`, so an interrupted command leaves either the old file or the new one.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from flaloop.core import fsutil
from flaloop.core.errors import UsageError
from flaloop.core.workspace import Workspace

SCHEMA = 1
STATUSES = ("baseline", "keep", "revert", "drop", "noise", "signal")


def atomic_write(path: Path, text: str) -> Path:
    """Write `text` to `path` through a temp file in the same directory and os.replace."""
    return fsutil.atomic_write_text(path, text)


def _from_dict(cls, data: dict):
    known = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class Iteration:
    """One row of OPT_LOG.md. The keys are read by `flaloop report`: keep them."""

    iter: int
    direction: str
    status: str  # one of STATUSES
    commit: str  # the candidate's commit (the base commit for the baseline)
    best_before: str  # the best kept commit when this iteration started
    created: str = ""
    revert_commit: str | None = None
    gate: dict | None = None  # {green, signal_only, counts, k_expr, log_path}
    guard: dict = field(default_factory=lambda: {"blocked": False, "findings": []})
    vs_best: dict | None = None  # a comparison (rules.compare): {record, geomean, verdict, cells, ...}
    vs_base: dict | None = None
    worst_cell: dict | None = None  # {id, speedup}, from vs_best
    note: str = ""
    wall_s: float = 0.0
    command: str = ""
    files: list[str] = field(default_factory=list)  # what the commit took
    reverted: list[str] = field(default_factory=list)  # commits the revert undid (the candidate first)
    baseline: dict | None = None  # iteration 0 only: env, per-cell timings, the A/A check
    source: dict | None = None  # where the change came from: a sweep's candidate (sweep/promote.py)
    schema: int = SCHEMA

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Iteration:
        return _from_dict(cls, data)


@dataclass
class Decision:
    """A re-assessment (`kind` "reassess") or a stop verdict (`kind` "stop")."""

    n: int
    kind: str
    after_iter: int  # the last iteration when it was made
    created: str
    data: dict = field(default_factory=dict)
    schema: int = SCHEMA

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Decision:
        return _from_dict(cls, data)


@dataclass
class DispatchRow:
    """One shape bucket routed to a specialized entry point, with the measurement behind it."""

    n: int
    condition: str
    entry: str
    why: str
    shapes: list[str]
    vs_base: dict  # a comparison of the bucket's shapes against the base
    latency: list[dict]  # per cell: {id, base_ms, cand_ms}
    tree: dict  # the measured tree: {head, dirty, diff_hash}
    after_iter: int
    created: str
    # The kept iteration whose committed tree is exactly the one measured here, if any: that keep's
    # full-shape measurement already includes this dispatch.
    same_as_iter: int | None = None
    schema: int = SCHEMA
    # the candidate's environment (--cand-env): a bucket earned by switching a backend on, not by code
    cand_env: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> DispatchRow:
        return _from_dict(cls, data)


# -- reading and writing them ----------------------------------------------------------------

def _load(files: list[Path], pattern: str, cls):
    out = []
    for p in files:
        if not re.fullmatch(pattern, p.name):
            continue
        try:
            out.append(cls.from_dict(json.loads(p.read_text())))
        except (json.JSONDecodeError, TypeError) as exc:
            raise UsageError(f"the loop record {p} is damaged: {exc}",
                             "restore it from a backup, or delete it and rerun the command that wrote it") from exc
    return out


def _files(directory: Path) -> list[Path]:
    return sorted(directory.iterdir()) if directory.is_dir() else []


def _save(path: Path, record) -> Path:
    return atomic_write(path, json.dumps(record.to_dict(), indent=1) + "\n")


def iterations(ws: Workspace) -> list[Iteration]:
    return sorted(_load(_files(ws.iters), r"\d{4}\.json", Iteration), key=lambda i: i.iter)


def save_iteration(ws: Workspace, it: Iteration) -> Path:
    return _save(ws.iteration_file(it.iter), it)


def decisions(ws: Workspace) -> list[Decision]:
    return sorted(_load(_files(ws.decisions), r"\d{3}-\w+\.json", Decision), key=lambda d: d.n)


def save_decision(ws: Workspace, d: Decision) -> Path:
    return _save(ws.decision_file(d.n, d.kind), d)


def dispatch_rows(ws: Workspace) -> list[DispatchRow]:
    return sorted(_load(_files(ws.dispatch), r"\d{3}\.json", DispatchRow), key=lambda d: d.n)


def save_dispatch(ws: Workspace, row: DispatchRow) -> Path:
    return _save(ws.dispatch_file(row.n), row)
