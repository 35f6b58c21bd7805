"""`flaloop iter OP --from-sweep SWEEP REF`: a sweep's candidate becomes one iteration.

The sweep measured a commit against its base; the iteration measures the working tree against the
best kept iteration, with the full gate, and commits one change. So the candidate's change (its
diff from the sweep's base) is applied to the working tree, which must hold nothing else: it is
the user's, and nothing of theirs may be overwritten or mixed in. The row and the commit say which
sweep and candidate the change came from, and what the sweep measured.
"""

from __future__ import annotations

from pathlib import Path

from flaloop.core import git
from flaloop.core.errors import UsageError
from flaloop.core.workspace import SWEEP_FILE, shared_sweeps, sweep_file
from flaloop.sweep import record as sweep_record


def find_sweep(target, op: str, where: str) -> Path:
    """A sweep by its directory, its sweep.json, or its stamp under the op's sweeps directory."""
    p = Path(where).expanduser()
    for cand in (p, target.root / p, target.workspace(op).sweeps / where, shared_sweeps(target.root) / where):
        if sweep_file(cand).is_file() or (cand.is_file() and cand.name == SWEEP_FILE):
            return cand
    known = sorted(d.name for d in target.workspace(op).sweeps.glob("*/") if sweep_file(d).is_file())
    raise UsageError(f"no sweep at {where!r}", "name its directory or its stamp; sweeps of " + op + ": "
                     + (", ".join(known[-5:]) or "none yet (`flaloop sweep OP --candidates ...`)"))


def source(target, op: str, where: str, name: str) -> dict:
    """What the iteration takes from the sweep: the candidate's commit, the sweep's base and numbers."""
    path = find_sweep(target, op, where)
    rec = sweep_record.read(path)
    if op not in rec.ops:
        raise UsageError(f"the sweep {rec.path} measured {', '.join(rec.ops)}, not {op}",
                         f"name a sweep of {op} (profile/{op}-opt/sweeps/)")
    row = rec.row(name)
    if row.status != "ok":
        what = "was blocked" if row.status == "blocked" else "could not be measured"
        raise UsageError(f"{row.ref} {what} in that sweep: {row.reason or row.verdict}",
                         "only a measured candidate is iterated from a sweep: fix it, then sweep again "
                         "(or make the change in the working tree and run `flaloop iter` on it)")
    git.require_commit(target.root, row.commit, f"the sweep's candidate {row.ref}")
    return {"sweep": str(Path(rec.path).parent), "stamp": Path(rec.path).parent.name, "ref": row.ref,
            "commit": row.commit, "base": rec.base.commit, "rank": row.rank, "of": len(rec.rows),
            "geomean": row.geomean, "verdict": row.verdict}


def apply(target, src: dict) -> list[str]:
    """Put the candidate's change in the working tree; the paths it changed."""
    if git.changed_paths(target.root):
        raise UsageError("the working tree has uncommitted changes; --from-sweep puts the candidate's change "
                         "there and never mixes it with yours",
                         "commit them, or set them aside yourself, then rerun")
    diff = git.diff_between(target.root, src["base"], src["commit"])
    if not diff.strip():
        raise UsageError(f"{src['ref']} changes nothing against the sweep's base {src['base'][:12]}")
    git.apply_to_worktree(target.root, diff)
    return git.changed_paths(target.root)


def describe(src: dict) -> str:
    g = src.get("geomean") or {}
    measured = f"{g['speedup']:.4f}x [{g['ci_low']:.4f}, {g['ci_high']:.4f}] vs {src['base'][:12]}" if g else "-"
    return (f"from sweep {src['stamp']}: {src['ref']} ({src['commit'][:12]}), ranked {src['rank']} of {src['of']}, "
            f"{measured}")
