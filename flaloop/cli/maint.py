"""`flaloop clean`: prune old run records, gate logs and sweeps of an op's workspace."""

from __future__ import annotations

from typing import Annotated

import typer

from flaloop.bench import forkservers
from flaloop.cli.app import JsonOpt, LockOptions, PyOpt, RepoOpt, app, command, emit_json, human, with_options
from flaloop.core import git, workspace
from flaloop.task.target import Target


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@app.command("clean")
@command
@with_options(LockOptions)
def clean_cmd(
    op: str,
    keep: Annotated[int, typer.Option("--keep", help="Keep the newest N run records, gate logs and sweeps.")] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
    lock_options: LockOptions = None,  # type: ignore[assignment]
    repo: RepoOpt = None, python: PyOpt = None, as_json: JsonOpt = False,
) -> None:
    """Remove old run records, gate logs and sweeps (with their refs/flaloop/sweeps/ refs); keep the newest N
    and every one an iteration or report cites. Also stops this checkout's warm fork servers (they start
    again with the next bench); other checkouts' are left alone."""
    target = Target.discover(repo, python)
    console = human(as_json)
    ws = target.workspace(op)
    if not ws.exists():  # before the lock, which would create the workspace
        ws.plan_clean(keep)
    with lock_options.hold(target, op, console, "clean"):
        before = ws.usage()
        plan = ws.clean(keep, dry_run)
        refs = 0 if dry_run else sum(git.drop_refs(target.root, f"sweeps/{stamp}/")
                                     for stamp in plan.removed_sweeps())
        after = ws.usage()
    stopped = 0 if dry_run else forkservers.stop_all(owner=str(target.root))
    if as_json:
        emit_json({"ok": True, "op": op, "dry_run": dry_run, **plan.to_dict(), "usage_before": before,
                   "usage": after, "forkservers_stopped": stopped, "refs_dropped": refs})
        return
    verb = "would remove" if dry_run else "removed"
    n_sweeps = len(plan.removed_sweeps())
    console.print(f"{verb} {len(plan.removed) - n_sweeps} run record(s) and gate log(s)"
                  + (f" and {n_sweeps} sweep(s)" if n_sweeps else "") + f" ({_mb(plan.freed_bytes)}); "
                  f"kept {len(plan.kept)}, {len(plan.cited)} of them cited by an iteration or the report")
    for rel in plan.removed if dry_run else []:
        console.print(f"  {rel}")
    if stopped:
        console.print(f"stopped {stopped} warm fork server(s)")
    console.print("workspace: " + ", ".join(f"{area} {_mb(after[area])}" for area in (*workspace.AREAS, "other"))
                  + f"; total {_mb(after['total'])}")
