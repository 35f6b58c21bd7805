"""An op's workspace (`profile/<op>-opt/` beside the target's files): every path in it, and pruning.

    contract.json           the task contract (task/contract.py); docs/draft.md its text for people
    runs/<stamp>-<label>/   one directory per bench run: record.json, op-declared.json, worker logs
    gate/                   last.json, gate-<stamp>.log, baseline-<key>.json, green-<key>.json, calls.json
    triton-cache/           Triton's kernels and autotune picks (bench/run.triton_cache)
    iters/NNNN.json         the loop's iterations; decisions/NNN-KIND.json, dispatch/NNN.json (loop/store.py)
    OPT_LOG.md, dispatch.md, TRAPS.md   the loop's documents; .rendered/ what flaloop last wrote into them
    archive/<time>/         a loop's records and documents set aside when a new base starts a new log
    trace/<stamp>/          profile.json of `flaloop profile` (and its traces)
    explain/<stamp>/        explain.json of `flaloop explain`
    sanitize/<stamp>/       sanitize.json and cells.json of `flaloop sanitize`
    model/<stamp>-<kind>/   record.json of `flaloop model`
    sweeps/<stamp>/         sweep.json, sweep.md, sweep.png and the candidates' run directories
    report/                 REPORT.md, report.json, the plots, comment.md of `flaloop report`
    .lock                   the workspace lock (core/locks.py)

A sweep of several ops is kept in `profile/sweeps/<stamp>/` (`shared_sweeps`). Paths inside
records are relative to the workspace (`rel`, read back by `path_of`). What a command keeps only
for itself inside a directory it was given (a worker's log and dumps in its run directory, the
step scripts' outputs, sweep.md beside sweep.json, report.json beside REPORT.md, which `--out` may
put anywhere) is named where it is written; every path another module reads back is named here.

`clean` keeps the newest N run directories, gate logs and sweeps, and every one that an
iteration record, OPT_LOG.md, dispatch.md or a report names; it never touches iters/, OPT_LOG.md,
the contract, caches or baselines. A sweep removed takes its `refs/flaloop/sweeps/<stamp>/` refs
along (the caller drops them: `CleanPlan.removed_sweeps`).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from flaloop.core.errors import UsageError
from flaloop.core.fsutil import dir_bytes

PROFILE = "profile"  # the folder of every op's workspace, in the target's checkout
SUFFIX = "-opt"
REPORT_FILE = "REPORT.md"  # the report's markdown, in report/ or wherever --out says
RECORD_FILE = "record.json"  # a run's record, in its run directory (a bench run's, a model check's)
SWEEP_FILE = "sweep.json"
PROFILE_FILE = "profile.json"
EXPLAIN_FILE = "explain.json"
SANITIZE_FILE = "sanitize.json"

AREAS = ("runs", "gate", "triton-cache", "iters", "trace", "sweeps")
# Files and folders whose text may cite a run record or gate log by its name.
CITING = ("iters", "OPT_LOG.md", "dispatch.md", "report", "reports", "report.md", "report.json")
# What a new loop moves aside (`archive_loop`).
LOOP_RECORDS = ("iters", "decisions", "dispatch", "OPT_LOG.md", "dispatch.md", ".rendered")


def profile_dir(home: Path) -> Path:
    """Where the workspaces of a checkout are."""
    return Path(home) / PROFILE


def rel_dir(op: str) -> str:
    """The op's workspace relative to its checkout, as messages write it."""
    return f"{PROFILE}/{_dir_name(op)}"


def _dir_name(op: str) -> str:
    return f"{op}{SUFFIX}"


def shared_sweeps(home: Path) -> Path:
    """Where a sweep of several ops is kept."""
    return profile_dir(home) / "sweeps"


def record_file(run_dir: Path) -> Path:
    return Path(run_dir) / RECORD_FILE


def sweep_file(sweep_dir: Path) -> Path:
    return Path(sweep_dir) / SWEEP_FILE


@dataclass(frozen=True)
class Workspace:
    """`profile/<op>-opt/` of one op: each path in it by name."""

    path: Path

    @classmethod
    def at(cls, home: Path, op: str) -> Workspace:
        """The op's workspace in the checkout `home`."""
        return cls(profile_dir(home) / _dir_name(op))

    @classmethod
    def of(cls, where: Workspace | str | os.PathLike) -> Workspace:
        """A workspace given as one, or by its directory."""
        return where if isinstance(where, Workspace) else cls(Path(where))

    @staticmethod
    def every(home: Path) -> list[Workspace]:
        """The workspaces of every op in the checkout `home`, by name."""
        return [Workspace(p) for p in sorted(profile_dir(home).glob(f"*{SUFFIX}")) if p.is_dir()]

    @property
    def op(self) -> str:
        return self.path.name[: -len(SUFFIX)]

    @property
    def home(self) -> Path:
        """The checkout whose `profile/` holds it."""
        return self.path.parent.parent

    def exists(self) -> bool:
        return self.path.is_dir()

    def rel(self, path: str | Path | None) -> str | None:
        """A path as records store it: relative to the workspace when inside it."""
        if not path:
            return None
        p = Path(path).resolve()
        try:
            return str(p.relative_to(self.path.resolve()))
        except ValueError:
            return str(p)

    def path_of(self, rel: str | Path) -> Path:
        """A path a record stores (`rel`'s answer) as a path: absolute ones as they are."""
        return Path(rel) if Path(rel).is_absolute() else self.path / rel

    # -- the task ---------------------------------------------------------------------------

    @property
    def contract(self) -> Path:
        return self.path / "contract.json"

    @property
    def draft(self) -> Path:
        return self.path / "docs" / "draft.md"

    # -- measurements -----------------------------------------------------------------------

    @property
    def runs(self) -> Path:
        return self.path / "runs"

    def run_dir(self, name: str) -> Path:
        return self.runs / name

    def run_dirs(self) -> list[Path]:
        """Every run directory, oldest first (their names start with the UTC stamp)."""
        return sorted((p for p in self.runs.glob("*") if p.is_dir()), key=lambda p: p.name) \
            if self.runs.is_dir() else []

    def run_records(self) -> list[Path]:
        """The record.json of every run, oldest first."""
        return sorted(self.runs.glob(f"*/{RECORD_FILE}"))

    @property
    def triton_cache(self) -> Path:
        return self.path / "triton-cache"

    # -- the gate ---------------------------------------------------------------------------

    @property
    def gate(self) -> Path:
        return self.path / "gate"

    @property
    def gate_last(self) -> Path:
        """The user's tree's last gate result."""
        return self.gate / "last.json"

    def gate_log(self, stamp: str, n: int = 1) -> Path:
        """The `n`th gate log of the second `stamp` (two gates of one second keep both)."""
        return self.gate / (f"gate-{stamp}.log" if n == 1 else f"gate-{stamp}-{n}.log")

    def gate_logs(self) -> list[Path]:
        return sorted(self.gate.glob("gate-*.log"), key=lambda p: p.name)

    def gate_baseline(self, key: str) -> Path:
        """The base's cached outcomes of one kind of run (`key` starts with the base commit's 12)."""
        return self.gate / f"baseline-{key}.json"

    def gate_baselines(self, base_commit: str) -> list[Path]:
        return sorted(self.gate.glob(f"baseline-{base_commit[:12]}-*.json"))

    def gate_green(self, key: str) -> Path:
        """A green gate, kept for reuse by a gate of the same `reuse_key`."""
        return self.gate / f"green-{key}.json"

    def gate_greens(self) -> list[Path]:
        return sorted(self.gate.glob("green-*.json"))

    @property
    def gate_calls(self) -> Path:
        """The frozen test's calls into the op's package, recorded at the base (task/testcalls.py)."""
        return self.gate / "calls.json"

    # -- the loop ---------------------------------------------------------------------------

    @property
    def iters(self) -> Path:
        return self.path / "iters"

    def iteration_file(self, n: int) -> Path:
        return self.iters / f"{n:04d}.json"

    def iteration_files(self) -> list[Path]:
        return sorted(self.iters.glob("[0-9]*.json"))

    @property
    def decisions(self) -> Path:
        return self.path / "decisions"

    def decision_file(self, n: int, kind: str) -> Path:
        return self.decisions / f"{n:03d}-{kind}.json"

    @property
    def dispatch(self) -> Path:
        """The measured rows of dispatch.md, one file each."""
        return self.path / "dispatch"

    def dispatch_file(self, n: int) -> Path:
        return self.dispatch / f"{n:03d}.json"

    @property
    def opt_log(self) -> Path:
        return self.path / "OPT_LOG.md"

    @property
    def dispatch_md(self) -> Path:
        return self.path / "dispatch.md"

    @property
    def traps_md(self) -> Path:
        return self.path / "TRAPS.md"

    def rendered_copy(self, doc: Path) -> Path:
        """What flaloop last wrote into a rendered document (to spot hand edits)."""
        return self.path / ".rendered" / doc.name

    def archive_loop(self, stamp: str) -> Path | None:
        """Move the loop's records and documents aside (a new base starts a new log); nothing is deleted."""
        present = [n for n in LOOP_RECORDS if (self.path / n).exists()]
        if not present:
            return None
        dest = self.path / "archive" / stamp
        dest.mkdir(parents=True, exist_ok=True)
        for n in present:
            os.replace(self.path / n, dest / n)
        return dest

    # -- what explains and checks a result --------------------------------------------------

    @property
    def trace(self) -> Path:
        return self.path / "trace"

    def profile_docs(self) -> list[Path]:
        """The profile.json of every `flaloop profile`, oldest first."""
        return sorted(self.trace.glob(f"*/{PROFILE_FILE}"))

    @property
    def explain(self) -> Path:
        return self.path / "explain"

    def explain_docs(self) -> list[Path]:
        return sorted(self.explain.glob(f"*/{EXPLAIN_FILE}"))

    @property
    def sanitize(self) -> Path:
        return self.path / "sanitize"

    def sanitize_docs(self) -> list[Path]:
        return sorted(self.sanitize.glob(f"*/{SANITIZE_FILE}"))

    @property
    def model(self) -> Path:
        return self.path / "model"

    def model_records(self) -> list[Path]:
        """The record.json of every model check, oldest first."""
        return sorted(self.model.glob(f"*/{RECORD_FILE}"))

    @property
    def sweeps(self) -> Path:
        return self.path / "sweeps"

    @property
    def report(self) -> Path:
        return self.path / "report"

    @property
    def lock_file(self) -> Path:
        return self.path / ".lock"

    # -- disk use and cleaning --------------------------------------------------------------

    def usage(self) -> dict:
        """Bytes per area, `other` for the rest, `total`, and `n_runs`."""
        out = {area: dir_bytes(self.path / area) for area in AREAS}
        total = dir_bytes(self.path)
        out["other"] = max(0, total - sum(out.values()))
        out["total"] = total
        out["n_runs"] = sum(1 for p in self.runs.iterdir() if p.is_dir()) if self.runs.is_dir() else 0
        return out

    def _citing_text(self) -> str:
        parts = []
        for name in CITING:
            p = self.path / name
            files = [p] if p.is_file() else sorted(p.rglob("*")) if p.is_dir() else []
            for f in files:
                if f.is_file():
                    try:
                        parts.append(f.read_text(errors="replace"))
                    except OSError:
                        continue
        text = "\n".join(parts)
        if self.gate_last.is_file():
            text += self.gate_last.read_text(errors="replace")
        return text

    def plan_clean(self, keep: int) -> tuple[CleanPlan, list[Path]]:
        """What `clean` would remove (paths) and keep, without removing anything."""
        if keep < 0:
            raise UsageError(f"--keep {keep}: need 0 or more")
        if not self.exists():
            raise UsageError(f"no workspace for {self.op!r} in {self.home}",
                             f"nothing to clean: run `flaloop init {self.op}`")
        citing = self._citing_text()
        sweeps = sorted((p for p in self.sweeps.glob("*") if p.is_dir()), key=lambda p: p.name) \
            if self.sweeps.is_dir() else []
        plan, doomed = CleanPlan(), []
        for group in (self.run_dirs(), self.gate_logs(), sweeps):
            newest = set(group[len(group) - keep:]) if keep else set()
            for p in group:
                rel = str(p.relative_to(self.path))
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

    def clean(self, keep: int, dry_run: bool = False) -> CleanPlan:
        """Remove old run directories, gate logs and sweeps (see the module docstring)."""
        plan, doomed = self.plan_clean(keep)
        if not dry_run:
            for p in doomed:
                if p.is_dir():
                    shutil.rmtree(p)
                else:
                    p.unlink(missing_ok=True)
        return plan


@dataclass
class CleanPlan:
    removed: list[str] = field(default_factory=list)  # workspace-relative paths
    kept: list[str] = field(default_factory=list)
    cited: list[str] = field(default_factory=list)  # kept because something names them
    freed_bytes: int = 0

    def to_dict(self) -> dict:
        return {"removed": self.removed, "kept": self.kept, "cited": self.cited, "freed_bytes": self.freed_bytes}

    def removed_sweeps(self) -> list[str]:
        """The stamps of the sweeps it removes (their refs go with them)."""
        return [Path(rel).name for rel in self.removed if rel.startswith("sweeps/")]
