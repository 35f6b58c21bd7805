"""An op's workspace (`profile/<op>-opt/`): what it holds, and pruning what is no longer needed.

Areas: `runs/` (one directory per bench run: record.json and worker logs), `gate/` (last.json,
pytest logs, baselines), `triton-cache/` (Triton's kernels and autotune picks, see
bench/measure.py), `iters/` (iteration records of the loop), `trace/` (profiler output),
`sweeps/` (one directory per sweep: its record, plot and its candidates' run records).

`clean` keeps the newest N run directories, gate logs and sweeps, and every one that an
iteration record, OPT_LOG.md, dispatch.md or a report names; it never touches iters/, OPT_LOG.md,
the contract, caches or baselines. A sweep removed takes its `refs/flaloop/sweeps/<stamp>/` refs
along (the caller drops them: `removed_sweeps`).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from flaloop.core.errors import UsageError
from flaloop.core.files import dir_bytes

AREAS = ("runs", "gate", "triton-cache", "iters", "trace", "sweeps")
# Files and folders whose text may cite a run record or gate log by its name.
CITING = ("iters", "OPT_LOG.md", "dispatch.md", "report", "reports", "report.md", "report.json")


def usage(target, op: str) -> dict:
    """Bytes per area of the op's workspace, `other` for the rest, `total`, and `n_runs`."""
    ws = target.workspace(op)
    out = {area: dir_bytes(ws / area) for area in AREAS}
    total = dir_bytes(ws)
    out["other"] = max(0, total - sum(out.values()))
    out["total"] = total
    runs = ws / "runs"
    out["n_runs"] = sum(1 for p in runs.iterdir() if p.is_dir()) if runs.is_dir() else 0
    return out


@dataclass
class CleanPlan:
    removed: list[str] = field(default_factory=list)  # workspace-relative paths
    kept: list[str] = field(default_factory=list)
    cited: list[str] = field(default_factory=list)  # kept because something names them
    freed_bytes: int = 0

    def to_dict(self) -> dict:
        return {"removed": self.removed, "kept": self.kept, "cited": self.cited, "freed_bytes": self.freed_bytes}


def _citing_text(ws: Path) -> str:
    parts = []
    for name in CITING:
        p = ws / name
        files = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
        for f in files:
            if f.is_file():
                try:
                    parts.append(f.read_text(errors="replace"))
                except OSError:
                    continue
    return "\n".join(parts)


def plan_clean(target, op: str, keep: int) -> tuple[CleanPlan, list[Path]]:
    """What `clean` would remove (paths) and keep, without removing anything."""
    if keep < 0:
        raise UsageError(f"--keep {keep}: need 0 or more")
    ws = target.workspace(op)
    if not ws.is_dir():
        raise UsageError(f"no workspace for {op!r} in {target.root}", f"nothing to clean: run `flaloop init {op}`")
    citing = _citing_text(ws)
    last_gate = ws / "gate" / "last.json"
    if last_gate.is_file():
        citing += last_gate.read_text(errors="replace")
    runs = sorted((p for p in (ws / "runs").glob("*") if p.is_dir()), key=lambda p: p.name) \
        if (ws / "runs").is_dir() else []
    logs = sorted((ws / "gate").glob("gate-*.log"), key=lambda p: p.name)
    sweeps = sorted((p for p in (ws / "sweeps").glob("*") if p.is_dir()), key=lambda p: p.name) \
        if (ws / "sweeps").is_dir() else []
    plan, doomed = CleanPlan(), []
    for group in (runs, logs, sweeps):
        newest = set(group[len(group) - keep:]) if keep else set()
        for p in group:
            rel = str(p.relative_to(ws))
            if p in newest:
                plan.kept.append(rel)
            elif p.name in citing:
                plan.kept.append(rel)
                plan.cited.append(rel)
            else:
                plan.removed.append(rel)
                plan.freed_bytes += dir_bytes(p) if p.is_dir() else p.stat().st_size
                doomed.append(p)
    return plan, doomed


def removed_sweeps(plan: CleanPlan) -> list[str]:
    """The stamps of the sweeps a clean removes (their refs go with them)."""
    return [Path(rel).name for rel in plan.removed if rel.startswith("sweeps/")]


def clean(target, op: str, keep: int, dry_run: bool = False) -> CleanPlan:
    """Remove old run directories, gate logs and sweeps of the op (see module docstring)."""
    plan, doomed = plan_clean(target, op, keep)
    if not dry_run:
        for p in doomed:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink(missing_ok=True)
    return plan
