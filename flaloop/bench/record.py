"""The run record: one paired measurement, start to finish, as a typed object.

`profile/<op>-opt/runs/<stamp>-{bench,aa}/record.json` (and a sweep's records under
`sweeps/<stamp>/`) is the single source of truth for everything printed or reported later:
configuration, fingerprint, every raw pair, per-cell estimates and verdicts, the guard's findings.
Every reader goes through `RunRecord.from_dict` (`read`), which knows each schema version; the JSON
is `to_dict()`, the same document `--json` prints.

Schema history: 2 (a plain dict; config names `min_sample_ms`, `setup_timeout`, `overrides`,
`shared_tuning`), 3 (this class: the config's names are the CLI's, the candidate is a commit).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from flaloop.bench.model import BenchConfig, CellResult
from flaloop.core import fsutil
from flaloop.core.errors import UsageError
from flaloop.core.workspace import record_file
from flaloop.guard.findings import Finding
from flaloop.stats import GeomeanEstimate

SCHEMA = 3
READABLE = (2, 3)


def _known(cls, d: dict | None) -> dict:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in (d or {}).items() if k in names}


@dataclass
class TreeRef:
    """One side of a measurement: a commit (the working tree is snapshotted into one)."""

    commit: str
    ref: str | None = None          # what the user named: a branch, a tag, "working tree", a patch file
    head: str | None = None         # for a snapshot of the working tree: HEAD when it was taken
    dirty: bool = False             # ... and whether it had uncommitted changes
    diff_hash: str | None = None    # ... and their hash (git.tree_state)
    tree: str | None = None         # the commit's tree id: equal trees, equal code

    @classmethod
    def from_dict(cls, d: dict | None) -> TreeRef:
        d = dict(d or {})
        d.setdefault("commit", d.get("head") or "")  # schema 2: the candidate was the working tree
        return cls(**_known(cls, d))


@dataclass(frozen=True)
class GeomeanSummary(GeomeanEstimate):
    """The geomean (stats.GeomeanEstimate) with the cells it names: the worst, and the best one
    whose removal says how much the geomean leans on it (`without_best_cell`)."""

    worst_cell_id: str | None = None
    without_best_cell: float | None = None
    best_cell_id: str | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> GeomeanSummary | None:
        return cls(**_known(cls, d)) if d else None


@dataclass
class RunSummary:
    geomean: GeomeanSummary | None = None
    n_cells: int = 0
    n_measured: int = 0
    n_blocked: int = 0
    n_refused: int = 0
    n_failed: int = 0

    def to_dict(self) -> dict:
        return {**asdict(self), "geomean": asdict(self.geomean) if self.geomean else None}

    @classmethod
    def from_dict(cls, d: dict | None) -> RunSummary:
        d = dict(d or {})
        out = cls(**{k: v for k, v in _known(cls, d).items() if k != "geomean"})
        out.geomean = GeomeanSummary.from_dict(d.get("geomean"))
        return out


@dataclass
class GuardSummary:
    """Every guard finding of the run (the static audit's, the run's, each cell's) and whether any blocks."""

    blocked: bool = False
    findings: list[Finding] = field(default_factory=list)
    static: dict | None = None          # the static audit (guard/audit.AuditResult.to_dict)
    integrity: dict = field(default_factory=dict)  # {side: timing-path violations the worker saw}
    allowed: list[dict] = field(default_factory=list)
    probes: bool = True
    probe_seconds: float = 0.0
    # timed calls checked against the base's (bench/timed.py): the input draw's salt, checked, differ,
    # seconds, and their share of the run's wall time
    timed_calls: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**asdict(self), "findings": [f.to_dict() for f in self.findings]}

    @classmethod
    def from_dict(cls, d: dict | None) -> GuardSummary:
        d = dict(d or {})
        out = cls(**{k: v for k, v in _known(cls, d).items() if k != "findings"})
        out.findings = [Finding.from_dict(f) for f in d.get("findings") or []]
        return out


@dataclass
class RunRecord:
    op: str
    created: str
    base: TreeRef
    candidate: TreeRef
    config: BenchConfig
    cells: list[CellResult] = field(default_factory=list)
    summary: RunSummary = field(default_factory=RunSummary)
    guard: GuardSummary = field(default_factory=GuardSummary)
    kind: str = "bench"
    schema: int = SCHEMA
    command: str = ""
    env: dict = field(default_factory=dict)        # fingerprint, idle and during-run clock evidence
    gpu: str | None = None                         # the device index this run was given
    host: str | None = None                        # where it ran (a Ray node's address, say)
    workers: dict = field(default_factory=dict)    # {side: hello} of a measuring pair (where the op came from)
    rounds: list[dict] = field(default_factory=list)  # per round: {side: pid}
    import_s: list[dict] = field(default_factory=list)
    warmup: dict = field(default_factory=dict)
    primed: dict | None = None
    contested: list[str] = field(default_factory=list)
    restarts: int = 0
    gate: dict | None = None                       # the gate result this measurement was taken under
    unverified: bool = True
    interrupted: bool = False
    last_gate: dict | None = None
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    timeline: list[list] = field(default_factory=list)
    lean_check: dict | None = None
    unseen: dict | None = None                     # shapes nobody times, checked in the warm-up (bench/unseen.py)
    test_calls: dict | None = None                 # the test's own calls, replayed in the warm-up (bench/replay.py)
    waited_s: dict = field(default_factory=dict)
    transfer: dict = field(default_factory=dict)
    roofline: dict | None = None
    path: str | None = None

    @property
    def aa(self) -> bool:
        return self.config.aa

    @property
    def signal(self) -> bool:
        return self.config.signal

    @property
    def measured(self) -> list[CellResult]:
        return [c for c in self.cells if c.status == "ok"]

    def cell(self, cell_id: str) -> CellResult | None:
        return next((c for c in self.cells if c.id == cell_id), None)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(base=asdict(self.base), candidate=asdict(self.candidate), config=self.config.to_dict(),
                 cells=[c.to_dict() for c in self.cells], summary=self.summary.to_dict(),
                 guard=self.guard.to_dict(), aa=self.aa, signal=self.signal)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RunRecord:
        if not isinstance(d, dict):
            raise ValueError(f"a run record is a JSON object, not {type(d).__name__}")
        schema = d.get("schema", 2)
        if schema not in READABLE:
            raise ValueError(f"run record schema {schema!r}; this flaloop reads {', '.join(map(str, READABLE))}")
        nested = ("base", "candidate", "config", "cells", "summary", "guard", "schema")
        out = cls(op=d["op"], created=d.get("created", ""), base=TreeRef.from_dict(d.get("base")),
                  candidate=TreeRef.from_dict(d.get("candidate")), config=BenchConfig.from_dict(d.get("config")),
                  **{k: v for k, v in _known(cls, d).items() if k not in (*nested, "op", "created")})
        for flag in ("aa", "signal"):  # the document's own word on what kind of run it was
            if flag in d:
                setattr(out.config, flag, bool(d[flag]))
        out.cells = [CellResult.from_dict(c) for c in d.get("cells") or []]
        out.summary = RunSummary.from_dict(d.get("summary"))
        out.guard = GuardSummary.from_dict(d.get("guard"))
        return out


def write(run_dir: Path, record: RunRecord) -> Path:
    path = fsutil.atomic_write_json(record_file(run_dir), record.to_dict())
    record.path = str(path)
    return path


def read(path: Path | str) -> RunRecord:
    """A stored run record; UsageError naming the file when it cannot be read."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        rec = RunRecord.from_dict(data)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"{path} is not a readable run record: {exc}",
                         "it was cut short or written by another flaloop; measure again") from exc
    rec.path = rec.path or str(path)
    return rec
